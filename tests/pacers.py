"""A pacer for tests: budgets given, not measured, so a test counts tokens per step, not time."""

from __future__ import annotations

from multidecode.runtime.pacing import PrefillPacer


class FixedPacer(PrefillPacer):
    """A pacer whose budgets are given (`budget` beside streams, `finish` to finish prompts), so a
    test counts tokens per step, not time."""

    def __init__(self, budget: int, finish: int) -> None:
        super().__init__(budget, 1.5)
        self.fixed, self.finish = budget, finish

    def budget(self, streams: int, prefilling: int = 1) -> int | None:
        return self.fixed if streams else None

    def finish_budget(self, streams: int, prefilling: int = 1) -> int | None:
        return self.finish if streams else None
