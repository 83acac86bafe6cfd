"""The benchmark harness on a tiny random model: structure, identical answers, files written."""

from __future__ import annotations

import json

import pytest
import torch
from byte_tokenizer import ByteTokenizer
from tiny_models import EOS, reference_generate, tiny_model

from multidecode import MultiDecoder
from multidecode.bench import AnswersDiffer, run_ask_benchmark, tables, write_results
from multidecode.bench.common import (
    ForwardCounter,
    cache_bytes,
    check_identical,
    hf_shared_prefix,
    left_pad,
    shared_prefix_length,
    trim_at_eos,
)

DOCUMENT = "The red fox lives in the old barn near the river and eats apples every morning."
QUESTIONS = ["Who lives there?", "Where?", "What does it eat at dawn?", "When?"]


@pytest.fixture(scope="module")
def decoder():
    return MultiDecoder(tiny_model("llama"), ByteTokenizer())


@pytest.fixture(scope="module")
def result(decoder):
    messages = []
    out = run_ask_benchmark(
        decoder, document=DOCUMENT, questions=QUESTIONS, extra_questions=["Which animal?"],
        max_new_tokens=8, ks=(1, 2, 4, 6), repeats=2, repeat_budget_s=1.0, progress=messages.append,
    )
    out["_messages"] = messages
    return out


def test_result_structure(result):
    assert result["benchmark"] == "ask"
    assert result["answers_identical"] is True
    meta = result["metadata"]
    for key in ("model", "torch", "transformers", "threads", "date", "dtype"):
        assert meta[key] is not None
    config = result["config"]
    assert config["main_k"] == 4 and config["ks"] == [1, 2, 4, 6] and config["reference"] == "hf_sequential"
    assert config["document_tokens"] == len(DOCUMENT)
    assert config["sweep_questions"][4] == "Which animal?" and config["sweep_questions"][5] == QUESTIONS[0]
    main = result["main"]
    assert set(main["methods"]) == {"hf_sequential", "hf_batched", "hf_shared_prefix", "multidecode",
                                    "multidecode_alone"}
    for m in main["methods"].values():
        assert m["wall_s"] > 0 and m["forward_passes"] > 0 and m["peak_kv_bytes"] > 0
        assert m["new_tokens"] == sum(len(a["token_ids"]) for a in main["answers"])
    for name in ("hf_sequential", "hf_batched", "hf_shared_prefix"):
        assert set(main["multidecode_vs"][name]) == {"speedup", "forward_passes_ratio", "tokens_per_s_ratio",
                                                    "kv_bytes_ratio"}
    assert [row["k"] for row in result["sweep"]] == [1, 2, 4, 6]
    for row in result["sweep"]:
        assert set(row["multidecode_vs"]) == {"hf_sequential", "hf_batched", "hf_shared_prefix"}
        assert row["methods"]["multidecode"]["decode_ms_per_step"] > 0
        assert len(row["answer_tokens"]) == row["k"]
    cost = main["answers_cost"]
    assert cost["k"] == 4 and cost["times_one_answer"] > 0 and cost["longest_answer_tokens"] <= 8
    assert len(cost["single_answer_s"]) == 4
    assert {t["name"] for t in result["targets"]} and all(isinstance(t["met"], bool) for t in result["targets"])
    assert not any(t["name"].startswith("(e)") for t in result["targets"])  # (e) was not asked for
    assert any("k=4" in m for m in result["_messages"])
    json.dumps({k: v for k, v in result.items() if k != "_messages"})


def test_forward_counts(result):
    """MultiDecode: one prefix pass, one pass for all suffixes, then one pass per step; the hooks agree."""
    methods = result["main"]["methods"]
    d = methods["multidecode"]
    longest = max(len(a["token_ids"]) for a in result["main"]["answers"])
    assert d["forward_passes"] == d["hooked_forward_passes"] == 2 + longest - 1
    assert methods["hf_batched"]["forward_passes"] == longest
    assert methods["hf_shared_prefix"]["forward_passes"] == 1 + longest
    assert methods["hf_sequential"]["forward_passes"] == sum(len(a["token_ids"]) for a in result["main"]["answers"])


def test_answers_match_plain_generate(decoder, result):
    """The answers all four methods agreed on are what plain generate gives for each prompt."""
    prompts = decoder.question_prompts(DOCUMENT, QUESTIONS)
    model = decoder.model
    for prompt, answer in zip(prompts, result["main"]["answers"]):
        assert answer["prompt_tokens"] == len(prompt)
        expected = trim_at_eos(reference_generate(model, prompt, max_new_tokens=8), [EOS])
        assert answer["token_ids"] == expected


def test_shared_prefix_baseline_is_exact_with_ragged_tails():
    """(c) pads tails of different lengths inside the tail; positions stay exact."""
    model = tiny_model("llama")
    base = list(range(10, 60))
    prompts = [base + [70], base + [71, 72, 73], base + [74, 75]]
    assert shared_prefix_length(prompts) == 50
    with ForwardCounter(model) as counter:
        out = hf_shared_prefix(model, prompts, counter, max_new_tokens=6, eos_ids=[EOS], pad_id=0)
    for prompt, answer in zip(prompts, out.answers):
        assert answer == trim_at_eos(reference_generate(model, prompt, max_new_tokens=6), [EOS])
    assert counter.calls[0][0] == "prefill" and counter.calls[1][0] == "prefill"
    assert all(phase == "decode" for phase, _, _ in counter.calls[2:])
    assert out.kv_bytes > out.extra["prefix_cache_bytes"] > 0


def test_bad_arguments(decoder):
    from multidecode import InvalidArgument

    with pytest.raises(InvalidArgument):
        run_ask_benchmark(decoder, document=DOCUMENT, questions=QUESTIONS, ks=(0, 2))
    with pytest.raises(InvalidArgument):
        run_ask_benchmark(decoder, document=DOCUMENT, questions=QUESTIONS, sweep_methods=["beam"])
    # a learned mode without its head: refused as the benchmark is declared, not after its warm-up (a minute)
    from multidecode.bench.ask import ask_benchmark

    with pytest.raises(InvalidArgument, match="no eagle head was trained") as refused:
        ask_benchmark(decoder, document=DOCUMENT, questions=QUESTIONS, speculate="eagle")
    assert "SpeculationSettings.parse('eagle', head=DIR) in Python" in refused.value.hint  # as the README spells it


def test_ask_with_speculation_adds_method_e_with_identical_answers(decoder):
    settings = {"document": DOCUMENT, "questions": QUESTIONS[:2], "max_new_tokens": 4, "ks": (2,), "repeats": 1,
                "warmup": False}
    plain = run_ask_benchmark(decoder, **settings)
    assert "multidecode_speculate" not in plain["main"]["methods"]
    header = tables(plain)[0].header  # no column of (e)'s speed-up over (d) without an (e): it was there, empty
    assert "speed-up over (a) one by one" in header and not any("over (d)" in h for h in header), header
    assert not any(t["name"].startswith("(e)") for t in plain["targets"])
    ready = run_ask_benchmark(decoder, **settings, speculate="lookup")
    assert ready["answers_identical"] and ready["config"]["speculate"] == "lookup"
    e = ready["main"]["multidecode_speculate_vs"]
    assert set(e) == {"hf_sequential", "hf_batched", "hf_shared_prefix", "multidecode"}
    assert ready["main"]["methods"]["multidecode_speculate"]["extra"]["speculate"] == "lookup"
    assert any(t["name"] == "(e) speedup over (a)" for t in ready["targets"])


def test_check_identical_raises_on_a_difference():
    check_identical({"a": [[1, 2, EOS]], "b": [[1, 2, EOS]]})
    with pytest.raises(AnswersDiffer, match="answer 0 differs between a and b at token 1"):
        check_identical({"a": [[1, 2, EOS]], "b": [[1, 3, EOS]]})
    with pytest.raises(AnswersDiffer):
        check_identical({"a": [[1]], "b": [[1], [2]]})


def test_helpers():
    assert trim_at_eos([5, 6, EOS, 0, 0], [EOS]) == [5, 6, EOS]
    assert trim_at_eos([5, 6], [EOS]) == [5, 6]
    ids, mask = left_pad([[1, 2, 3], [4]], 0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert shared_prefix_length([[1, 2], [1, 2]]) == 1  # every prompt keeps a token to feed
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(2, 3, 5, 4), torch.zeros(2, 3, 5, 4), 0)
    assert cache_bytes(cache) == 2 * (2 * 3 * 5 * 4) * 4


def test_write_results(result, tmp_path):
    """JSON, PNG and a markdown table; the markdown can be rebuilt from the JSON alone."""
    from multidecode.bench.results import markdown

    clean = {k: v for k, v in result.items() if k != "_messages"}
    paths = write_results(clean, tmp_path / "out")
    assert [p.suffix for p in paths] == [".json", ".png", ".md"]
    stored = json.loads(paths[0].read_text())
    assert stored["main"]["k"] == 4
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths[2].read_text()
    assert md == markdown(stored)
    assert "| method | wall |" in md and "(d) MultiDecode forest" in md and "| k |" in md and "Targets" in md
    # `bench redraw` draws the markdown and the plot again from the JSON alone
    from click.testing import CliRunner

    from multidecode.cli import main

    paths[1].unlink()
    paths[2].unlink()
    redrawn = CliRunner().invoke(main, ["bench", "redraw", str(paths[0])])
    assert redrawn.exit_code == 0, redrawn.output
    assert paths[2].read_text() == md and paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sample_benchmark_structure_and_files(decoder, tmp_path):
    """n completions both ways: equal work (n x max_new_tokens each), ratios, the KV floor, files."""
    from multidecode.bench import run_sample_benchmark

    result = run_sample_benchmark(decoder, n=4, ns=(1, 4), max_new_tokens=6, prompt_tokens=40, repeats=1)
    assert result["benchmark"] == "sample" and [row["n"] for row in result["sweep"]] == [1, 4]
    main = result["main"]
    for method in main["methods"].values():
        assert method["new_tokens"] == 4 * 6
    assert main["methods"]["multidecode"]["forward_passes"] == 6  # one prefill, then 5 steps for all branches
    ratios = main["multidecode_vs"]["hf_num_return_sequences"]
    assert ratios["kv_bytes_ratio"] == pytest.approx(main["kv_floor"], rel=0.05)
    assert "answers_identical" not in result  # sampled: not compared between methods
    paths = write_results(result, tmp_path)
    assert [p.name for p in paths] == ["bench_sample.json", "bench_sample.png", "bench_sample.md"]
    assert json.loads(paths[0].read_text())["config"]["n"] == 4


def test_bench_command_writes_its_results_under_the_given_stem(tmp_path):
    """The CLI end to end on a tiny model folder: tables printed, files named by --stem."""
    from click.testing import CliRunner
    from local_models import tiny_model_folder

    from multidecode.cli import main

    model = tiny_model_folder(tmp_path / "model", max_positions=512)
    result = CliRunner().invoke(main, [
        "bench", "sample", "--model", str(model), "--n", "2", "--ns", "1,2", "--max-new-tokens", "3",
        "--prompt-tokens", "30", "--repeats", "1", "--output", str(tmp_path / "out"), "--stem", "mine",
    ])
    assert result.exit_code == 0, (result.output, result.exception)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["mine.json", "mine.md", "mine.png"]
    assert "Targets" in result.output and "wrote" in result.output


def test_the_committed_results_tables_are_what_the_code_draws_from_their_json():
    """docs/results stays in step with the code: a change to how results are written is followed by
    `multidecode bench redraw` of every result there (13 tables had fallen behind; then the two of
    docs/results/gpu, which this test did not read). A JSON file that names no benchmark is a
    measurement's raw record, not a result."""
    from pathlib import Path

    from multidecode.bench.results import markdown

    root = Path(__file__).resolve().parents[1]
    results = sorted(path for path in (root / "docs" / "results").rglob("*.json")
                     if "benchmark" in json.loads(path.read_text(encoding="utf-8")))
    assert len(results) > 20 and any(path.parent.name == "gpu" for path in results)
    stale = [str(path.relative_to(root)) for path in results if not path.with_suffix(".md").is_file()
             or markdown(json.loads(path.read_text(encoding="utf-8"))) != path.with_suffix(".md").read_text(encoding="utf-8")]
    assert not stale, f"redraw these: multidecode bench redraw {' '.join(stale)}"


def test_tables_printed_to_a_file_keep_every_figure():
    """Redirected to a log, rich drew the tables 80 columns wide and cut the figures ("150…"); the
    serve tables on stderr were almost all ellipses. Off a terminal they are the markdown file's lines."""
    import io
    from pathlib import Path

    from rich.console import Console

    from multidecode.bench.results import markdown
    from multidecode.cli.bench import print_tables

    result = json.loads((Path(__file__).resolve().parents[1] / "docs" / "results" / "bench_serve.json").read_text())
    log = io.StringIO()
    print_tables(result, console=Console(file=log, width=80, soft_wrap=True))
    printed = log.getvalue()
    assert "…" not in printed and "..." not in printed
    table_lines = [line for line in markdown(result).splitlines() if line.startswith("|")]
    assert table_lines and all(line in printed.splitlines() for line in table_lines)
