"""`bench structured`: the support-call record extracted on the tiny model folder (a random Llama with
a byte-level BPE tokenizer and a chat template): the result's shape, the valid share reported for
every method that ran, jump-forward's outputs equal to those without it (the run asserts it), and
llama.cpp skipped with its reason, outlines run (the test extra installs it) or skipped with its own."""

from __future__ import annotations

import ctypes
import json

import pytest
from click.testing import CliRunner

from multidecode.bench import llamacpp
from multidecode.bench.structured import (
    EXTRACTION,
    FOREST,
    FREE,
    LABELS,
    LLAMA,
    LLAMA_SHARED,
    MASKED,
    ONE,
    OUTLINES,
    PLAIN,
    SPECULATING,
    outlines_missing,
    validator,
    workload,
)
from multidecode.cli import main
from multidecode.constraints import Constraint
from multidecode.models.random_gguf import write_random_gguf


def test_the_shipped_calls_and_schema():
    shipped = workload()
    assert len(shipped["calls"]) == 6 and all(300 < len(call) < 1200 for call in shipped["calls"])
    Constraint.json_schema(shipped["schema"])  # compiles (strict)
    valid, how = validator(shipped["schema"])
    assert how == "jsonschema"
    record = {"caller": "Daniel Okafor", "call_date": "2024-03-12", "priority": "high", "resolved": False,
              "issues": [{"category": "connectivity", "summary": "The line drops every twenty minutes."}]}
    assert valid(json.dumps(record))
    assert not valid(json.dumps(record)[:-1])  # cut short
    assert not valid(json.dumps({**record, "priority": "urgent"}))
    assert not valid(json.dumps({**record, "call_date": "2024-13-45"}))  # the date format is checked


def test_bench_structured_on_the_tiny_model(tmp_path, model_dir_of):
    model, out = model_dir_of(4096), tmp_path / "out"
    args = ["bench", "structured", "--model", str(model), "--quick", "--max-new-tokens", "24", "--output", str(out)]
    result = CliRunner().invoke(main, [*args, "--no-llama"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert sorted(p.name for p in out.iterdir()) == ["bench_structured.json", "bench_structured.md",
                                                    "bench_structured.png"]
    stored = json.loads((out / "bench_structured.json").read_text())
    masks, extraction = stored["cases"]
    assert list(masks["methods"]) == [FREE, MASKED] and masks["mask_cost"]["same_length"]
    assert masks["mask_cost"]["tokens"] == [8] and masks["mask_cost"]["step_ratio"] > 0
    assert all(m["new_tokens"] == 8 * 8 for m in masks["methods"].values())  # 8 branches of 8 tokens
    outlined = outlines_missing() is None
    ran = [PLAIN, FOREST, SPECULATING, ONE] + [OUTLINES] * outlined
    assert list(extraction["methods"]) == ran
    assert extraction["skipped"] == {LLAMA: "left out (--no-llama)", LLAMA_SHARED: "left out (--no-llama)",
                                     **({} if outlined else {OUTLINES: outlines_missing()})}
    assert extraction["jump_forward_identical"] and len(extraction["records"]) == 2
    forest, plain = extraction["methods"][FOREST], extraction["methods"][PLAIN]
    assert forest["new_tokens"] == plain["new_tokens"] and forest["forward_passes"] <= plain["forward_passes"]
    for name in ran:
        assert 0 <= extraction["figures"][name]["valid_share"] <= 100 and extraction["figures"][name]["documents_per_s"] > 0
    assert "speedup" in extraction[f"{FOREST}_vs"][PLAIN]
    forest_ceiling, one_ceiling = extraction["ceiling"].values()  # no forest runs fewer steps than its longest free run
    assert forest_ceiling["free"] <= forest_ceiling["tokens"] and forest_ceiling["ceiling"] >= 1
    assert plain["forward_passes"] >= forest["forward_passes"] >= forest_ceiling["free"]
    assert one_ceiling["free"] <= one_ceiling["tokens"] and one_ceiling["tokens"] >= forest_ceiling["tokens"]
    names = [t["name"] for t in stored["targets"]]
    assert names == ["(a) masked / unconstrained, time per step", "(b) jump-forward over none"] + [
        f"(e) valid outputs, {LABELS[name][1]}" for name in EXTRACTION if name in ran]
    md = (out / "bench_structured.md").read_text()
    assert "Not run: (c) llama.cpp" in md and "left out (--no-llama)" in md and "| valid |" in md and "Jump-forward's ceiling" in md
    # a folder is no GGUF file: llama.cpp is skipped with that reason when it is asked for
    result = CliRunner().invoke(main, [*args, "--stem", "asked"])
    assert result.exit_code == 0, (result.output, result.exception)
    asked = json.loads((out / "asked.json").read_text())["cases"][1]["skipped"][LLAMA]
    assert asked.startswith("no GGUF file") or "not installed" in asked


def test_bench_structured_refuses_bad_counts():
    for flag in ("--documents", "--mask-tokens", "--max-new-tokens"):
        bad = CliRunner().invoke(main, ["bench", "structured", flag, "0"])
        assert bad.exit_code == 2 and f"{flag} must be 1 or more" in bad.output


@pytest.mark.skipif(llamacpp.missing() is not None, reason="llama-cpp-python is not installed (the peers extra)")
def test_llama_cpp_sequences_held_to_a_schema_grammar(tmp_path):
    """(c)'s runner on a tiny random GGUF: each sequence follows the schema's grammar (unconstrained,
    the random model writes anything), and the parallel sequences give what each gives alone."""
    engine = llamacpp.LlamaCpp(write_random_gguf(tmp_path / "tiny.gguf", shape="tiny")["path"], threads=1,
                               context=256, sequences=4)
    lib, vocab = engine.lib, engine.lib.llama_model_get_vocab(engine.model)

    def text(ids: list[int]) -> str:
        pieces = []
        for token in ids:
            buffer = ctypes.create_string_buffer(64)
            length = lib.llama_token_to_piece(vocab, token, buffer, 64, 0, False)
            pieces.append(buffer.raw[:length])
        return b"".join(pieces).decode()

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    grammar, eos = llamacpp.json_schema_grammar(schema), [lib.llama_vocab_eos(vocab)]
    prompts = [[1, 5, 6, 7], [1, 5, 6, 9], [1, 8]]
    try:
        together = engine.generate(prompts, max_new_tokens=40, eos_ids=eos, grammar=grammar)["answers"]
        alone = [engine.generate([p], max_new_tokens=40, eos_ids=eos, grammar=grammar)["answers"][0] for p in prompts]
        free = engine.generate(prompts, max_new_tokens=8, eos_ids=eos)["answers"]
    finally:
        engine.close()
    assert together == alone
    assert all(answer[-1] == eos[0] and isinstance(json.loads(text(answer[:-1]))["ok"], bool) for answer in together)
    assert not any(text(answer).lstrip().startswith("{") for answer in free)
