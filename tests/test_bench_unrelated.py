"""`bench unrelated`: one decode step of R unrelated requests as one forest, as a forest over a
shared prompt, as separate forwards and as batch rows, on tiny models: every variant gives its
reference's logits, the report has one cell per (P, R) with every variant's figures, a variant
that drifts is refused, and the command writes its three files. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from local_models import tiny_model_folder
from tiny_models import tiny_model

from multidecode.bench.results import markdown, tables, write_results
from multidecode.bench.unrelated import (
    BATCH_ROWS,
    FOREST_SHARED,
    FOREST_UNRELATED,
    SEPARATE,
    VARIANTS,
    LogitsDiffer,
    check_close,
    run_unrelated,
)
from multidecode.cli.bench import bench_unrelated

REQUESTS, PROMPT_TOKENS = (1, 3), (5, 17)


@pytest.mark.parametrize("attn", ["sdpa", "multidecode_sdpa"])
def test_every_variant_gives_the_same_logits_and_the_report_has_its_shape(attn, tmp_path):
    said = []
    result = run_unrelated(tiny_model("llama", attn), requests=REQUESTS, prompt_tokens=PROMPT_TOKENS, steps=2,
                           warmup=1, threads=1, progress=said.append)
    assert result["benchmark"] == "unrelated" and result["logits_identical"]
    assert 0 <= result["max_abs_diff"] <= 1e-4 and result["config"]["atol"] == 1e-4
    assert len(said) == 4 * 4 and all(m.startswith("requests=3, prompt_tokens=17 ") for m in said[-4:])
    cells = result["cells"]
    assert [(c["prompt_tokens"], c["requests"]) for c in cells] == [(5, 1), (5, 3), (17, 1), (17, 3)]
    for cell in cells:
        r, p = cell["requests"], cell["prompt_tokens"]
        assert list(cell["methods"]) == list(VARIANTS)
        for variant, figures in cell["methods"].items():
            assert len(figures["runs_s"]) == 2 and min(figures["runs_s"]) <= figures["wall_s"] <= max(figures["runs_s"])
            assert 0 <= cell["max_abs_diff"][variant] <= 1e-4
        keys = {v: f["extra"]["keys_per_query"] for v, f in cell["methods"].items()}
        assert keys == {FOREST_UNRELATED: r * p + r, FOREST_SHARED: p + r, SEPARATE: p + 1, BATCH_ROWS: p + 1}
        assert cell["methods"][FOREST_UNRELATED]["extra"]["scores_per_head"] == r * (r * p + r)
        ms = {v: f["wall_s"] for v, f in cell["methods"].items()}
        # unrelated / batch rows is batch rows' speed-up over the unrelated forest; separate / unrelated the reverse
        assert cell["batch_rows_vs"][FOREST_UNRELATED]["speedup"] == pytest.approx(ms[FOREST_UNRELATED] / ms[BATCH_ROWS])
        assert cell["forest_unrelated_vs"][SEPARATE]["speedup"] == pytest.approx(ms[SEPARATE] / ms[FOREST_UNRELATED])
    times, ratios, scores = tables(result)
    assert times.header[:6] == ["R", "P", "forest, unrelated", "forest, shared prompt", "separate", "batch rows"]
    assert len(times.rows) == len(ratios.rows) == len(scores.rows) == 4
    assert all(len(row) == len(table.header) for table in (times, ratios, scores) for row in table.rows)
    assert ratios.rows[-1][-1] == "3.0x"  # R x (R*P + R) against R x (P + 1), at P = 17: exactly R
    assert "| R | P | forest, unrelated |" in markdown(result)
    paths = write_results(result, tmp_path, stem="unrelated")
    assert [p.name for p in paths] == ["unrelated.json", "unrelated.png", "unrelated.md"]
    assert json.loads(paths[0].read_text())["cells"] == json.loads(json.dumps(cells))
    assert paths[1].stat().st_size > 10_000


def test_a_variant_that_drifts_is_refused():
    want = torch.zeros(2, 8)
    assert check_close("x", want + 5e-5, want, 1e-4) == pytest.approx(5e-5)
    with pytest.raises(LogitsDiffer, match="differ from the reference's by 0.001"):
        check_close("batch_rows", want + 1e-3, want, 1e-4)
    with pytest.raises(LogitsDiffer, match="shape"):
        check_close("separate", want[:1], want, 1e-4)
    with pytest.raises(LogitsDiffer):
        check_close("separate", want + float("nan"), want, 1e-4)


def test_the_command_writes_its_three_files(tmp_path):
    model = tiny_model_folder(tmp_path / "model")
    out = tmp_path / "out"
    args = ["--model", str(model), "--requests", "1,2", "--prompt-tokens", "9", "--steps", "1", "--warmup", "0",
            "--threads", "1", "--output", str(out)]
    result = CliRunner().invoke(bench_unrelated, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "Every variant's logits matched its reference" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["bench_unrelated.json", "bench_unrelated.md",
                                                     "bench_unrelated.png"]
    stored = json.loads((out / "bench_unrelated.json").read_text())
    assert [(c["requests"], c["prompt_tokens"]) for c in stored["cells"]] == [(1, 9), (2, 9)]
    bad = CliRunner().invoke(bench_unrelated, [*args[:2], "--requests", "0,4"])
    assert bad.exit_code == 2 and "--requests needs positive integers" in bad.output
