"""Benchmark: one GGUF file at each precision and in llama.cpp, on the CPU: what a decode step reads
and costs, per token against llama.cpp, and 8 questions (docs/benchmarks.md, `bench precision`)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import data
from ..errors import InvalidArgument
from ..memory import measure_bandwidth, resident_bytes
from ..models.packed import step_bytes
from ..models.precision import parse_all
from ..prompts import common_prefix_length
from ..strategies.complete import prompt_ids
from . import llamacpp
from .common import (
    AnswersDiffer,
    Measurement,
    Say,
    Setup,
    auto_over,
    excerpt_prompt,
    fresh,
    hf_sequential,
    multidecode_forest,
    torch_threads,
)
from .harness import OUTSIDE_TORCH, Benchmark, Case, Method, Part, Plot, Target, run
from .results import Column, Table
from .speculate import Workload, choose, multidecode_generate

AUTO = "auto"
DEFAULT_PRECISIONS = (AUTO, "bfloat16", "float32")
LLAMA, SPECULATING, SDPA, HF = "llama_cpp", "multidecode_auto_speculate", "multidecode_auto_sdpa", "hf_sequential_auto"
CONTEXT_INSTRUCTION = "Continue this support call transcript."
PROFILE_STEPS = 16
"""Decode steps profiled for `profile_step`."""


def ours(precision: str) -> str:
    """The method name of MultiDecode without speculation at `precision`."""
    return f"multidecode_{precision}"


def labels(chosen: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Method -> (label, short label) for the precisions `chosen`."""
    return {**{ours(p): (f"MultiDecode at {p}", f"MD {p}") for p in chosen},
            SDPA: ("MultiDecode at auto, the model's own attention (exact=False)", "MD auto sdpa"),
            SPECULATING: ("MultiDecode at auto, speculate='auto' (first pass)", "MD auto spec"),
            HF: ("HF generate at auto, one prompt at a time", "HF auto"),
            LLAMA: ("llama.cpp (llama-cpp-python), same GGUF", "llama.cpp")}


@dataclass
class FileAtPrecisions:
    """The GGUF file loaded at each precision (a `MultiDecoder` each, and `auto` with the model's own
    attention) and in llama.cpp (None: `llama_missing` says why), with what each load cost."""

    path: Path
    decoders: dict[str, object]
    sdpa: object
    llama: llamacpp.LlamaCpp | None
    llama_missing: str | None
    loads: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def of(cls, path: str | os.PathLike, chosen: Sequence[str], *, threads: int, with_llama: bool = True,
           progress: Say | None = None) -> FileAtPrecisions:
        from ..api import load

        say, loads, decoders, path = progress or (lambda message: None), {}, {}, Path(path)

        def timed(name: str, make):  # its seconds and the process's resident memory growth kept in `loads`
            before, start = resident_bytes(), time.perf_counter()
            made = make()
            loads[name] = {"load_s": round(time.perf_counter() - start, 2), "rss_growth_bytes": resident_bytes() - before}
            return made

        missing, llama = llamacpp.missing(with_llama, path), None
        if missing is None:
            llama = timed(LLAMA, lambda: llamacpp.LlamaCpp(path, threads=threads))
            loads[LLAMA]["weights_bytes"] = llama.weights_bytes
            say(f"llama.cpp loaded {path.name}")
        for p in chosen:
            decoders[p] = timed(ours(p), lambda p=p: load(str(path), precision=p, device="cpu"))
            loads[ours(p)] |= decoders[p].memory()
            say(f"loaded at {p}: {loads[ours(p)]['weights_bytes'] / 1e6:.0f} MB of weights")
        return cls(path, decoders, load(str(path), precision=AUTO, device="cpu", exact=False), llama, missing, loads)

    def model_of(self, name: str):
        """The torch model MultiDecode's method `name` runs (speculating: auto's)."""
        precision = name.removeprefix(ours(""))
        return self.sdpa.model if name == SDPA else self.decoders[precision if precision in self.decoders else AUTO].model

    def close(self) -> None:
        if self.llama is not None:
            self.llama.close()


def profile_step(decoder, prompt: Sequence[int], *, steps: int = PROFILE_STEPS, top: int = 8) -> dict:
    """Where a one-stream decode step's time goes: wall time per step (a run of `steps` + 1 tokens
    less a run of 1), time inside torch operators and their calls per forward, the `top` operators."""
    from torch.profiler import ProfilerActivity, profile

    def timed(new: int) -> float:
        start = time.perf_counter()
        decoder.generate(list(prompt), max_new_tokens=new, speculate=None, chat=False, eos_token_id=[])
        return time.perf_counter() - start

    timed(2)
    longer, shorter = timed(steps + 1), timed(1)
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        timed(steps + 1)
    events, forwards = profiled.key_averages(), steps + 1
    top_ops = [{"op": e.key, "calls_per_step": e.count / forwards, "ms_per_step": e.self_cpu_time_total / 1000 / forwards,
                "us_per_call": e.self_cpu_time_total / max(1, e.count)}
               for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]]
    return {"wall_ms_per_step": 1000 * (longer - shorter) / steps,
            "op_ms_per_step": sum(e.self_cpu_time_total for e in events) / 1000 / forwards,
            "op_calls_per_step": sum(e.count for e in events) / forwards, "top_ops": top_ops,
            "top": ", ".join(f"{o['op'].removeprefix('aten::')} {o['ms_per_step']:.2f}" for o in top_ops[:4])}


def precision_benchmark(loaded: FileAtPrecisions, *, names: Sequence[str] | None = None,
                        max_new_tokens: int | None = None, context_tokens: int = 1400, context_new_tokens: int = 64,
                        questions: int = 8, question_tokens: int = 32, document: str | None = None,
                        document_tokens: int | None = None, transformers: bool = True, profile: bool = True,
                        repeats: int = 3, budget_s: float = 60.0, bandwidth: float | None = None,
                        warmup: bool = True) -> Benchmark:
    """The precision benchmark as data, over `loaded`: the speculate workloads `names` (None: all), the
    long-context case and `questions` about `document` (each 0: none), `profile`d steps, the floor's `bandwidth`."""
    chosen = list(loaded.decoders)
    if AUTO not in chosen:
        raise InvalidArgument("the precision benchmark needs the auto precision", "add auto to --precisions")
    auto = loaded.decoders[AUTO]
    plan = _Plan(loaded, Setup.of(auto), labels(chosen), bandwidth or measure_bandwidth())
    tokenizer = plan.setup.tokenizer
    cases = [plan.stream(w, max_new_tokens or w.max_new_tokens, budget_s) for w in (choose(names) if names is None or names else [])]
    if context_tokens > 0:
        prompt = excerpt_prompt(tokenizer, context_tokens, CONTEXT_INSTRUCTION)
        cases.append(plan.stream(Workload("context", f"a {len(prompt)}-token context", "", None, context_new_tokens,
                                          0.0), context_new_tokens, budget_s, prompt=prompt))
    if questions > 0:
        if document is None:
            document = data.sample_document() if document_tokens is None else data.sample_opening(
                document_tokens, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
        cases.append(plan.ask(questions, question_tokens, budget_s, document, transformers=transformers))
    if not cases:
        raise InvalidArgument("no case left to run", "keep a workload, the context case or the questions case")
    short = prompt_ids(tokenizer, "Write a short story about a lighthouse keeper.")

    def profiles(result: dict) -> dict:
        """The decode step of `auto`, with exact and with the model's own attention, profiled."""
        return {"profile": {ours(AUTO): profile_step(auto, short), SDPA: profile_step(loaded.sdpa, short)}}

    return Benchmark(
        name="precision", title=f"precision and llama.cpp on {loaded.path.name}", model=auto.model,
        cases=tuple(cases), reference=None,
        pairs=tuple((name, LLAMA) for name in plan.labels if name != LLAMA) + ((SPECULATING, HF),) * (questions > 0),
        config={"gguf": str(loaded.path), "file_bytes": loaded.path.stat().st_size,
                "file_tensor_bytes": auto.memory()["file_tensor_bytes"], "precisions": chosen,
                "bandwidth_bytes_per_s": plan.bandwidth, "loads": loaded.loads,
                "llama_cpp": loaded.llama_missing or "measured", "eos_ids": plan.setup.eos_ids},
        warmup=plan.warmup() if warmup else (), repeats=repeats,
        columns=("wall_s", "forward_passes", "tokens_per_s", "decode_ms_per_step", "prefill_s"),
        plot=Plot("bars", figures=("wall_s", "tokens_per_s", "decode_ms_per_step")), rows_key="cases",
        summary=profiles if profile else None, tables=(STEPS, PROFILED) if profile else (STEPS,),
    )


def run_precision_benchmark(path: str | os.PathLike, *, precisions_to_run: Sequence[str] = DEFAULT_PRECISIONS,
                            threads: int | None = None, with_llama: bool = True, progress: Say | None = None,
                            **settings) -> dict:
    """The GGUF file at `path` loaded at each precision (and in llama.cpp), `precision_benchmark` measured on it."""
    chosen = parse_all(precisions_to_run, torch.device("cpu"))
    if not str(path).endswith(".gguf") or not Path(path).is_file():
        raise InvalidArgument(f"the precision benchmark needs a .gguf file, got {path}",
                              "leave --model out for the embedded model's GGUF, or name a .gguf file")
    threads = threads or torch.get_num_threads()
    with torch_threads(threads), contextlib.closing(FileAtPrecisions.of(
            path, chosen, threads=threads, with_llama=with_llama, progress=progress)) as loaded:
        return run(precision_benchmark(loaded, **settings), threads=threads, progress=progress)


@dataclass(frozen=True)
class _Plan:
    loaded: FileAtPrecisions
    setup: Setup
    labels: dict[str, tuple[str, str]]
    bandwidth: float

    def _methods(self, run, llama_prompts: Sequence[Sequence[int]], new: int) -> list[Method]:
        """MultiDecode at every precision plain (`run(decoder, speculate)`), speculating at auto, and llama.cpp."""
        auto = self.loaded.decoders[AUTO]

        def llama(counter):
            return llamacpp.llama_run(self.loaded.llama, llama_prompts, counter, max_new_tokens=new,
                                      eos_ids=self.setup.eos_ids)

        return [*(Method.named(self.labels, ours(p), run=run(d, None), model=d.model) for p, d in self.loaded.decoders.items()),
                Method.named(self.labels, SPECULATING, run=run(auto, auto_over), model=auto.model),
                Method.named(self.labels, LLAMA, run=llama, model=OUTSIDE_TORCH, skip=self.loaded.llama_missing)]

    def stream(self, w: Workload, new: int, budget_s: float, prompt: list[int] | None = None) -> Case:
        """One prompt, one stream: every precision plain, auto with sdpa, auto speculating, llama.cpp."""
        prompt = prompt or prompt_ids(self.setup.tokenizer, w.text())

        def md(decoder, speculate):
            return lambda c: multidecode_generate(decoder, prompt, c, speculate=speculate, max_new_tokens=new,
                                                  eos_ids=self.setup.eos_ids)

        methods = self._methods(md, [prompt], new)
        methods.insert(-2, Method.named(self.labels, SDPA, run=md(self.loaded.sdpa, None), model=self.loaded.sdpa.model))
        return Case({"case": w.name}, tuple(methods), budget_s=budget_s, targets=_stream_targets(w.name),
                    report=lambda got: {"label": w.label, "prompt_tokens": len(prompt), "max_new_tokens": new,
                                        **self.figures(got)})

    def ask(self, k: int, new: int, budget_s: float, document: str, *, transformers: bool = True) -> Case:
        """k questions about the document: the forest at every precision, transformers one by one, llama.cpp."""
        auto, pool = self.loaded.decoders[AUTO], data.sample_questions()
        prompts = auto.question_prompts(document, [pool[i % len(pool)] for i in range(k)])

        def forest(decoder, speculate):
            return lambda c: multidecode_forest(decoder, prompts, c, max_new_tokens=new, speculate=fresh(speculate))

        methods = self._methods(forest, prompts, new)
        parts = tuple(Part(("hf", i), self.setup.baseline(hf_sequential, prompts[i:i + 1], new)) for i in range(k))
        methods.insert(-1, Method.named(self.labels, HF, parts=parts, model=auto.model,
                                        skip=None if transformers else "left out (--no-transformers)"))
        return Case({"case": f"{k}_questions"}, tuple(methods), budget_s=budget_s, main=True,
                    targets=ASK_TARGETS, report=lambda got: {
                        "label": f"{k} questions about one document", "prompt_tokens": [len(p) for p in prompts],
                        "max_new_tokens": new, **self.figures(got), "resident": self.resident()})

    def warmup(self) -> tuple[Method, ...]:
        """Every model once on a short prompt (4 new tokens)."""
        short = self.stream(Workload("warmup", "", "Hello.", None, 4, 0.0), 4, 0.0)
        return tuple(m for m in short.methods if m.skip is None)

    def figures(self, got: dict[str, Measurement]) -> dict:
        """Same-precision agreement (asserted), agreement with auto (reported), per step and per token
        (after the first: the run's time less its prefill)."""
        check_same_precision(got)
        reference = got[ours(AUTO)].answers
        per_token = {name: 1000 * (m.wall_s - m.prefill_s) / max(1, m.new_tokens - len(m.answers))
                     for name, m in got.items() if name != HF}
        llama = per_token.get(LLAMA)
        return {"agreement_with_auto": {name: _agreement(reference, m.answers) for name, m in got.items()
                                        if name != ours(AUTO)},
                "steps": {name: self.step(name, m) for name, m in got.items() if name != HF},
                "per_token": {name: {"ms": ms, "vs_llama_cpp": ms / llama if llama else None}
                              for name, ms in per_token.items()}}

    def step(self, name: str, m: Measurement) -> dict:
        weights = self.loaded.llama.weights_bytes if name == LLAMA else step_bytes(self.loaded.model_of(name))
        ms, floor = m.decode_ms_per_step, 1000 * weights / self.bandwidth
        return {"weights_bytes": weights, "ms_per_step": ms, "gb_per_s": weights / ms / 1e6 if ms else None,
                "floor_ms": floor, "vs_floor": ms / floor if floor else None}

    def resident(self) -> dict:
        """Resident weights at auto against the file's tensor bytes (and llama.cpp's)."""
        memory = self.loaded.decoders[AUTO].memory()
        file_bytes = memory["file_tensor_bytes"]
        out = {"auto_weights_bytes": memory["weights_bytes"], "file_tensor_bytes": file_bytes,
               "ratio": memory["weights_bytes"] / file_bytes if file_bytes else None}
        return out | ({"llama_cpp_weights_bytes": self.loaded.llama.weights_bytes} if self.loaded.llama else {})


def check_same_precision(got: dict[str, Measurement]) -> None:
    """MultiDecode at auto, speculating, and transformers at auto must give the same tokens (sdpa's are
    exact on tested prompts, not by construction: reported, not raised)."""
    reference = got[ours(AUTO)].answers
    for name in (SPECULATING, HF):
        if name in got and got[name].answers != reference:
            raise AnswersDiffer(f"{name} differs from {ours(AUTO)} at the same precision: "
                                f"{_agreement(reference, got[name].answers)}")


def _agreement(reference: list[list[int]], answers: list[list[int]]) -> dict:
    """How many answers equal the reference's, and where each that differs first differs."""
    if len(answers) != len(reference):
        raise AnswersDiffer(f"{len(answers)} answers where {len(reference)} were asked for")
    first = [common_prefix_length([a, b]) for a, b in zip(reference, answers) if a != b]
    return {"identical": len(reference) - len(first), "of": len(reference), "first_difference_at": first}


def _stream_targets(name: str) -> tuple[Target, ...]:
    vs_llama = (Target(f"{name}: auto, per token, vs llama.cpp", ("per_token", ours(AUTO), "vs_llama_cpp"), "<=", 1.0),
                Target(f"{name}: auto decode step vs the weights' memory floor", ("steps", ours(AUTO), "vs_floor"),
                       "<=", 1.5))
    return vs_llama if name == "context" else (*vs_llama, Target(
        f"{name}: auto speculating over llama.cpp, tokens/s", (f"{SPECULATING}_vs", LLAMA, "tokens_per_s_ratio"), ">", 1.0))


ASK_TARGETS = (
    Target("questions: auto speculating over llama.cpp shared prefix, tokens/s",
           (f"{SPECULATING}_vs", LLAMA, "tokens_per_s_ratio"), ">=", 3.0),
    Target("questions: auto speculating over HF generate one by one at auto", (f"{SPECULATING}_vs", HF, "speedup"),
           ">=", 8.0),
    Target("resident weights at auto / the file's tensor bytes", ("resident", "ratio"), "<=", 1.25, unit=""))


STEPS = Table("What a decode step reads and costs", (
    Column("case", "case"), Column("method", "label"), Column("weights read", "weights_bytes", "{:.0f} MB", 1e-6),
    Column("ms per step", "ms_per_step", "{:.1f}"), Column("GB/s", "gb_per_s", "{:.1f}"),
    Column("floor ms", "floor_ms", "{:.1f}"), Column("x floor", "vs_floor", "{:.1f}x"),
    Column("ms per token", "per_token.{name}.ms", "{:.1f}"),
    Column("x llama.cpp", "per_token.{name}.vs_llama_cpp", "{:.2f}x")), rows="steps", lead=2)
PROFILED = Table("One decode step profiled (one stream, short prompt)", (
    Column("method", "label"), Column("wall ms per step", "wall_ms_per_step", "{:.1f}"),
    Column("in torch operators, ms", "op_ms_per_step", "{:.1f}"), Column("operator calls", "op_calls_per_step", "{:.0f}"),
    Column("top operators (ms per step)", "top")), rows="profile")
"""A row per case and method of what its decode step reads and costs; a row per profiled step."""


__all__ = ["DEFAULT_PRECISIONS", "FileAtPrecisions", "precision_benchmark", "profile_step", "run_precision_benchmark"]
