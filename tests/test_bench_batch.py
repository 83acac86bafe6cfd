"""`bench batch`: the batch job over similar documents with and without speculation, on a tiny
model: the documents are fixed, every method gives the plain job's answers, and the command writes
its three files."""

from __future__ import annotations

import json

from click.testing import CliRunner
from local_models import tiny_model_folder

from multidecode.bench.batch import LABELS, MERGED_LABELS, call_logs, questions, similar_documents
from multidecode.cli import main


def test_the_similar_documents_are_fixed_and_alike():
    rows = similar_documents(16)
    assert rows == similar_documents(16) and similar_documents(3) == rows[:3]  # no randomness
    assert len({r["id"] for r in rows}) == 16 and len({r["document"] for r in rows}) == 16
    for row in rows:
        lines = row["document"].splitlines()
        assert lines[0].startswith("Support call. Northwind Fiber. Ticket number ") and len(lines) == 4
        assert "Northwind Gateway G" in lines[1] and lines[3].endswith("Thank you, that helps.")
        assert row["id"].removeprefix("call-") in lines[0]
    assert len(questions()) == 8 and questions()[0] == "What is the customer's name?"


def test_bench_batch_command_writes_its_three_files(tmp_path):
    model = tiny_model_folder(tmp_path / "model", max_positions=4096)
    args = ["bench", "batch", "--workload", "similar", "--model", str(model), "--max-new-tokens", "5",
            "--repeats", "1", "--output", str(tmp_path / "out")]
    result = CliRunner().invoke(main, [*args, "--documents", "3"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "All methods gave identical answers." in result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "bench_batch.json", "bench_batch.md", "bench_batch.png"]
    stored = json.loads((tmp_path / "out" / "bench_batch.json").read_text())
    assert stored["documents"] == 3 and stored["answers_identical"] and list(stored["methods"]) == list(LABELS)
    assert stored["answer_tokens"] and len(stored["answer_tokens"]) == 3 * 8  # 8 answers per document
    assert stored["first_document"] == similar_documents(1)[0]["document"] and len(stored["first_answers"]) == 8
    extra = {name: m["extra"] for name, m in stored["methods"].items()}
    assert extra["batch_plain"]["drafted"] == 0 and extra["batch_plain"]["speculate"] is None
    assert extra["batch_suffix"]["speculate"] == "suffix" and extra["batch_suffix"]["drafted"] > 0
    assert extra["batch_lookup"]["speculate"] == "lookup"
    assert [t["name"] for t in stored["targets"]] == ["suffix over the plain job", "auto over the plain job"]
    md = (tmp_path / "out" / "bench_batch.md").read_text()
    assert "| method |" in md and "speed-up over plain" in md
    bad = CliRunner().invoke(main, [*args, "--documents", "0"])
    assert bad.exit_code == 2 and "--documents must be 1 or more" in bad.output


def test_the_call_logs_are_fixed_and_vary_in_length_and_questions():
    rows = call_logs(24)
    assert rows == call_logs(24) and call_logs(3) == rows[:3]
    assert len({r["id"] for r in rows}) == 24
    assert {len(r["questions"]) for r in rows} == {4, 5, 6, 7, 8}
    calls = [r["document"].count("Support call. Northwind Fiber.") for r in rows]
    assert min(calls) == 3 and max(calls) == 12  # about 360 to 1,460 tokens with the embedded tokenizer


def test_bench_batch_merged_compares_one_at_a_time_merged_and_generate(tmp_path):
    model = tiny_model_folder(tmp_path / "model", max_positions=4096)
    result = CliRunner().invoke(main, ["bench", "batch", "--model", str(model), "--documents", "3",
                                       "--max-new-tokens", "4", "--repeats", "1", "--output", str(tmp_path / "out")])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "All methods gave identical answers." in result.output
    stored = json.loads((tmp_path / "out" / "bench_batch.json").read_text())
    assert list(stored["methods"]) == list(MERGED_LABELS) and stored["answers_identical"]
    assert stored["config"]["workload"] == "merged"
    assert len(stored["answer_tokens"]) == sum(len(r["questions"]) for r in call_logs(3))
    assert all(m["extra"]["documents_per_s"] > 0 for name, m in stored["methods"].items())
    assert [t["name"] for t in stored["targets"]] == ["merged over one at a time", "merged over generate loop"]
    # merged runs share forwards: fewer than one document at a time needs
    assert stored["methods"]["merged"]["forward_passes"] < stored["methods"]["one_at_a_time"]["forward_passes"]
