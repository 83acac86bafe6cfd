"""Pacing prefill: how many prompt tokens a step may feed beside the streams already decoding.

A request's prompt used to be fed in one step, and every stream already decoding waited for that
step: a 4,000-token prompt made one inter-token gap of seconds. The runtime now gives each step a
**budget** of prompt tokens; a prompt over it is fed in pieces over several steps (each piece a
chain under the last, see `branches.BranchGroup.pace_prompt`). The prompts whose rest fits the
larger **finish budget** go first, whole; the others share what the budget has left in the order
they were admitted (the first gets it, the next what it leaves), so a long prompt's wait is its
own pieces plus those of the prompts admitted before it, and a short one's a step or two.

The budget adapts to this machine by what its steps cost, measured here, not assumed:

- **pace**: a moving average of the seconds of the steps that fed no prompt token while streams
  decoded (the gap a stream sees when nothing arrives). The pace grows as a long prompt fills the
  cache (every row attends over it), so after `PACE_EVERY` steps that read prompt tokens one step
  reads none and measures it again, rather than count that growth as the prompt tokens' cost;
- **prompt token cost**: a decaying ratio of the seconds that steps carrying prompt tokens took
  beyond that pace, over the prompt tokens they fed (a step that fed only prompt tokens counts
  whole, which errs on the side of small pieces);
- **budget** = (stretch - 1) x pace / prompt token cost, between `MIN_PIECE` and `Limits.prefill_chunk`:
  a step carrying prompt tokens then takes about `stretch` times the pace, whatever the model,
  the device or the streams running. Until both are measured the budget is `prefill_chunk`;
- **finish budget** = (2 x stretch - 1) x pace / prompt token cost (at least the budget, at most
  the chunk): a step may take up to twice the stretch when the extra tokens **finish** a prompt.
  Cutting a prompt's last 40 tokens into 4 pieces spares each stream a few milliseconds once but
  costs that request 3 more steps before its first token, and every request queued behind it as
  many; on a CPU, where a prompt token costs about a millisecond, pieces alone made the first
  token of a short prompt wait 4 to 15 steps under load (`bench serve`, 90% shared). A long
  prompt still comes in pieces, so a stream's gaps while it is read stay at the stretch but for
  the step that finishes it.

A step's time is waited for by the streams (each for its next token) and by the jobs prefilling
(each for its first), so the stretch grows when more jobs wait for a first token than streams
for a next one: it is at least 1 + prefilling / streams. Where the machine cannot keep up with
the prompts arriving (a CPU, many unshared prompts), pieces grow back toward whole prompts rather
than leave a queue of requests waiting to spare a few streams' pace. When no stream decodes
there is nobody to keep waiting: the prompts are fed whole (no budget).
Plain arithmetic, no model, no clock: `ForestRuntime` times its steps and reports them here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MIN_PIECE = 8
"""The fewest prompt tokens a paced step feeds, however costly a token: prefill always advances."""
PACE_WEIGHT = 0.2
"""The weight of the latest decoding step in the pace's moving average."""
COST_DECAY = 0.8
"""How much the prompt token cost keeps of what it measured before, per step that fed prompt tokens."""
PACE_EVERY = 8
"""After this many steps that read prompt tokens beside streams, one that reads none measures the pace again."""
RECENT = 4096
"""How many of the latest steps `PrefillPacer.recent` keeps."""


@dataclass(frozen=True)
class PacedStep:
    """One step as the pacer saw it: the streams that decoded in it (each got its tokens), the
    prompt tokens it fed, the budget it allowed (None: no stream to keep waiting, prompts whole)
    and the seconds it took."""

    streams: int
    prompt_tokens: int
    budget: int | None
    seconds: float = 0.0


class PrefillPacer:
    """The per-step prompt token budget (see the module notes).

    chunk: the most prompt tokens a step feeds while streams decode (0: prompts whole, no pacing);
    stretch: how many times the pace a step carrying prompt tokens may take (0: no adapting, the
    budget is always `chunk`).
    """

    def __init__(self, chunk: int, stretch: float) -> None:
        self.chunk, self.stretch = chunk, stretch
        self.pace_s: float | None = None  # seconds of a step that feeds no prompt token
        self._extra_s = 0.0  # decayed seconds steps took for their prompt tokens
        self._tokens = 0.0  # decayed prompt tokens those steps fed
        self._since_pace = 0  # steps that read prompt tokens beside streams since the pace was last measured
        self.recent: deque[PacedStep] = deque(maxlen=RECENT)

    @property
    def token_s(self) -> float | None:
        """Measured seconds per prompt token fed beside the streams (None until measured)."""
        return self._extra_s / self._tokens if self._tokens and self._extra_s > 0 else None

    def budget(self, streams: int, prefilling: int = 1) -> int | None:
        """The prompt tokens the next step may feed while `streams` jobs decode and `prefilling`
        jobs wait for their first token (None: any number)."""
        if not streams or not self.chunk:
            return None
        if not self.stretch or self.pace_s is None or self.token_s is None:
            return self.chunk
        if self._since_pace >= PACE_EVERY:
            return 0  # a step of streams alone, to measure their pace as the cache grows
        return self._fits(self._stretch(streams, prefilling) - 1)

    def finish_budget(self, streams: int, prefilling: int = 1) -> int | None:
        """The prompt tokens the next step may feed when they finish prompts (see the module
        notes): at least `budget`, and as much while nothing is measured or adapted."""
        budget = self.budget(streams, prefilling)
        if not budget or not self.stretch or self.pace_s is None or self.token_s is None:
            return budget
        return max(budget, self._fits(2 * self._stretch(streams, prefilling) - 1))

    def _stretch(self, streams: int, prefilling: int) -> float:
        return max(self.stretch, 1 + prefilling / streams)

    def _fits(self, paces: float) -> int:
        """The prompt tokens that add `paces` times the pace to a step, within [MIN_PIECE, chunk]."""
        fits = round(paces * self.pace_s / self.token_s)
        return max(min(fits, self.chunk), min(MIN_PIECE, self.chunk))

    def record(self, step: PacedStep) -> None:
        """Learn from a step that ran (its `seconds` set)."""
        self.recent.append(step)
        if not step.prompt_tokens:
            if step.streams:
                last, self._since_pace = self.pace_s, 0
                self.pace_s = step.seconds if last is None else last + PACE_WEIGHT * (step.seconds - last)
            return
        self._since_pace += bool(step.streams)
        beyond = step.seconds - (self.pace_s if step.streams and self.pace_s is not None else 0.0)
        self._extra_s = COST_DECAY * self._extra_s + max(beyond, 0.0)
        self._tokens = COST_DECAY * self._tokens + step.prompt_tokens


__all__ = ["MIN_PIECE", "PACE_EVERY", "PacedStep", "PrefillPacer"]
