"""Benchmark: one decode step of R unrelated requests of P prompt tokens, as one forest row and three
other ways, every step's logits checked (docs/serving.md, "Attention over unrelated requests")."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Sequence

import torch

from ..engine import Engine
from ..errors import InvalidArgument, check_positive
from ..models.packed import weights_device
from ..models.vetting import cache_argument
from .common import AnswersDiffer, RunOutput
from .harness import Benchmark, Case, Method, runs
from .results import CHARTS, Chart, Column, Line, Panel, Table, rows_of

FOREST_UNRELATED, FOREST_SHARED, SEPARATE, BATCH_ROWS = "forest_unrelated", "forest_shared", "separate", "batch_rows"
VARIANTS = (FOREST_UNRELATED, FOREST_SHARED, SEPARATE, BATCH_ROWS)
LABELS = {
    FOREST_UNRELATED: ("one forest, R unrelated prompts (one row, mask over R*P slots)", "forest, unrelated"),
    FOREST_SHARED: ("one forest, one prompt shared by all R (mask over P slots)", "forest, shared prompt"),
    SEPARATE: ("R separate forwards (an engine per request)", "separate"),
    BATCH_ROWS: ("R batch rows (transformers DynamicCache, batch R)", "batch rows"),
}
STYLES = {FOREST_UNRELATED: ("o", "-", "tab:red"), FOREST_SHARED: ("s", "-", "tab:green"),
          SEPARATE: ("^", "--", "tab:grey"), BATCH_ROWS: ("D", "-", "tab:blue")}
"""Variant -> (marker, line style, colour) in the plot."""
RATIOS = {(BATCH_ROWS, FOREST_UNRELATED): "unrelated / batch rows", (FOREST_UNRELATED, SEPARATE): "separate / unrelated",
          (FOREST_SHARED, FOREST_UNRELATED): "unrelated / shared prompt"}
"""(fast, slow) -> column header: the pairs each cell reports, slow's median over fast's."""
ATOL = 1e-4
"""Largest absolute logit difference allowed between a variant and its reference."""


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
        self.device = weights_device(model)
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
        return _fed(self.forest, self.tokens, self.roots_last, owners=list(range(len(self.tokens))))

    def forest_shared(self) -> torch.Tensor:
        return _fed(self.shared, self.tokens, [self.shared_last] * len(self.tokens))

    def separate(self) -> torch.Tensor:
        return torch.cat([_fed(e, [t], [last]) for e, last, t in zip(self.engines, self.engines_last, self.tokens)])

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
        shared = torch.cat([_fed(self.engines[0], [t], [self.engines_last[0]]) for t in self.tokens])
        return {FOREST_UNRELATED: own, FOREST_SHARED: shared, SEPARATE: own, BATCH_ROWS: own}


def _fed(engine: Engine, tokens: list[int], parents: list[int], **owners) -> torch.Tensor:
    """`tokens` fed under `parents`, taken back after: their logits [len(tokens), vocab]."""
    result = engine.feed(tokens, parents, logits_for=range(len(tokens)), **owners)
    engine.drop(result.nodes)
    return result.logits


class CellSteps:
    """One (R, P) point: its `Step`, prefilled when the case starts (`prefilled`), whose variants'
    decode steps are timed and then checked against the references (`timed`)."""

    def __init__(self, model, requests: int, prompt_tokens: int, *, generator: torch.Generator, warmup: int,
                 atol: float) -> None:
        self.model, self.requests, self.prompt_tokens = model, requests, prompt_tokens
        self.generator, self.warmup, self.atol = generator, warmup, atol

    @contextlib.contextmanager
    def prefilled(self):
        """Random prompts prefilled every way, their references, then `warmup` untimed (checked) rounds."""
        started = time.perf_counter()
        vocab = self.model.get_input_embeddings().num_embeddings
        prompts = [torch.randint(0, vocab, (self.prompt_tokens,), generator=self.generator).tolist()
                   for _ in range(self.requests)]
        self.step = Step(self.model, prompts, torch.randint(0, vocab, (self.requests,), generator=self.generator).tolist())
        self.want, self.diffs = self.step.references(), dict.fromkeys(VARIANTS, 0.0)
        self.prepare_s = time.perf_counter() - started
        for _ in range(self.warmup):
            for variant in VARIANTS:
                self.timed(variant)
        try:
            yield
        finally:
            del self.step, self.want
            gc.collect()

    def timed(self, variant: str) -> RunOutput:
        """One decode step of `variant`, timed alone; its logits checked after."""
        sync = torch.cuda.synchronize if self.step.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        logits = self.step.run(variant)
        sync()
        seconds = time.perf_counter() - start
        self.diffs[variant] = max(self.diffs[variant], check_close(variant, logits, self.want[variant], self.atol))
        keys = self.step.keys_per_query[variant]
        return RunOutput([], 0, seconds=seconds, new_tokens=self.requests,
                         extra={"keys_per_query": keys, "scores_per_head": self.requests * keys})

    def report(self, got: dict) -> dict:
        """The prefill's seconds and each variant's largest logit difference over every step; the
        unrelated forest must hold its prompts' slots alone after its steps."""
        slots = self.step.forest.forest.num_slots
        if slots != self.requests * self.prompt_tokens:
            raise AssertionError(f"the unrelated forest holds {slots} slots after its steps, "
                                 f"not {self.requests * self.prompt_tokens}")
        scores = {v: got[v].extra["scores_per_head"] for v in VARIANTS}
        return {"prepare_s": round(self.prepare_s, 2), "max_abs_diff": dict(self.diffs),
                "largest_abs_diff": max(self.diffs.values()),
                "scores_over_batch_rows": scores[FOREST_UNRELATED] / scores[BATCH_ROWS]}


def unrelated_benchmark(model, *, requests: Sequence[int] = (1, 4, 16), prompt_tokens: Sequence[int] = (300, 1000),
                        steps: int = 7, warmup: int = 2, seed: int = 0, atol: float = ATOL) -> Benchmark:
    """One decode step four ways for every R in `requests` and P in `prompt_tokens`, as data: `steps` timed
    rounds per cell after `warmup` untimed ones; its run raises `LogitsDiffer` past `atol`."""
    for name, values in (("requests", requests), ("prompt_tokens", prompt_tokens)):
        if not values:
            raise InvalidArgument(f"{name} needs at least one value", "for example 1,4,16")
        for value in values:
            check_positive(name, value)
    check_positive("steps", steps)
    if warmup < 0:
        raise InvalidArgument(f"warmup must be 0 or more, got {warmup}", "use 0 or more")
    generator = torch.Generator().manual_seed(seed)

    def case(r: int, p: int) -> Case:
        cell = CellSteps(model, r, p, generator=generator, warmup=warmup, atol=atol)
        methods = tuple(Method.named(LABELS, v, run=lambda counter, v=v: cell.timed(v)) for v in VARIANTS)
        return Case({"requests": r, "prompt_tokens": p}, methods, budget_s=None, context=cell.prefilled,
                    report=cell.report)

    lead = (Column("R", "requests"), Column("P", "prompt_tokens"))

    def each(path: str, form: str, scale: float = 1.0) -> tuple[Column, ...]:
        return tuple(Column(LABELS[v][1], f"methods.{v}.{path}", form, scale) for v in VARIANTS)

    return Benchmark(
        name="unrelated", title="Attention over unrelated requests: one decode step", model=model,
        cases=tuple(case(r, p) for p in prompt_tokens for r in requests), reference=None, pairs=tuple(RATIOS),
        config={"requests": list(requests), "prompt_tokens": list(prompt_tokens), "steps": steps, "warmup": warmup,
                "seed": seed, "atol": atol},
        repeats=steps, columns=(), rows_key="cells", shuffle=seed, tables=(
            Table(f"Milliseconds per decode step (median of {steps})", lead + each("wall_s", "{:.1f}", 1000)
                  + (Column("largest logit diff", "largest_abs_diff", "{:.1e}"),), lead=2),
            Table("Ratios of the medians", lead + tuple(Column(header, f"{fast}_vs.{slow}.speedup", "{:.2f}x")
                                                        for (fast, slow), header in RATIOS.items())
                  + (Column("attention scores, unrelated / batch rows", "scores_over_batch_rows", "{:.1f}x"),), lead=2),
            Table("Attention scores per step, per layer and query head (queries x keys)", lead
                  + each("extra.scores_per_head", "{:,}"), lead=2)),
        summary=lambda result: {"logits_identical": True,  # a check raised otherwise
                                "max_abs_diff": max(row["largest_abs_diff"] for row in result["cells"])},
    )


run_unrelated = runs(unrelated_benchmark)


def chart(result: dict) -> Chart:
    """Milliseconds per step against R (log-log), a line per variant, one panel per P."""
    rows, short = rows_of(result), result["layout"]["short"]
    panels = []
    for p in sorted({row["prompt_tokens"] for row in rows}):
        cells = sorted((row for row in rows if row["prompt_tokens"] == p), key=lambda row: row["requests"])
        ms = {v: [1000 * row["methods"][v]["wall_s"] for row in cells] for v in STYLES}
        lines = [Line(short[v], [(row["requests"], y) for row, y in zip(cells, ms[v])],
                      {"marker": marker, "ls": style, "color": color},
                      [None] * (len(cells) - 1) + [f"{ms[v][-1]:.0f}"])
                 for v, (marker, style, color) in STYLES.items()]
        panels.append(Panel(f"P = {p} prompt tokens per request", lines, log_y=True,
                            ylabel="ms per decode step (median, log)" if not panels else ""))
    return Chart(panels, sorted({row["requests"] for row in rows}), "R (requests decoding together)", legend="first")


CHARTS["unrelated"] = chart
