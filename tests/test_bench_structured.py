"""`bench structured`: the support-call record extracted on the tiny model folder (a random Llama with
a byte-level BPE tokenizer and a chat template): the result's shape, the valid share reported for
every method that ran, jump-forward's outputs equal to those without it (the run asserts it), and
llama.cpp and outlines skipped with their reasons."""

from __future__ import annotations

import json

from click.testing import CliRunner

from multidecode.bench.structured import (
    EXTRACTION,
    FOREST,
    FREE,
    LABELS,
    LLAMA,
    MASKED,
    ONE,
    OUTLINES,
    PLAIN,
    outlines_missing,
    validator,
    workload,
)
from multidecode.cli import main
from multidecode.constraints import Constraint


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
    assert list(extraction["methods"]) == [PLAIN, FOREST, ONE]
    assert extraction["skipped"] == {LLAMA: "left out (--no-llama)", OUTLINES: outlines_missing()}
    assert extraction["jump_forward_identical"] and len(extraction["records"]) == 2
    forest, plain = extraction["methods"][FOREST], extraction["methods"][PLAIN]
    assert forest["new_tokens"] == plain["new_tokens"] and forest["forward_passes"] <= plain["forward_passes"]
    for name in (PLAIN, FOREST, ONE):
        assert 0 <= extraction["figures"][name]["valid_share"] <= 100 and extraction["figures"][name]["documents_per_s"] > 0
    assert "speedup" in extraction[f"{FOREST}_vs"][PLAIN]
    names = [t["name"] for t in stored["targets"]]
    assert names == ["(a) masked / unconstrained, time per step", "(b) jump-forward over none"] + [
        f"(e) valid outputs, {LABELS[name][1]}" for name in EXTRACTION if name in (PLAIN, FOREST, ONE)]
    md = (out / "bench_structured.md").read_text()
    assert "Not run: (c) llama.cpp" in md and "left out (--no-llama)" in md and "| valid |" in md
    # a folder is no GGUF file: llama.cpp is skipped with that reason when it is asked for
    result = CliRunner().invoke(main, [*args, "--stem", "asked"])
    assert result.exit_code == 0, (result.output, result.exception)
    asked = json.loads((out / "asked.json").read_text())["cases"][1]["skipped"][LLAMA]
    assert asked.startswith("no GGUF file") or "not installed" in asked


def test_bench_structured_refuses_bad_counts():
    for flag in ("--documents", "--mask-tokens", "--max-new-tokens"):
        bad = CliRunner().invoke(main, ["bench", "structured", flag, "0"])
        assert bad.exit_code == 2 and f"{flag} must be 1 or more" in bad.output
