"""Eos cases for exactness tests: outputs cut at eos as `generate` cuts them, and a choice of eos.

Tests decode every branch to max_new_tokens with an eos no model produces, then derive the runs
with a real eos from those outputs: `truncate` gives what `generate` gives with a set of eos ids,
and `pick_eos` chooses eos ids, seen in the outputs, that stop some branches mid-run (at several
steps where the outputs allow) while at least one runs to the end.
"""

from __future__ import annotations

import itertools


def truncate(outputs: list[list[int]], eos: set[int]) -> list[list[int]]:
    """What generate gives with `eos`: each output cut after its first eos id (kept)."""
    cut = []
    for out in outputs:
        stop = next((j for j, t in enumerate(out) if t in eos), len(out) - 1)
        cut.append(out[: stop + 1])
    return cut


def pick_eos(outputs: list[list[int]], steps: int) -> list[int]:
    """One or two eos ids, seen in the outputs, that stop some branches before the end while at
    least one runs to max_new_tokens; among those, the choice with the most distinct stop steps."""
    seen = sorted({t for out in outputs for t in out})
    best, best_score = None, 0
    for eos in itertools.chain(itertools.combinations(seen, 1), itertools.combinations(seen, 2)):
        lengths = [len(o) for o in truncate(outputs, set(eos))]
        early = {n for n in lengths if n < steps}
        running = sum(1 for n, o in zip(lengths, outputs) if n == steps and o[-1] not in eos)
        if running and len(early) > best_score:
            best, best_score = list(eos), len(early)
    assert best is not None, "no eos choice stops a branch mid-run"
    return best
