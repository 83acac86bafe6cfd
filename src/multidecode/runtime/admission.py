"""Admission: the one rule that decides whether a job may start, whoever drives the runtime.

The server and the batch job both go through it (the server refuses what does not fit now, the
batch job waits for room), so a job is counted the same way everywhere: it holds a `Reservation`
(its cache tokens, its branches and their bytes) from its submission to its end, and the jobs in
flight together stay within the `Limits` and the bytes the runtime may use. A job that would not
fit even alone is `TooLarge`; with `Limits.oversized_runs_alone` only its bytes make it so, and a
job over the token or branch limit runs once nothing else is reserved.

This is plain bookkeeping, with no model and no lock: `ForestRuntime` calls it under its own.
"""

from __future__ import annotations

from .jobs import NOTHING, Limits, Overloaded, Reservation, TooLarge


class Admission:
    """What the jobs in flight hold, against the limits (see the module notes).

    limits: the caps in tokens and branches; budget_bytes: the bytes jobs may hold together.
    """

    def __init__(self, limits: Limits, budget_bytes: int) -> None:
        self.limit = Reservation(limits.max_live_tokens, limits.max_branches, budget_bytes)
        self.oversized_runs_alone = limits.oversized_runs_alone
        self.held = NOTHING
        self.jobs = 0

    def refusal(self, need: Reservation) -> TooLarge | Overloaded | None:
        """Why a job that needs `need` may not start now (`TooLarge`: never; `Overloaded`: not
        until jobs in flight end), or None when it may."""
        if need.bytes > self.limit.bytes or (need.exceeds(self.limit) and not self.oversized_runs_alone):
            return TooLarge(need, self.limit)
        if self.jobs and (self.held + need).exceeds(self.limit):
            return Overloaded.at_capacity(self.held)
        return None

    def hold(self, need: Reservation) -> None:
        self.held, self.jobs = self.held + need, self.jobs + 1

    def release(self, need: Reservation) -> None:
        self.held, self.jobs = self.held - need, self.jobs - 1


__all__ = ["Admission"]
