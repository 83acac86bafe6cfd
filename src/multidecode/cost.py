"""What a forward costs on this hardware, how often drafts are accepted, and the draft budget.

Speculation pays only when the tokens it gains are worth more than what the extra draft rows
cost in the forward. Both sides are measured, never assumed:

- **cost curve** t(q, L): seconds for one forward that feeds q new tokens over L cached ones.
  On a GPU it is nearly flat in q; on this project's CPU 2 or 3 rows cost 1.04x-1.15x one, 4 cost
  1.44x and 8 cost 1.82x (on another CPU, where one row takes a matrix-vector path, 2 rows cost
  1.73x). The shape decides what speculation may cost, so it is measured, never assumed. `measure_cost` times the engine's own
  forwards for a few q at two context lengths, once per model, device, dtype and thread count,
  and `cost_curve` keeps the result on disk beside the converted models.
- **acceptance**: how often a draft node is accepted once its parent is, tracked per branch and
  per *bucket* (the proposer's kind of guess, first candidate or alternative), with the rates
  of the whole group as the prior of each branch (`AcceptanceTracker`). Because verification
  accepts exactly the draft tokens that equal the tokens the branch then produces (see
  `verify`), a proposal's outcome is known from the branch's later tokens whether or not it was
  fed: every step teaches the tracker, including steps that speculated nothing.
- **budget** (`choose_draft_count`): each step, every draft node's chance of acceptance is the
  product of the rates along its path. With M required rows (each branch's newest token) and
  the D most likely draft nodes added, the step is expected to yield (branches + sum of the D
  chances) tokens in t(M + D, L) seconds; D maximises that rate. D = 0 (no speculation) wins
  whenever drafts would not pay for their rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .engine import Engine
from .user_cache import cache_dir

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Tokens per forward timed by `measure_cost`; larger forwards are extrapolated linearly."""

CONTEXTS = (128, 1024)
"""Cached tokens under the timed forwards; other lengths are interpolated linearly."""

PRIOR_WEIGHT = 4.0
"""How many observations a prior rate is worth."""


# ---------------------------------------------------------------------- the cost curve
@dataclass(frozen=True)
class CostCurve:
    """Forward time by new tokens q and cached tokens L, from measurements.

    sizes: the q measured (ascending, starting at 1); contexts: the L measured (ascending);
    seconds[c][i]: the time of a forward of sizes[i] tokens over contexts[c] cached ones.
    """

    sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    key: str = ""

    def time(self, q: int, context: int = 0) -> float:
        """Seconds for a forward of q tokens over `context` cached tokens (interpolated)."""
        rows = [_interpolate(self.sizes, row, q) for row in self.seconds]
        if len(rows) == 1:
            return rows[0]
        return max(_interpolate(self.contexts, rows, context), 1e-9)

    def relative(self, q: int, context: int = 0) -> float:
        """t(q) / t(1) at `context`."""
        return self.time(q, context) / self.time(1, context)

    @classmethod
    def from_relative(cls, relative: dict[int, float]) -> CostCurve:
        """A curve from relative costs {q: t(q)/t(1)} (for tests and what-if studies)."""
        sizes = tuple(sorted(relative))
        return cls(sizes, (0,), (tuple(float(relative[q]) for q in sizes),))

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostCurve:
        return cls(tuple(data["sizes"]), tuple(data["contexts"]), tuple(tuple(r) for r in data["seconds"]),
                   data.get("key", ""))


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys); linear extrapolation past either end."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def model_key(model) -> str:
    """What a cost curve depends on: the model's shape, dtype, device, attention kernel, torch
    version and thread count."""
    param = next(model.parameters())
    device = param.device
    facts = {
        "config": model.config.to_json_string(use_diff=False),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(param.dtype),
        "device": f"{device.type}:{device_name(device)}",
        "attention": getattr(model.config, "_attn_implementation", None),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def device_name(device: torch.device) -> str:
    """What the hardware is, as far as a cost curve cares: the GPU's name, or the CPU's model and
    core count (two different CPUs sharing one cache folder must not share a curve)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} x{os.cpu_count()}"


def measure_cost(model, *, sizes: Sequence[int] = SIZES, contexts: Sequence[int] = CONTEXTS,
                 repeats: int = 3) -> CostCurve:
    """Time the engine's forwards of each size over each context length (median of `repeats`,
    after one warm-up), on a scratch engine: the model's other work is not disturbed.

    Draft rows are fed as siblings under the context's last token, the masked (forest) path that
    a speculative step takes; times are made non-decreasing in q.
    """
    generator = torch.Generator().manual_seed(0)
    engine = Engine(model)
    vocab = engine.vocab_size
    limit = engine.max_positions or 1 << 30
    contexts = [c for c in contexts if c + 2 < limit] or [max(1, limit // 4)]
    sizes = sorted({int(q) for q in sizes} | {1})
    engine.reserve(max(contexts) + max(sizes))
    table = []
    for context in contexts:
        engine.compact([])
        leaf = engine.feed_chain(torch.randint(3, vocab, (context,), generator=generator).tolist()).nodes[-1]
        row = []
        for q in sizes:
            times = []
            for attempt in range(repeats + 1):
                tokens = torch.randint(3, vocab, (q,), generator=generator).tolist()
                started = time.perf_counter()
                fed = engine.feed(tokens, [leaf] * q, logits_for=range(q)).nodes
                if engine.device.type == "cuda":
                    torch.cuda.synchronize(engine.device)
                elapsed = time.perf_counter() - started
                engine.drop(fed)
                if attempt:  # the first is a warm-up
                    times.append(elapsed)
            row.append(sorted(times)[len(times) // 2])
        for i in range(1, len(row)):
            row[i] = max(row[i], row[i - 1])
        table.append(tuple(row))
    return CostCurve(tuple(sizes), tuple(contexts), tuple(table), model_key(model))


_CURVES: dict[str, CostCurve] = {}


def costs_dir() -> Path:
    """Where measured curves are kept: $MULTIDECODE_COSTS, else `costs/` in the model cache folder."""
    if os.environ.get("MULTIDECODE_COSTS"):
        return Path(os.environ["MULTIDECODE_COSTS"]).expanduser()
    return cache_dir() / "costs"


def cost_curve(model, *, folder: Path | None = None, measure: bool = True) -> CostCurve | None:
    """The cost curve of `model` here: from memory, else from disk (`folder`, default
    `costs_dir()`), else measured and saved (written atomically; a folder that cannot be written
    only loses the saving). measure=False: None instead of measuring."""
    key = model_key(model)
    if key in _CURVES:
        return _CURVES[key]
    if folder is None:
        folder = costs_dir()
    path = Path(folder) / f"{key}.json"
    curve = None
    try:
        curve = CostCurve.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        curve = None
    if curve is None:
        if not measure:
            return None
        curve = measure_cost(model)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(curve.as_dict(), indent=1), encoding="utf-8")
            os.replace(partial, path)
        except OSError:
            pass
    _CURVES[key] = curve
    return curve


# ---------------------------------------------------------------------- acceptance
Bucket = tuple[int, bool]
"""(the proposer's kind of guess, whether the node is an alternative to an earlier sibling)."""


@dataclass
class _Counts:
    accepted: float = 0.0
    tried: float = 0.0

    def rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.accepted + weight * prior) / (self.tried + weight)


@dataclass
class _Pending:
    """A proposal waiting for the branch's later tokens: its tree and how far it matched."""

    start: int  # index in the branch's output of the first guessed token
    tokens: list[int]
    children: dict[int, list[int]]  # node -> its children, -1 for the top level
    buckets: list[Bucket]
    priors: list[float]
    at: int = -1  # the deepest node matched so far (-1: none yet)
    depth: int = 0


@dataclass
class AcceptanceTracker:
    """Acceptance rates of one group's drafts, per branch, with the group's rates as the prior.

    `record_proposal` remembers a proposal (fed or not); `resolve` scores remembered proposals
    against the tokens the branch produced since; `node_chances` estimates each node of a new
    proposal.
    """

    pooled: dict[Bucket, _Counts] = field(default_factory=dict)
    branches: dict[int, dict[Bucket, _Counts]] = field(default_factory=dict)
    pending: dict[int, list[_Pending]] = field(default_factory=dict)
    max_pending: int = 32

    def rate(self, branch: int, bucket: Bucket, prior: float) -> float:
        pooled = self.pooled.get(bucket, _Counts()).rate(prior)
        own = self.branches.get(branch, {}).get(bucket)
        return own.rate(pooled) if own is not None else pooled

    def node_chances(self, branch: int, draft) -> list[float]:
        """Each node's estimated chance of being accepted: the product of the rates on its path."""
        chances: list[float] = []
        for parent, bucket, prior in zip(draft.parents, _buckets(draft), draft.priors):
            above = 1.0 if parent < 0 else chances[parent]
            chances.append(above * self.rate(branch, bucket, prior))
        return chances

    def record_proposal(self, branch: int, start: int, draft) -> None:
        if not len(draft):
            return
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(draft.parents):
            children.setdefault(parent, []).append(i)
        queue = self.pending.setdefault(branch, [])
        queue.append(_Pending(start, list(draft.tokens), children, _buckets(draft), list(draft.priors)))
        del queue[: -self.max_pending]

    def resolve(self, branch: int, output: Sequence[int], finished: bool) -> None:
        """Score remembered proposals of `branch` against its output so far."""
        queue = self.pending.get(branch, [])
        still = []
        for p in queue:
            done = False
            while p.start + p.depth < len(output):
                actual = output[p.start + p.depth]
                kids = p.children.get(p.at, [])
                match = None
                for kid in kids:
                    hit = p.tokens[kid] == actual
                    self._count(branch, p.buckets[kid], hit)
                    if hit:
                        match = kid
                if match is None:
                    done = True
                    break
                p.at, p.depth = match, p.depth + 1
            if not done and not finished and p.children.get(p.at):
                still.append(p)
        self.pending[branch] = still

    def _count(self, branch: int, bucket: Bucket, hit: bool) -> None:
        for counts in (self.pooled.setdefault(bucket, _Counts()),
                       self.branches.setdefault(branch, {}).setdefault(bucket, _Counts())):
            counts.tried += 1
            counts.accepted += hit


def _buckets(draft) -> list[Bucket]:
    return [(kind, rank > 0) for kind, rank in zip(draft.kinds, draft.ranks())]


# ---------------------------------------------------------------------- the budget
def choose_draft_count(curve: CostCurve, *, required: int, expected: float, chances: Sequence[float],
                       context: int = 0, margin: float = 0.03) -> int:
    """How many of the most likely draft nodes to feed with `required` other rows.

    expected: tokens the step yields without drafts; chances: each draft node's chance of being
    accepted (sorted best first). The count maximises expected tokens per second; a count above
    0 must beat no speculation by `margin` (estimates are noisy, a loss is worse than a miss).
    """
    if not chances or required < 1:
        return 0
    plain = expected / curve.time(required, context)
    best, best_rate = 0, plain * (1 + margin)
    gain = expected
    for d, chance in enumerate(chances, start=1):
        gain += chance
        rate = gain / curve.time(required + d, context)
        if rate > best_rate:
            best, best_rate = d, rate
    return best
