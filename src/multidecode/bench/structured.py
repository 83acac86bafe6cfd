"""Benchmark: structured output, a support-call record (a fixed JSON schema) from short calls, with and
without masks and jump-forward, against llama.cpp and outlines (docs/benchmarks.md, `bench structured`)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

import torch

from .. import data
from ..constraints import Constraint, compile_constraint, primary_eos
from ..errors import check_positive
from ..strategies.complete import prompt_ids
from . import llamacpp
from .common import Setup, check_identical, hf_sequential, multidecode_forest
from .harness import OUTSIDE_TORCH, Benchmark, Case, Method, Part, Plot, Target, runs
from .results import Column, Table

FREE, MASKED = "unconstrained", "masked"
PLAIN, FOREST, ONE, LLAMA, OUTLINES = "no_jump_forward", "forest", "one_at_a_time", "llama_cpp", "outlines"
LLAMA_SHARED, SPECULATING = "llama_cpp_parallel", "forest_auto"
LABELS = {
    FREE: ("(a) branches unconstrained, eos ignored", "unconstrained"),
    MASKED: ("(a) branches held to the schema, no jump-forward", "masked"),
    PLAIN: ("(b) the calls as one forest, schema, no jump-forward", "no jump-forward"),
    FOREST: ("(b, c) the calls as one forest, schema with jump-forward", "forest"),
    SPECULATING: ("(b) the calls as one forest, schema with jump-forward, speculate=auto (the free text drafted too)",
                  "forest, auto"),
    ONE: ("(c) MultiDecode, one call at a time, jump-forward", "MultiDecode one by one"),
    LLAMA: ("(c) llama.cpp, the schema's GBNF grammar, one call at a time", "llama.cpp"),
    LLAMA_SHARED: ("(c) llama.cpp, the schema's GBNF grammar, the calls as parallel sequences, the instruction shared",
                   "llama.cpp parallel"),
    OUTLINES: ("(d) transformers' generate + outlines (outlines-core), same weights and kernels, one call at a time",
               "outlines"),
}
EXTRACTION = (PLAIN, FOREST, SPECULATING, ONE, LLAMA, LLAMA_SHARED, OUTLINES)
QUICK = {"documents": 2, "mask_tokens": 8, "repeats": 1}
"""The settings of a smoke run (`--quick`)."""


def workload() -> dict:
    """The shipped calls, the instruction they are read with and the record's schema."""
    return json.loads(data.text("structured_calls.json"))


def outlines_missing() -> str | None:
    """Why (d) does not run here (None: it does)."""
    if importlib.util.find_spec("outlines") is None:
        return "outlines is not installed (pip install outlines)"
    return None


def outlines_masks(setup, schema: dict):
    """outlines' JSON-schema logits processor (its default backend, outlines-core) for the decoder's
    own model and tokenizer, as a `LogitsProcessorList` for `model.generate`."""
    import outlines
    from outlines.backends import get_json_schema_logits_processor
    from transformers import LogitsProcessorList

    model = outlines.from_transformers(setup.model, setup.tokenizer)
    return LogitsProcessorList([get_json_schema_logits_processor(None, model, json.dumps(schema))])


def validator(schema: dict):
    """text -> whether it parses as JSON and validates against `schema` (parses, where jsonschema is
    not installed), and the name of the check."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    check = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()) if jsonschema else None

    def valid(text: str) -> bool:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return check is None or check.is_valid(value)
    return valid, "jsonschema" if check else "parses as JSON (jsonschema is not installed)"


def _per_step(m) -> float:
    """A method's milliseconds per decode step: its wall time less its prefill, over its decode forwards."""
    return 1000 * (m.wall_s - m.prefill_s) / max(1, m.decode_passes)


def _mask_report(got: dict) -> dict:
    """(a): the masked step over the free one, and whether every branch ran the same length."""
    lengths = {name: sorted({len(a) for a in m.answers}) for name, m in got.items()}
    return {"figures": {name: {"ms_per_step": _per_step(m)} for name, m in got.items()},
            "mask_cost": {"step_ratio": _per_step(got[MASKED]) / _per_step(got[FREE]),
                          "same_length": lengths[FREE] == lengths[MASKED], "tokens": lengths[MASKED]}}


def free_tokens(constraint: Constraint, setup, ids) -> int:
    """How many of a record's tokens the grammar did not force (each needs a forward of its own:
    jump-forward drafts only the forced ones)."""
    vocab = setup.model.get_input_embeddings().num_embeddings
    state = compile_constraint(constraint, setup.tokenizer, vocab_size=vocab,
                                 eos_id=primary_eos(setup.tokenizer, setup.eos_ids)).start()
    free = 0
    for token in ids:
        free += not state.forced()
        if state.complete:
            break
        state.consume(token)
    return free


def _ceiling(constraint: Constraint, setup, answers) -> dict:
    """Jump-forward's ceiling on these records: a step gives a branch at most one free token."""
    tokens, free = [len(a) for a in answers], [free_tokens(constraint, setup, a) for a in answers]
    return {"the calls as one forest": {"tokens": max(tokens), "free": max(free), "ceiling": max(tokens) / max(free)},
            "one call at a time": {"tokens": sum(tokens), "free": sum(free), "ceiling": sum(tokens) / sum(free)}}


def _extraction_report(setup, valid, constraint: Constraint):
    """(b, c, e): the same records with and without jump-forward, jump-forward's ceiling on them,
    and each method's figures."""
    def report(got: dict) -> dict:
        check_identical({name: got[name].answers for name in (PLAIN, FOREST, SPECULATING, ONE)}, reference=PLAIN)
        texts = {name: [setup.text(ids) for ids in m.answers] for name, m in got.items()}
        return {"jump_forward_identical": True, "records": texts[FOREST],
                "ceiling": _ceiling(constraint, setup, got[FOREST].answers),
                "figures": {name: {"ms_per_step": _per_step(m), "documents_per_s": len(texts[name]) / m.wall_s,
                                   "valid_share": 100 * sum(map(valid, texts[name])) / len(texts[name])}
                            for name, m in got.items()}}
    return report


class _Llama:
    """llama.cpp on `gguf`, each sequence held to the schema's GBNF grammar: loaded and warmed before the
    extraction is timed (`loaded`), then runs over one call or all as parallel sequences (`run`)."""

    def __init__(self, gguf, schema: dict, setup, max_new_tokens: int, *, skip: str | None, warm) -> None:
        self.gguf, self.schema, self.setup, self.max_new_tokens = gguf, schema, setup, max_new_tokens
        self.skip, self.warm, self.engine, self.grammar = skip, warm, None, None

    @contextlib.contextmanager
    def loaded(self):
        with contextlib.ExitStack() as loaded:
            if self.skip is None:
                self.engine = loaded.enter_context(contextlib.closing(
                    llamacpp.LlamaCpp(self.gguf, threads=torch.get_num_threads())))
                self.grammar = llamacpp.json_schema_grammar(self.schema)
                self.engine.generate([self.warm], max_new_tokens=2, eos_ids=self.setup.eos_ids)
            yield

    def run(self, prompts):
        return lambda counter: llamacpp.llama_run(self.engine, prompts, counter, max_new_tokens=self.max_new_tokens,
                                                  eos_ids=self.setup.eos_ids, grammar=self.grammar)


TABLES = (
    Table("Per method: time per decode step (wall, less prefill), documents/s and valid outputs",
          (Column("case", "case"), Column("method", "label"), Column("time per step", "ms_per_step", "{:.1f} ms"),
           Column("documents/s", "documents_per_s", "{:.3f}"), Column("valid", "valid_share", "{:.0f}%")),
          rows="figures", lead=2),
    Table("Jump-forward's ceiling on these records: a step gives a branch at most one token the grammar does not force",
          (Column("decoding", "label"), Column("tokens", "tokens"), Column("free tokens", "free"),
           Column("ceiling", "ceiling", "{:.2f}x")), rows="ceiling"))
"""The result's own tables, beside the harness's."""


def structured_benchmark(decoder, *, documents: int = 6, max_new_tokens: int = 320, branches: int = 8,
                         mask_tokens: int = 32, gguf: str | Path | None = None, with_llama: bool = True,
                         repeats: int = 3, budget_s: float = 60.0, warmup: bool = True) -> Benchmark:
    """The benchmark as data: `documents` of the shipped calls (cycled); (a) on `branches` branches of
    `mask_tokens` tokens; llama.cpp reads `gguf` (the decoder's model as a GGUF file; None: not run)."""
    for name, value in dict(documents=documents, max_new_tokens=max_new_tokens, branches=branches,
                            mask_tokens=mask_tokens).items():
        check_positive(name, value)
    shipped, setup = workload(), Setup.of(decoder)
    schema, calls = shipped["schema"], [shipped["calls"][i % len(shipped["calls"])] for i in range(documents)]
    prompts = [prompt_ids(setup.tokenizer, f"{shipped['instruction']}\n\n{call}") for call in calls]
    wide = [prompts[i % len(prompts)] for i in range(branches)]
    jumping, masked = Constraint.json_schema(schema), Constraint.json_schema(schema, jump_forward=False)
    valid, validated_with = validator(schema)
    llama_skip = llamacpp.missing(with_llama, gguf) or (None if gguf else "no GGUF file of this model (--model FILE.gguf)")
    llama = _Llama(gguf, schema, setup, max_new_tokens, skip=llama_skip, warm=prompts[0][:8])
    outlines_skip = outlines_missing()
    masks = outlines_masks(setup, schema) if outlines_skip is None else None  # (d) generate with outlines' masks

    def forest(chosen, constraint, new=max_new_tokens, speculate=None, **how):
        return lambda counter: multidecode_forest(decoder, chosen, counter, max_new_tokens=new, constraint=constraint,
                                                  speculate=speculate, **how)

    def one_by_one(name: str, run, **how) -> Method:
        return Method.named(LABELS, name, parts=tuple(Part(i, run(p)) for i, p in enumerate(prompts)), **how)

    mask_case = Case({"case": f"masks, {branches} branches x {mask_tokens} tokens"}, (
        Method.named(LABELS, FREE, run=forest(wide, None, mask_tokens, eos_token_id=[])),
        Method.named(LABELS, MASKED, run=forest(wide, masked, mask_tokens))), budget_s=budget_s, report=_mask_report,
        targets=(Target("(a) masked / unconstrained, time per step", ("mask_cost", "step_ratio"), "<=", 1.10),))
    extraction = Case({"case": f"extraction, {documents} calls"}, (
        Method.named(LABELS, PLAIN, run=forest(prompts, masked)), Method.named(LABELS, FOREST, run=forest(prompts, jumping)),
        Method.named(LABELS, SPECULATING, run=forest(prompts, jumping, speculate="auto")),
        one_by_one(ONE, lambda p: forest([p], jumping)),
        one_by_one(LLAMA, lambda p: llama.run([p]), skip=llama_skip, model=OUTSIDE_TORCH),
        Method.named(LABELS, LLAMA_SHARED, run=llama.run(prompts), skip=llama_skip, model=OUTSIDE_TORCH),
        one_by_one(OUTLINES, lambda p: setup.baseline(hf_sequential, [p], max_new_tokens, logits_processor=masks),
                   skip=outlines_skip)),
        budget_s=budget_s, report=_extraction_report(setup, valid, masked), context=llama.loaded,
        targets=(Target("(b) jump-forward over none", (f"{FOREST}_vs", PLAIN, "speedup"), ">=", 1.5),
                 *(Target(f"(e) valid outputs, {LABELS[name][1]}", ("figures", name, "valid_share"), ">=", 100,
                          unit="%") for name in EXTRACTION)))
    return Benchmark(
        name="structured", title=f"a support-call record as JSON from {documents} calls, {max_new_tokens} tokens at most",
        model=decoder.model, cases=(mask_case, extraction), reference=None,
        pairs=((FOREST, PLAIN), (SPECULATING, PLAIN), (FOREST, ONE), (FOREST, LLAMA), (FOREST, LLAMA_SHARED), (FOREST, OUTLINES),
               (ONE, LLAMA)),
        config={"documents": documents, "max_new_tokens": max_new_tokens, "branches": branches,
                "mask_tokens": mask_tokens, "decoding": "greedy", "speculate": f"none, but {SPECULATING}: auto",
                "schema": schema,
                "instruction": shipped["instruction"], "prompt_tokens": [len(p) for p in prompts],
                "gguf": gguf and Path(gguf).name, "llama_cpp": llama_skip or "run", "outlines": outlines_skip or "run",
                "validated_with": validated_with},
        warmup=(Method.named(LABELS, FREE, run=forest(prompts[:2], None, 2)),
                Method.named(LABELS, FOREST, run=forest(prompts[:2], jumping, 4))) if warmup else (),
        repeats=repeats, columns=("wall_s", "forward_passes", "tokens_per_s"),
        plot=Plot("bars", figures=("wall_s", "forward_passes", "tokens_per_s")), rows_key="cases",
        tables=TABLES)


run_structured_benchmark = runs(structured_benchmark)
