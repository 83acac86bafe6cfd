"""What every benchmark measures with: forward passes counted and timed, runs and their median, KV
bytes, answers compared, and the baselines (docs/benchmarks.md, "How the benchmarks measure")."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Self

import torch

from .. import data
from ..models.vetting import cache_argument
from ..prompts import common_prefix_length
from ..proposers.suffix import SuffixProposer, SuffixStore
from ..speculation import Speculation, auto_proposer

Say = Callable[[str], None]
PREFILL, DECODE = "prefill", "decode"


class AnswersDiffer(AssertionError):
    """Two methods that must agree token for token gave different answers."""


class ForwardCounter:
    """Counts and times the forward calls of `model` while active, each labelled prefill (the next n
    after `prefill(n)`: the runner knows which calls read the prompt) or decode."""

    def __init__(self, model) -> None:
        self.model = model
        self.calls: list[tuple[str, float, tuple[int, ...]]] = []  # (phase, seconds, input shape)
        self._prefill_left = 0
        self._handles: list = []

    def __enter__(self) -> Self:
        if self.model is not None:  # None: a method outside torch (llama.cpp) records its own
            self._handles = [self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                             self.model.register_forward_hook(self._after, with_kwargs=True)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def prefill(self, n: int = 1) -> None:
        """Label the next `n` forward calls prefill (0 ends a prefill phase early)."""
        self._prefill_left = n

    def _before(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else ()
        self._phase = PREFILL if self._prefill_left > 0 else DECODE
        self._prefill_left = max(0, self._prefill_left - 1)
        self._started = time.perf_counter()

    def _after(self, module, args, kwargs, output) -> None:
        self.record(self._phase, time.perf_counter() - self._started, self._shape)

    def record(self, phase: str, seconds: float, shape: tuple[int, ...]) -> None:
        """Count a forward call: its phase, seconds and input shape (llama.cpp's come from outside torch)."""
        self.calls.append((phase, seconds, shape))

    @property
    def forward_passes(self) -> int:
        return len(self.calls)

    @property
    def tokens_fed(self) -> int:
        """Input ids over all calls (rows x tokens): B copies of a prompt count B times."""
        return sum(math.prod(shape) for _, _, shape in self.calls)

    def seconds(self, phase: str) -> float:
        return sum(s for p, s, _ in self.calls if p == phase)


def cache_bytes(cache) -> int:
    """Bytes of key/value tensors `cache` holds now (a `SlotCache`'s preallocated buffer in full)."""
    if cache is None:
        return 0
    if hasattr(cache, "allocated_bytes"):
        return int(cache.allocated_bytes)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


def trim_at_eos(ids: Iterable[int], eos_ids: Iterable[int]) -> list[int]:
    """`ids` up to and including the first eos (padding after it dropped)."""
    eos, out = set(eos_ids), []
    for t in ids:
        out.append(int(t))
        if t in eos:
            break
    return out


def check_identical(answers: dict[str, Sequence[Sequence[int]]], *, reference: str | None = None) -> None:
    """Raise `AnswersDiffer` unless every method's answers equal the reference method's."""
    if not answers:
        return
    reference = reference or next(iter(answers))
    expected = [list(a) for a in answers[reference]]
    for method, got in answers.items():
        got = [list(a) for a in got]
        if len(got) != len(expected):
            raise AnswersDiffer(f"{method} gave {len(got)} answers, {reference} gave {len(expected)}")
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                at = common_prefix_length([a, b])
                raise AnswersDiffer(f"answer {i} differs between {reference} and {method} at token {at}: "
                                    f"{a[at:at + 5]} vs {b[at:at + 5]}")


@dataclass
class RunOutput:
    """One run of a method: its answers (trimmed), the KV bytes it held at most, its own counts; a run
    that times only part of itself gives its `seconds`, one that keeps no answers its `new_tokens`."""

    answers: list[list[int]]
    kv_bytes: int
    forward_passes: int | None = None  # the method's own count, where it keeps one
    extra: dict = field(default_factory=dict)
    seconds: float | None = None
    new_tokens: int | None = None


@dataclass
class Measurement:
    """One method in one case: the median run of `runs_s`, with its costs."""

    method: str
    wall_s: float
    forward_passes: int
    new_tokens: int
    peak_kv_bytes: int
    prefill_s: float
    decode_s: float
    runs_s: list[float]
    hooked_forward_passes: int
    decode_passes: int = 0  # forward calls labelled decode (the rest read prompts)
    answers: list[list[int]] = field(repr=False, default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("inf")

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def other_s(self) -> float:
        """Wall time outside the model's forward calls (python, masks, sampling, copies)."""
        return max(0.0, self.wall_s - self.prefill_s - self.decode_s)

    @property
    def decode_ms_per_step(self) -> float:
        return 1000 * self.decode_s / max(1, self.decode_passes)

    def as_dict(self) -> dict:
        """The figures for the JSON: every field but the answers, and the derived ones."""
        fields = {k: v for k, v in asdict(self).items() if k != "answers"}
        return fields | {k: getattr(self, k) for k in ("tokens_per_s", "tokens_per_forward", "other_s",
                                                       "decode_ms_per_step")}


def median_measurement(method: str, runs: Sequence[tuple[float, RunOutput, ForwardCounter]]) -> Measurement:
    """The median-time run (the faster of the middle two for an even count), every run's time kept;
    all must give the same answers."""
    for _, out, _ in runs[1:]:
        if out.answers != runs[0][1].answers:
            raise AnswersDiffer(f"{method} gave different answers on a repeat run")
    order = sorted(range(len(runs)), key=lambda i: runs[i][0])
    wall, out, counter = runs[order[(len(order) - 1) // 2]]
    new_tokens = out.new_tokens if out.new_tokens is not None else sum(len(a) for a in out.answers)
    return Measurement(
        method=method, wall_s=wall, new_tokens=new_tokens, peak_kv_bytes=out.kv_bytes,
        forward_passes=out.forward_passes if out.forward_passes is not None else counter.forward_passes,
        prefill_s=counter.seconds(PREFILL), decode_s=counter.seconds(DECODE), runs_s=[r[0] for r in runs],
        hooked_forward_passes=counter.forward_passes, answers=out.answers, extra=dict(out.extra),
        decode_passes=sum(1 for phase, _, _ in counter.calls if phase == DECODE))


def measure_together(runs: dict[str, Callable[[ForwardCounter], RunOutput]], model, *, repeats: int = 3,
                     budget_s: float | None = 8.0, order: random.Random | None = None) -> dict[str, Measurement]:
    """Methods measured in interleaved rounds, while fewer than `repeats` ran and all took under
    `budget_s` (None: no limit); `order` shuffles each round; `model`: whose forwards count, or {method: model}."""
    done: dict[str, list] = {name: [] for name in runs}
    spent, rounds = 0.0, 0
    while rounds == 0 or (rounds < repeats and (budget_s is None or spent < budget_s)):
        for name in order.sample(list(runs), len(runs)) if order else runs:
            with ForwardCounter(model[name] if isinstance(model, dict) else model) as counter:
                start = time.perf_counter()
                out = runs[name](counter)
                wall = time.perf_counter() - start if out.seconds is None else out.seconds
            done[name].append((wall, out, counter))
            spent += wall
        rounds += 1
    return {name: median_measurement(name, results) for name, results in done.items()}


def combine_sequential(method: str, parts: Sequence[Measurement]) -> Measurement:
    """One method run item by item: the cost of the items is the sum of theirs."""
    summed = {name: sum(getattr(p, name) for p in parts) for name in (
        "wall_s", "forward_passes", "new_tokens", "prefill_s", "decode_s", "hooked_forward_passes", "decode_passes")}
    return Measurement(method=method, **summed, peak_kv_bytes=max(p.peak_kv_bytes for p in parts),
                       runs_s=[p.wall_s for p in parts], answers=[a for p in parts for a in p.answers],
                       extra={"summed_over_items": len(parts)})


# ---------------------------------------------------------------------- the baselines, and ours
def pad_id_of(model, tokenizer=None) -> int:
    """The id to pad batches with: the tokenizer's, else the model's configs', else the first eos (else 0)."""
    for source in (tokenizer, getattr(model, "generation_config", None), model.config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        return eos
    return int(next(iter(eos))) if eos else 0


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded on the left to one length: (input_ids [n, L], attention_mask [n, L])."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def _generate(model, counter: ForwardCounter, ids: torch.Tensor, mask: torch.Tensor, *, max_new_tokens: int,
              eos_ids, pad_id: int, arguments: dict | None = None, **settings) -> tuple[object, list[list[int]], int]:
    """One `model.generate`, greedy unless `settings` say otherwise: the output, each row's new tokens
    up to the first eos, and its cache's bytes at the end."""
    from transformers import GenerationConfig

    eos = sorted({int(e) for e in eos_ids})
    config = GenerationConfig(**{
        "do_sample": False, "num_beams": 1, "max_new_tokens": max_new_tokens, "pad_token_id": pad_id,
        "eos_token_id": eos or None, "bos_token_id": getattr(model.generation_config, "bos_token_id", None),
        **settings})
    counter.prefill(1)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=config, return_dict_in_generate=True,
                             **(arguments or {}))
    answers = [trim_at_eos(row, eos_ids) for row in out.sequences[:, ids.shape[1]:].tolist()]
    cache = getattr(out, "cache", None)  # `cache` from transformers 5.23 on, `past_key_values` before
    return out, answers, cache_bytes(cache if cache is not None else getattr(out, "past_key_values", None))


def hf_sequential(model, prompts, counter, *, max_new_tokens, eos_ids, pad_id, assistant=None,
                  logits_processor=None, **settings) -> RunOutput:
    """(a) `model.generate` once per prompt (with an `assistant` model, a `logits_processor` list reset
    per prompt); beam search's sequence scores in `extra["scores"]`."""
    answers, peak, scores = [], 0, []
    arguments = {"assistant_model": assistant, "logits_processor": logits_processor}
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
        for processor in logits_processor or ():
            processor.reset()
        out, got, kv = _generate(model, counter, ids, torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 eos_ids=eos_ids, pad_id=pad_id, **settings,
                                 arguments={k: v for k, v in arguments.items() if v is not None})
        answers += got
        peak = max(peak, kv)
        if getattr(out, "sequences_scores", None) is not None:
            scores += out.sequences_scores.float().tolist()
        del out  # its cache, before the next prompt's
    return RunOutput(answers, peak, extra={"scores": scores} if scores else {})


def hf_batched(model, prompts, counter, *, max_new_tokens, eos_ids, pad_id, **settings) -> RunOutput:
    """(b) one `model.generate` over all prompts, left-padded, with their attention mask."""
    ids, mask = left_pad(prompts, pad_id, model.device)
    _, answers, peak = _generate(model, counter, ids, mask, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                 pad_id=pad_id, **settings)
    return RunOutput(answers, peak, extra={"padded_width": int(ids.shape[1])})


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Longest common prefix, leaving every prompt at least one token of its own to feed."""
    return common_prefix_length(prompts, leave=1)


def hf_shared_prefix(model, prompts, counter, *, max_new_tokens, eos_ids, pad_id, **settings) -> RunOutput:
    """(c) the shared prefix prefilled once into a `DynamicCache`, copied to a batch, and `generate` fed
    the tails, left-padded inside the tail (positions from the mask: each real token keeps its own)."""
    from transformers import DynamicCache

    n, p, device = len(prompts), shared_prefix_length(prompts), model.device
    tail_ids, tail_mask = left_pad([list(q[p:]) for q in prompts], pad_id, device)
    ids = torch.cat([torch.tensor([list(prompts[0][:p])] * n, dtype=torch.long, device=device).reshape(n, p),
                     tail_ids], dim=1)
    mask = torch.cat([torch.ones((n, p), dtype=torch.long, device=device), tail_mask], dim=1)
    cache = DynamicCache(config=model.config)
    prefix_bytes = 0
    if p:
        counter.prefill(1)
        with torch.inference_mode():
            model(input_ids=ids[:1, :p], use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
        prefix_bytes = cache_bytes(cache)
        cache.batch_repeat_interleave(n)
    _, answers, peak = _generate(model, counter, ids, mask, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                 pad_id=pad_id, arguments={cache_argument(model): cache}, **settings)
    return RunOutput(answers, peak, extra={"prefix_tokens": p, "padded_tail": int(tail_ids.shape[1]),
                                           "prefix_cache_bytes": prefix_bytes})


def engine_output(answers: list[list[int]], stats, **extra) -> RunOutput:
    """A run of our engine: its answers with the engine's own counts (`EngineStats`)."""
    return RunOutput(answers, stats.peak_cache_bytes, forward_passes=stats.forward_passes,
                     extra={"peak_slots": stats.peak_slots, "tokens_fed": stats.tokens_fed,
                            "compactions": stats.compactions, **extra})


def multidecode_forest(decoder, prompts, counter, *, max_new_tokens, sampling=None, **start) -> RunOutput:
    """(d) MultiDecode: the prompts' common prefix once, one forest branch each, one pass a step."""
    counter.prefill(1 << 30)
    run = decoder.start([list(p) for p in prompts], max_new_tokens=max_new_tokens, **dict(sampling or {}), **start)
    counter.prefill(0)
    for _ in run.events:
        pass
    decoded = run.stats.as_dict()
    return engine_output([list(b.output.token_ids) for b in run.branches], run.engine.stats,
                         prefix_tokens=common_prefix_length(run.prompts),
                         **{k: decoded[k] for k in ("speculate", "drafted", "accepted", "acceptance",
                                                    "mean_draft_budget", "steps")})


@dataclass(frozen=True)
class Setup:
    """A decoder's model and tokenizer, and the eos and pad ids the transformers baselines run with."""

    decoder: object
    model: object
    tokenizer: object
    eos_ids: list[int]
    pad_id: int

    @classmethod
    def of(cls, decoder) -> Setup:
        model, tokenizer = decoder.model, decoder.tokenizer
        return cls(decoder, model, tokenizer, sorted(decoder.eos_ids), pad_id_of(model, tokenizer))

    def baseline(self, generate, prompts, max_new_tokens: int, **settings) -> Callable[[ForwardCounter], RunOutput]:
        """A run of the transformers baseline `generate` (`hf_sequential`, ...) over `prompts`."""
        settings = {"eos_ids": self.eos_ids, "pad_id": self.pad_id, **settings}
        return lambda counter: generate(self.model, prompts, counter, max_new_tokens=max_new_tokens, **settings)

    def text(self, ids: Sequence[int]) -> str | None:
        """Ids as text (None without a tokenizer)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None


def fresh(speculate):
    """A `speculate=` value for one run: `speculate()` where it makes a fresh one (a new store), else itself."""
    return speculate() if callable(speculate) else speculate


def suffix_over(store: SuffixStore | None = None) -> SuffixProposer:
    """The suffix proposer drafting from `store` (default: a new one), not the process-wide store."""
    return SuffixProposer(store=SuffixStore() if store is None else store)


def auto_over(store: SuffixStore | None = None, heads=()) -> Speculation:
    """"auto" drafting from `store` (default: a new one), and from learned `heads` when given."""
    return Speculation(auto_proposer(SuffixStore() if store is None else store, heads=heads), None)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either side has no figure (None or 0)."""
    return a / b if a and b else None


def spread(values: Sequence[float]) -> dict:
    """The least, the most and the mean (to one decimal) of `values`."""
    return {"min": min(values), "max": max(values), "mean": round(sum(values) / len(values), 1)}


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op thread count set to `threads` inside the block (None: left as it is)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def excerpt_prompt(tokenizer, tokens: int, instruction: str) -> list[int]:
    """`instruction`, a blank line, then the sample call's opening lines: about `tokens` ids in all."""
    from ..strategies.complete import prompt_ids

    def prompt(excerpt: str) -> list[int]:
        return prompt_ids(tokenizer, f"{instruction}\n\n{excerpt}")

    return prompt(data.sample_opening(tokens, lambda excerpt: len(prompt(excerpt))))
