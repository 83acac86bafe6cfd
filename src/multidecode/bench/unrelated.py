"""Benchmark: one decode step of R unrelated requests of P prompt tokens, as the server's one forest
row and three other ways, every step's logits checked against plain forwards (docs/serving.md,
"Attention over unrelated requests"; docs/benchmarks.md, "How the benchmarks measure")."""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Sequence

import torch

from ..engine import Engine
from ..errors import InvalidArgument, check_positive
from ..models.reading import quiet_transformers
from ..models.vetting import cache_argument
from .common import AnswersDiffer, Progress, torch_threads
from .results import VIEWS, Chart, Line, Panel, TextTable, View, environment, grid, new_result

FOREST_UNRELATED, FOREST_SHARED, SEPARATE, BATCH_ROWS = "forest_unrelated", "forest_shared", "separate", "batch_rows"
VARIANTS = (FOREST_UNRELATED, FOREST_SHARED, SEPARATE, BATCH_ROWS)
LABELS = {
    FOREST_UNRELATED: "one forest, R unrelated prompts (one row, mask over R*P slots)",
    FOREST_SHARED: "one forest, one prompt shared by all R (mask over P slots)",
    SEPARATE: "R separate forwards (an engine per request)",
    BATCH_ROWS: "R batch rows (transformers DynamicCache, batch R)",
}
SHORT = {FOREST_UNRELATED: "forest, unrelated", FOREST_SHARED: "forest, shared prompt", SEPARATE: "separate",
         BATCH_ROWS: "batch rows"}
STYLES = {FOREST_UNRELATED: ("o", "-", "tab:red"), FOREST_SHARED: ("s", "-", "tab:green"),
          SEPARATE: ("^", "--", "tab:grey"), BATCH_ROWS: ("D", "-", "tab:blue")}
"""Variant -> (marker, line style, colour) in the plot."""
RATIOS = {
    "unrelated_over_batch_rows": (FOREST_UNRELATED, BATCH_ROWS, "unrelated / batch rows"),
    "separate_over_unrelated": (SEPARATE, FOREST_UNRELATED, "separate / unrelated"),
    "unrelated_over_shared": (FOREST_UNRELATED, FOREST_SHARED, "unrelated / shared prompt"),
}
"""Ratio -> (variant, over variant, column header): the ratios of medians each cell reports."""
ATOL = 1e-4
"""Largest absolute logit difference allowed between a variant and its reference."""
NOTES = [
    ("ms_per_step is the median of the timed steps (min_ms, max_ms their range); a step includes taking its new "
     "slots back (Engine.drop, DynamicCache.crop), so every step sees the same context."),
    ("Prompts are random token ids (seeded); each request's prompt is its own, except forest_shared, where all R "
     "new tokens hang under the first request's prompt."),
    ("scores_per_head: queries x keys one step scores per layer and query head; the unrelated forest scores "
     "R x (R*P + R), batch rows and separate forwards R x (P + 1)."),
    ("max_abs_diff: the largest |logit - reference| over every step of the variant (warm-up included); the "
     "reference is one plain forward per request (per new token for forest_shared)."),
]


class LogitsDiffer(AnswersDiffer):
    """A variant's logits differ from its reference's by more than the tolerance."""


def check_close(variant: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> float:
    """The largest |got - want|; raises `LogitsDiffer` where it passes `atol` (or shapes differ)."""
    if got.shape != want.shape:
        raise LogitsDiffer(f"{variant} gave logits of shape {tuple(got.shape)}, the reference {tuple(want.shape)}")
    diff = (got.float().cpu() - want.float().cpu()).abs().max().item()
    if not diff <= atol:
        raise LogitsDiffer(f"{variant}'s logits differ from the reference's by {diff:.3g} (allowed: {atol:g})")
    return diff


class Step:
    """R requests of P prompt tokens, prefilled for each variant; `run(variant)` is one decode step
    (R new tokens, one per request) whose new slots are taken back, returning logits [R, vocab]."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], tokens: Sequence[int]) -> None:
        from transformers import DynamicCache

        r, p = len(prompts), len(prompts[0])
        self.model, self.tokens = model, list(tokens)
        self.device = next(model.parameters()).device
        # one forest of R roots; each prompt prefilled apart (its own forward), then steps are planned as usual
        self.forest = Engine(model, capacity=r * p + r, apart=True)
        self.roots_last = [self.forest.feed_chain(q, logits=False, owner=i).nodes[-1] for i, q in enumerate(prompts)]
        self.forest.apart = None
        self.shared = Engine(model, capacity=p + r)
        self.shared_last = self.shared.feed_chain(prompts[0], logits=False).nodes[-1]
        self.engines = [Engine(model, capacity=p + 1) for _ in prompts]
        self.engines_last = [e.feed_chain(q, logits=False).nodes[-1] for e, q in zip(self.engines, prompts)]
        self.cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            for i in range(len(self.engines[0].cache.layers)):
                layers = [e.cache.layers[i] for e in self.engines]
                self.cache.update(torch.cat([x.keys for x in layers]), torch.cat([x.values for x in layers]), i)
        self.ids = torch.tensor(self.tokens, dtype=torch.long, device=self.device)[:, None]  # [R, 1]
        self.positions = torch.full((r, 1), p, dtype=torch.long, device=self.device)
        self.mask = torch.ones((r, p + 1), dtype=torch.long, device=self.device)
        self.keys_per_query = {FOREST_UNRELATED: r * p + r, FOREST_SHARED: p + r, SEPARATE: p + 1, BATCH_ROWS: p + 1}

    def run(self, variant: str) -> torch.Tensor:
        return getattr(self, variant)()  # each variant is the method of its name

    def forest_unrelated(self) -> torch.Tensor:
        result = self.forest.feed(self.tokens, self.roots_last, logits_for=range(len(self.tokens)),
                                  owners=list(range(len(self.tokens))))
        self.forest.drop(result.nodes)
        return result.logits

    def forest_shared(self) -> torch.Tensor:
        result = self.shared.feed(self.tokens, [self.shared_last] * len(self.tokens),
                                  logits_for=range(len(self.tokens)))
        self.shared.drop(result.nodes)
        return result.logits

    def separate(self) -> torch.Tensor:
        return torch.cat([_one(e, last, t) for e, last, t in zip(self.engines, self.engines_last, self.tokens)])

    def batch_rows(self) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(input_ids=self.ids, position_ids=self.positions, attention_mask=self.mask,
                             use_cache=True, logits_to_keep=1, **{cache_argument(self.model): self.cache})
        self.cache.crop(-1)
        return out.logits[:, -1].float()

    def references(self) -> dict[str, torch.Tensor]:
        """What each variant must give: plain one-token forwards, one per request (per new token under
        the first prompt for the shared forest)."""
        own = self.separate()
        shared = torch.cat([_one(self.engines[0], self.engines_last[0], t) for t in self.tokens])
        return {FOREST_UNRELATED: own, FOREST_SHARED: shared, SEPARATE: own, BATCH_ROWS: own}


def _one(engine: Engine, last: int, token: int) -> torch.Tensor:
    """One token under `last`, taken back after: its logits [1, vocab]."""
    result = engine.feed([token], [last], logits_for=[0])
    engine.drop(result.nodes)
    return result.logits


def measure_cell(model, requests: int, prompt_tokens: int, *, steps: int, warmup: int, atol: float,
                 generator: torch.Generator, order: random.Random) -> dict:
    """One cell: prefill, check every variant's logits on every step, time the `steps` rounds."""
    started = time.perf_counter()
    vocab = model.get_input_embeddings().num_embeddings
    prompts = [torch.randint(0, vocab, (prompt_tokens,), generator=generator).tolist() for _ in range(requests)]
    tokens = torch.randint(0, vocab, (requests,), generator=generator).tolist()
    step = Step(model, prompts, tokens)
    want = step.references()
    prepare_s = time.perf_counter() - started
    sync = torch.cuda.synchronize if step.device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    diffs = dict.fromkeys(VARIANTS, 0.0)
    for round_ in range(warmup + steps):
        for variant in order.sample(VARIANTS, len(VARIANTS)):
            sync()
            start = time.perf_counter()
            logits = step.run(variant)
            sync()
            elapsed = time.perf_counter() - start
            diffs[variant] = max(diffs[variant], check_close(variant, logits, want[variant], atol))
            if round_ >= warmup:
                times[variant].append(1000 * elapsed)
    slots = step.forest.forest.num_slots
    if slots != requests * prompt_tokens:
        raise AssertionError(f"the unrelated forest holds {slots} slots after its steps, not {requests * prompt_tokens}")
    variants = {v: {"ms_per_step": statistics.median(times[v]), "min_ms": min(times[v]), "max_ms": max(times[v]),
                    "runs_ms": [round(t, 3) for t in times[v]], "keys_per_query": step.keys_per_query[v],
                    "scores_per_head": requests * step.keys_per_query[v], "max_abs_diff": diffs[v]}
                for v in VARIANTS}
    ms = {v: variants[v]["ms_per_step"] for v in VARIANTS}
    del step, want
    gc.collect()
    return {"requests": requests, "prompt_tokens": prompt_tokens, "prepare_s": round(prepare_s, 2),
            "variants": variants,
            "ratios": {name: ms[top] / ms[bottom] for name, (top, bottom, _) in RATIOS.items()}}


def run_unrelated(model, *, requests: Sequence[int] = (1, 4, 16), prompt_tokens: Sequence[int] = (300, 1000),
                  steps: int = 7, warmup: int = 2, seed: int = 0, atol: float = ATOL, threads: int | None = None,
                  progress: Progress | None = None) -> dict:
    """One decode step four ways for every R in `requests` and P in `prompt_tokens` (a float32 model
    for the logits check): `steps` timed rounds per cell after `warmup` untimed ones; the
    JSON-ready result. Raises `LogitsDiffer` where logits differ from the reference's past `atol`."""
    for name, values in (("requests", requests), ("prompt_tokens", prompt_tokens)):
        if not values:
            raise InvalidArgument(f"{name} needs at least one value", "for example 1,4,16")
        for value in values:
            check_positive(name, value)
    check_positive("steps", steps)
    if warmup < 0:
        raise InvalidArgument(f"warmup must be 0 or more, got {warmup}", "use 0 or more")
    say = progress or (lambda message: None)
    started = time.perf_counter()
    generator, order = torch.Generator().manual_seed(seed), random.Random(seed)
    cells = []
    with torch_threads(threads), quiet_transformers(loading=False):
        meta = environment(model)
        for p in prompt_tokens:
            for r in requests:
                cell = measure_cell(model, r, p, steps=steps, warmup=warmup, atol=atol, generator=generator,
                                    order=order)
                cells.append(cell)
                say(f"R={r} P={p}: " + ", ".join(f"{SHORT[v]} {cell['variants'][v]['ms_per_step']:.1f} ms"
                                                for v in VARIANTS) + f" (prefill {cell['prepare_s']:.1f} s)")
    config = {"requests": list(requests), "prompt_tokens": list(prompt_tokens), "steps": steps, "warmup": warmup,
              "seed": seed, "atol": atol, "notes": NOTES}
    return new_result("unrelated", "Attention over unrelated requests: one decode step", meta, started, config,
                      dict(LABELS), short=dict(SHORT), cells=cells, logits_identical=True,  # measure_cell raised otherwise
                      max_abs_diff=max(c["variants"][v]["max_abs_diff"] for c in cells for v in VARIANTS))


def tables(result: dict) -> list[TextTable]:
    """Milliseconds per step, their ratios, and attention scores: a row per (R, P)."""
    cells = sorted(result["cells"], key=lambda c: (c["prompt_tokens"], c["requests"]))
    short, steps = result["short"], result["config"]["steps"]
    lead = [("R", lambda c: str(c["requests"])), ("P", lambda c: str(c["prompt_tokens"]))]

    def each(figure: str, form: str) -> list:
        return [(short[v], lambda c, v=v: form.format(c["variants"][v][figure])) for v in VARIANTS]

    ratios = [(header, lambda c, k=k: f"{c['ratios'][k]:.2f}x") for k, (_, _, header) in RATIOS.items()]
    scores = ("attention scores, unrelated / batch rows", lambda c: "{:.1f}x".format(
        c["variants"][FOREST_UNRELATED]["scores_per_head"] / c["variants"][BATCH_ROWS]["scores_per_head"]))
    largest = ("largest logit diff", lambda c: f"{max(c['variants'][v]['max_abs_diff'] for v in VARIANTS):.1e}")
    return [grid(f"Milliseconds per decode step (median of {steps})", cells, lead + each("ms_per_step", "{:.1f}")
                 + [largest], lead=2),
            grid("Ratios of the medians", cells, lead + ratios + [scores], lead=2),
            grid("Attention scores per step, per layer and query head (queries x keys)", cells,
                 lead + each("scores_per_head", "{:,}"), lead=2)]


def chart(result: dict) -> Chart:
    """Milliseconds per step against R (log-log), a line per variant, one panel per P."""
    lengths = sorted({c["prompt_tokens"] for c in result["cells"]})
    panels = []
    for p in lengths:
        cells = sorted((c for c in result["cells"] if c["prompt_tokens"] == p), key=lambda c: c["requests"])
        lines = [Line(result["short"][v], [(c["requests"], c["variants"][v]["ms_per_step"]) for c in cells],
                      {"marker": marker, "ls": style, "color": color},
                      [None] * (len(cells) - 1) + [f"{cells[-1]['variants'][v]['ms_per_step']:.0f}"])
                 for v, (marker, style, color) in STYLES.items()]
        panels.append(Panel(f"P = {p} prompt tokens per request", lines, log_y=True,
                            ylabel="ms per decode step (median, log)" if not panels else ""))
    return Chart(panels, sorted({c["requests"] for c in result["cells"]}), "R (requests decoding together)",
                 legend="first")


VIEWS["unrelated"] = View(tables, chart)
