"""`multidecode batch`: many documents, one resumable JSON Lines output.

Runs against an offline tiny model folder (greedy, so every run gives the same answers). The
resume tests interrupt real runs: a subprocess is killed with SIGKILL, or stopped with SIGINT,
once its output holds some but not all lines, and the same command is run again; every id must
then have exactly one record, equal to an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batch_files import by_id, documents, one_thread, records, results, write_lines
from click.testing import CliRunner

import multidecode
from multidecode.batch import (
    BatchAborted,
    BatchSettings,
    lock_path,
    meta_path,
    open_batch,
    parse_line,
    run_batch,
)
from multidecode.cli import main
from multidecode.sampling_params import per_branch_sampling

ROOT = Path(__file__).resolve().parents[1]
MULTIDECODE = Path(sys.executable).with_name("multidecode")


def run(*args):
    with one_thread():
        return CliRunner().invoke(main, ["batch", *map(str, args)])


def test_a_run_writes_one_complete_record_per_line(model_dir, tmp_path):
    rows = [{"id": "a", "document": "The router drops the line every evening.", "questions": ["why?", "when?"]},
            {"document": "The cable was cut by the storm.", "questions": ["what happened?"]},
            {"id": 7, "document": "The modem light is red.", "questions": ["what colour?"]}]
    source = write_lines(tmp_path / "in.jsonl", rows[:1] + [""] + rows[1:])  # a blank line is skipped
    out = tmp_path / "out.jsonl"
    result = run(source, "--output", out, "--model", model_dir, "--max-new-tokens", 6, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["total"], summary["done"], summary["failed"], summary["remaining"]) == (3, 3, 0, 0)
    assert summary["complete"] and summary["tokens"] > 0
    assert "Done: all 3 lines" in result.stderr

    got = by_id(records(out))  # in the order lines finish, which merged forests may change
    assert sorted(got, key=lambda key: got[key]["line"]) == ["a", 3, 7]  # a line without an id: its number
    assert sorted(got[k]["line"] for k in got) == [1, 3, 4]
    decoder = multidecode.load(str(model_dir))
    settings = BatchSettings(max_new_tokens=6, model=str(Path(model_dir).resolve()), precision="float32")
    for row, key in zip(rows, ["a", 3, 7]):
        record = got[key]
        assert record["error"] is None and record["settings"] == settings.fingerprint
        with one_thread():
            expected = decoder.ask(row["document"], row["questions"], max_new_tokens=6)
        assert [a["question"] for a in record["answers"]] == row["questions"]
        assert [a["answer"] for a in record["answers"]] == [a.text for a in expected]
        assert [a["tokens"] for a in record["answers"]] == [len(a.token_ids) for a in expected]
        assert [a["finish_reason"] for a in record["answers"]] == [a.finish_reason for a in expected]
        assert record["tokens"] == sum(a["tokens"] for a in record["answers"])
        assert record["elapsed_s"] >= 0
    meta = json.loads(meta_path(out).read_text())
    assert meta["fingerprint"] == settings.fingerprint and meta["settings"]["max_new_tokens"] == 6


def test_the_summary_of_a_short_run_reads_as_english(model_dir, tmp_path):
    """One line was "all 1 line ... are in", and a run under half a second "0 s"."""
    source = write_lines(tmp_path / "in.jsonl", [{"document": "The modem light is red.", "questions": ["colour?"]}])
    result = run(source, "--output", tmp_path / "out.jsonl", "--model", model_dir, "--max-new-tokens", 2)
    assert result.exit_code == 0, result.output
    assert "Done: the only line of" in result.stderr and " is in " in result.stderr, result.stderr
    assert re.search(r"tokens generated in \d+\.\d s ", result.stderr), result.stderr


def test_job_questions_come_first_and_a_line_adds_its_own(model_dir, tmp_path):
    questions = tmp_path / "questions.txt"
    questions.write_text("what broke?\n\nwho called?\n")
    source = write_lines(tmp_path / "in.jsonl", [
        {"id": "plain", "document": "The router broke."},
        {"id": "extra", "document": "The cable broke.", "questions": ["which cable?"]},
        {"id": "empty-list", "document": "The modem broke.", "questions": []},
    ])
    out = tmp_path / "out.jsonl"
    result = run(source, "-o", out, "--model", model_dir, "-q", "is it fixed?", "--questions-file", questions,
                 "--max-new-tokens", 3)
    assert result.exit_code == 0, result.output
    asked = {k: [a["question"] for a in r["answers"]] for k, r in by_id(records(out)).items()}
    job = ["is it fixed?", "what broke?", "who called?"]
    assert asked == {"plain": job, "extra": job + ["which cable?"], "empty-list": job}


def test_failed_lines_are_recorded_with_their_error_and_the_job_goes_on(model_dir, tmp_path):
    good = {"document": "The router drops the line.", "questions": ["why?"]}
    source = write_lines(tmp_path / "in.jsonl", [
        {"id": "first", **good},
        '{"id": "broken", "document": "no closing brace"',
        '["a", "list"]',
        {"id": "no-doc", "questions": ["why?"]},
        {"id": "blank-doc", "document": "   ", "questions": ["why?"]},
        {"id": "number-doc", "document": 42, "questions": ["why?"]},
        {"id": "empty-question", "document": "text", "questions": ["why?", " "]},
        {"id": "string-questions", "document": "text", "questions": "why?"},
        {"id": "no-questions", "document": "text"},
        {"id": "too-long", "document": "routers and cables " * 200, "questions": ["why?"]},
        {"id": 1.5, **good},
        {"id": "last", **good},
    ])
    out = tmp_path / "out.jsonl"
    result = run(source, "--output", out, "--model", model_dir, "--max-new-tokens", 4, "--json")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    summary = json.loads(result.stdout)
    assert (summary["total"], summary["done"], summary["failed"]) == (12, 12, 10)
    got = by_id(records(out))
    assert got["first"]["error"] is None and got["last"]["error"] is None and len(got["last"]["answers"]) == 1

    expected = {  # id -> (error type, text in the message); unreadable lines take their line number as id
        2: ("InvalidInput", "line 2 is not valid JSON"),
        3: ("InvalidInput", "line 3 is a list, not a JSON object"),
        "no-doc": ("InvalidInput", 'no "document"'),
        "blank-doc": ("InvalidInput", "the document is empty"),
        "number-doc": ("InvalidInput", '"document" must be a string, got an integer'),
        "empty-question": ("InvalidInput", "question 2 of the line is empty"),
        "string-questions": ("InvalidInput", "got one string"),
        "no-questions": ("InvalidInput", 'no "questions" and the job has none'),
        "too-long": ("PromptTooLong", "at most 256 positions"),
        11: ("InvalidInput", '"id" must be a string or an integer, got a number'),
    }
    for key, (kind, text) in expected.items():
        error = got[key]["error"]
        assert error["type"] == kind and text in error["message"], (key, error)
        assert error["hint"], key
        assert got[key]["answers"] == [] and got[key]["tokens"] == 0
    assert "line 2 (id 2) failed" in result.stderr
    assert "--retry-failed" in result.stderr


def test_duplicate_ids_are_refused_before_anything_runs(model_dir, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", [
        {"id": "x", "document": "a", "questions": ["q?"]},
        {"document": "b", "questions": ["q?"]},          # id 2 (its line number)
        {"id": "2", "document": "c", "questions": ["q?"]},  # "2" and 2 are one id
        {"id": "x", "document": "d", "questions": ["q?"]},
    ])
    out = tmp_path / "out.jsonl"
    result = run(source, "--output", out, "--model", model_dir)
    assert result.exit_code == 2, result.output
    assert "duplicate ids" in result.stderr and "lines 2 and 3" in result.stderr and "lines 1 and 4" in result.stderr
    assert "Traceback" not in result.output and not out.exists()


# ---------------------------------------------------------------------- bad input and faults, one at a time
def test_a_line_without_an_id_is_recorded_under_its_line_number(model_dir, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", [
        {"id": "a", "document": "The router drops the line.", "questions": ["why?"]},
        "",                                                                    # line 2: blank, still counted
        {"document": "The cable was cut.", "questions": ["what happened?"]},   # line 3: no "id"
        {"id": None, "document": "The modem is red.", "questions": ["what colour?"]},  # line 4: null
        {"document": " ", "questions": ["why?"]},                              # line 5: no "id", and it fails
    ])
    out = tmp_path / "out.jsonl"
    decoder = multidecode.load(str(model_dir))
    summary = run_batch(decoder, source, out, max_new_tokens=3, model="tiny")
    assert (summary.total, summary.done, summary.failed) == (4, 4, 1)
    got = by_id(records(out))
    assert sorted(got, key=str) == [3, 4, 5, "a"]
    assert all(got[key]["line"] == key for key in (3, 4, 5))
    assert got[3]["error"] is None and got[4]["error"] is None and len(got[3]["answers"]) == 1
    assert got[5]["error"]["message"] == "the document is empty"
    summary = run_batch(decoder, source, out, max_new_tokens=3, model="tiny")  # resumes by those ids
    assert (summary.skipped, summary.done) == (4, 0)


def test_duplicate_ids_are_refused_up_front_naming_both_lines(tmp_path):
    rows = [{"id": name, "document": "text", "questions": ["q?"]} for name in ("a", "b", "c", "d", 7)]
    source = write_lines(tmp_path / "in.jsonl", rows + [{"id": "7", "document": "t", "questions": ["q?"]}] + rows[:4])
    out = tmp_path / "out.jsonl"
    with pytest.raises(multidecode.InvalidInput) as caught:
        open_batch(source, out, BatchSettings())
    message = caught.value.message
    assert "has duplicate ids: id '7' is on lines 5 and 6; id 'a' is on lines 1 and 7; id 'b' is on lines 2 and 8" \
           in message and message.endswith(" and 2 more")
    assert "line number" in caught.value.hint
    assert not out.exists() and not lock_path(out).exists()  # refused before the output is touched


def test_an_id_on_three_lines_is_named_once_with_all_three(tmp_path):
    rows = [{"id": 1, "document": "text", "questions": ["q?"]}] * 3
    with pytest.raises(multidecode.InvalidInput) as caught:
        open_batch(write_lines(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl", BatchSettings())
    assert caught.value.message.endswith("has duplicate ids: id 1 is on lines 1, 2 and 3")


def test_a_document_too_long_for_the_model_is_recorded_and_the_others_go_on(model_dir, tmp_path):
    rows = documents(5)
    rows[2] = {"id": "long", "document": "routers and cables and tickets " * 60, "questions": ["why?", "when?"]}
    source = write_lines(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    decoder = multidecode.load(str(model_dir))
    summary = run_batch(decoder, source, out, max_new_tokens=4, model="tiny")  # merged forests
    assert (summary.done, summary.failed, summary.complete) == (5, 1, True)
    got = by_id(records(out))
    error = got["long"]["error"]
    assert error["type"] == "PromptTooLong" and "at most 256 positions" in error["message"]
    assert "shorten the document" in error["hint"] and got["long"]["answers"] == []
    for key in ("doc-0", "doc-1", "doc-3", "doc-4"):
        assert got[key]["error"] is None and len(got[key]["answers"]) == 2 and got[key]["tokens"] > 0
    assert summary.failures == [{"id": "long", "line": 3, **error}]


def test_a_prompt_too_long_for_the_job_s_max_new_tokens_is_told_a_fix_the_job_takes(model_dir, tmp_path):
    """The record said "lower max_new_tokens to N", which resuming beside the other lines' results
    refuses (other settings); it now says to shorten the document, or to run the job with N new
    tokens into a new output, and N is what fits."""
    from multidecode.strategies.ask import question_prompts

    decoder = multidecode.load(str(model_dir))
    rows = documents(2)
    rows[1] = {"id": "long", "document": "routers and cables and tickets " * 38, "questions": ["why?"]}
    prompt = max(map(len, question_prompts(decoder.tokenizer, rows[1]["document"], ["why?"])))
    fits = decoder.model.config.max_position_embeddings - prompt + 1
    assert 1 < fits < 64  # the prompt fits, its new tokens do not
    source = write_lines(tmp_path / "in.jsonl", rows)
    summary = run_batch(decoder, source, tmp_path / "out.jsonl", max_new_tokens=fits + 8, model="tiny")
    assert (summary.done, summary.failed) == (2, 1)
    error = by_id(records(tmp_path / "out.jsonl"))["long"]["error"]
    assert error["type"] == "PromptTooLong" and "max_new_tokens is" in error["message"]
    assert "shorten the line's document, then rerun with --retry-failed" in error["hint"]
    assert f"--max-new-tokens {fits} (into a new --output" in error["hint"]
    summary = run_batch(decoder, source, tmp_path / "new.jsonl", max_new_tokens=fits, model="tiny")
    assert (summary.done, summary.failed) == (2, 0)


def test_a_job_wide_logit_bias_outside_the_vocabulary_is_a_job_error(model_dir, tmp_path):
    """Every line failed with it, the run exited 0, and its hint blamed the input; rerun without it,
    the job skipped every line as done. Now the job stops before any line, as `ask` does."""
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    out = tmp_path / "out.jsonl"
    result = run(source, "-q", "who?", "--model", model_dir, "--max-new-tokens", "2", "-o", out,
                 "--logit-bias", "999999=5")
    assert result.exit_code == 2 and "--logit-bias of the job names token id 999999" in result.stderr
    assert not out.exists() or records(out) == []
    assert run(source, "-q", "who?", "--model", model_dir, "--max-new-tokens", "2", "-o", out,
               "--logit-bias", "5=5").exit_code == 0
    assert all(record["error"] is None for record in records(out))
    # a line's own bias: that line's failure, its questions numbered as the line numbers them (was "branch 0")
    line = {"id": "own", "document": "The modem light is red.", "questions": ["what colour?", "why?"],
            "sampling": {"logit_bias": [None, None, {"999999": 5}]}}  # after the job's -q question
    write_lines(source, [*documents(2), line])
    assert run(source, "-q", "who?", "--model", model_dir, "--max-new-tokens", "2", "-o", out,
               "--logit-bias", "5=5").exit_code == 0
    error = by_id(records(out))["own"]["error"]
    assert error["message"].startswith("logit_bias of question 3 names token id"), error


def test_settings_that_change_no_token_do_not_change_the_fingerprint():
    """A repetition penalty of 1, presence and frequency penalties of 0, top_k 0 and a logit bias of
    zeros decode as nothing does, whatever a line adds: resuming with them was refused as other
    settings. A seed is a setting even for a greedy job (a line may sample with it), and so is
    greedy spelled out (temperature 0, do_sample False): a line with sampling settings of its own
    decodes greedily under it and samples without it, so the two jobs' answers differ."""
    plain = BatchSettings(questions=("who?",)).fingerprint
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "top_k": 0}
    assert BatchSettings(questions=("who?",), sampling=neutral).fingerprint == plain
    assert BatchSettings(questions=("who?",), sampling={"logit_bias": {5: 0.0, 7: 0}}).fingerprint == plain
    # top_p 1 and min_p 0 cut nothing but ask for sampling, which the plain job does not do
    assert [p.do_sample for p in per_branch_sampling(1, {"top_p": 1.0})] == [True]
    for other in ({"seed": 5}, {"repetition_penalty": 1.1}, {"do_sample": True}, {"presence_penalty": 0.5},
                  {"logit_bias": {5: 1.0}}, {"logit_bias": {5: 0.0, 7: -1.0}}, {"top_p": 1.0}, {"min_p": 0}, {"repetition_penalty": [1.0, 1.0]}, {"temperature": 0},
                  {"do_sample": False}):
        assert BatchSettings(questions=("who?",), sampling=other).fingerprint != plain, other


def test_more_new_tokens_than_the_model_has_positions_is_a_job_error(model_dir, tmp_path):
    """Every line failed (PromptTooLong, or at 10**12 a TooLarge of millions of GB) and the run
    exited 0; no document can fit, so the job stops before any line."""
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    out = tmp_path / "out.jsonl"
    for max_new_tokens in (256, 10**12):  # the tiny model has 256 positions
        result = run(source, "--model", model_dir, "--max-new-tokens", max_new_tokens, "-o", out)
        assert result.exit_code == 2 and "the model has 256 positions" in result.stderr, result.output
        assert "--max-new-tokens well below 256" in result.stderr and not out.exists()
    assert run(source, "--model", model_dir, "--max-new-tokens", 2, "-o", out).exit_code == 0


def test_parse_line_words_each_problem_in_the_format_s_terms():
    def error(line: dict, job=()):
        return parse_line(json.dumps(line).encode(), 1, job).error.message

    doc = {"document": "d"}
    assert error({**doc, "questions": {"q": 1}}) == '"questions" must be a list of strings, got an object'
    assert error({**doc, "questions": ["q", 3]}) == "question 2 of the line is an integer, not a string"
    assert error({**doc, "questions": [None]}) == "question 1 of the line is null, not a string"
    assert error({**doc, "questions": []}) == 'the line has an empty "questions" list and the job has none'
    assert error({"document": ["d"], "questions": ["q"]}) == '"document" must be a string, got a list'
    assert error({"document": "\ud800", "questions": ["q"]}).startswith("the document is not valid Unicode")
    assert error({"id": 7.0, "document": ""}) == '"id" must be a string or an integer, got a number'  # id first
    assert parse_line(b'{"id": "x", "documnet": "d", "questions": ["q"]}', 2).error.message == \
           'the line has no "document"'
    assert parse_line(b'{"id": 1' + b"0" * 5000 + b"}", 6).error.message.startswith("line 6 is not valid JSON")
    item = parse_line(b'{"id": 0, "document": "d", "questions": ["q"], "extra": [1, 2]}', 9, ["job?"])
    assert (item.id, item.key, item.document, item.questions, item.error) == (0, "0", "d", ("job?", "q"), None)
    assert parse_line(b'{"id": "x", "document": "d", "questions": ["q"]}', 9).id == "x"  # an id that failed elsewhere
    assert parse_line(b'{"id": "x", "document": 5}', 9).id == "x"
    # a line's key in another case or with other separators is not silently ignored, as other keys
    # are: the line fails (its questions would have been lost behind the job's)
    for key, meant in (("Questions", "questions"), ("Document", "document"), ("json-schema", "json_schema")):
        item = parse_line(json.dumps({"id": "k", "document": "d", key: ["q"]}).encode(), 3, ["job?"])
        if key == "Document":
            item = parse_line(json.dumps({"id": "k", key: "d", "questions": ["q"]}).encode(), 3)
        assert item.id == "k" and item.error.message == \
            f'the line has "{key}", which is not a key a line may have: did you mean "{meant}"?'
    assert parse_line(b'{"id": "", "Questions": ["q"], "document": "d"}', 4).id == 4  # a blank id: the line's number
    # other words are a dataset's own fields: a SQuAD-like "question" runs with the job's questions,
    # and where there are none, the refusal points at it
    fields = {"document": "d", "question": "what?", "ID": 7, "question_id": 4, "doc_id": 1}
    assert parse_line(json.dumps(fields).encode(), 3, ["job?"]).error is None
    assert parse_line(json.dumps(fields).encode(), 3).error.message == \
        'the line has no "questions" (it has "question": a list of them goes in "questions") and the job has none'


def test_record_takes_outcomes_from_any_backend_and_writes_each_line_once(tmp_path):
    """What a Ray backend does: pending_items, then record(LineOutcome, ...) with errors that may be
    picklable stand-ins (any object with a class name, .message and .hint)."""
    from multidecode.batch.merged import LineOutcome

    class PromptTooLong:  # a stand-in: not an exception, not a MultiDecodeError
        message, hint = "the prompt is 900 tokens long", "shorten the document"

    source = write_lines(tmp_path / "in.jsonl", documents(4))
    with open_batch(source, tmp_path / "out.jsonl", BatchSettings()) as job:
        items = list(job.pending_items())
        outcomes = [LineOutcome(items[1], error=PromptTooLong()),
                    LineOutcome(items[0], error=MemoryError("out of\nmemory")),
                    LineOutcome(items[1], error=ValueError("a second outcome for doc-1")),  # dropped
                    LineOutcome(items[3], error=multidecode.InvalidInput("bad", None))]
        got = [result.record for result in job.record(outcomes)]
        assert (job.done, job.failed, len(job.pending), job.summary().remaining) == (3, 3, 1, 1)
    assert [r["id"] for r in got] == ["doc-1", "doc-0", "doc-3"] and records(tmp_path / "out.jsonl") == got
    assert [r["error"] for r in got] == [
        {"type": "PromptTooLong", "message": "the prompt is 900 tokens long", "hint": "shorten the document"},
        {"type": "MemoryError", "message": "out of", "hint": got[1]["error"]["hint"]},
        {"type": "InvalidInput", "message": "bad", "hint": None}]
    assert "--retry-failed" in got[1]["error"]["hint"]


# ---------------------------------------------------------------------- the lock
LOCK_HOLDER = """
import sys, time
from multidecode.batch import BatchSettings, open_batch
job = open_batch(sys.argv[1], sys.argv[2], BatchSettings(), retry_failed=True)
print("locked", job.retried, flush=True)
time.sleep(600)
"""


def failed_record(key: str, line: int) -> str:
    return json.dumps({"id": key, "line": line, "answers": [], "error": {"type": "RuntimeError", "message": "x",
                       "hint": None}, "tokens": 0, "elapsed_s": 0.0, "settings": BatchSettings().fingerprint})


def test_the_lock_lives_on_out_lock_survives_the_retry_rewrite_and_dies_with_its_process(tmp_path):
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    out = write_lines(tmp_path / "out.jsonl", [failed_record("doc-0", 1)])
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(source), str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().split() == ["locked", "1"]  # it rewrote the output without doc-0's record
        assert out.read_text() == "" and lock_path(out).exists()
        with pytest.raises(multidecode.InvalidInput, match="being written by another multidecode batch run") as caught:
            open_batch(source, out, BatchSettings())
        assert str(lock_path(out)) in caught.value.message and "--output" in caught.value.hint
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    with open_batch(source, out, BatchSettings()) as job:  # the kernel dropped the killed holder's lock
        assert len(job.pending) == 2


@pytest.mark.parametrize("case", ["missing input", "input folder", "compressed input", "no lines", "output folder",
                                  "output is input", "missing model", "zero max tokens", "bad temperature",
                                  "empty job question", "not a batch output", "lock not writable",
                                  "nothing to ask", "a question, not questions", "a pipe"])
def test_problems_with_the_job_exit_2_with_a_hint(model_dir, tmp_path, case):
    source = write_lines(tmp_path / "in.jsonl", [{"document": "text", "questions": ["why?"]}])
    out = tmp_path / "out.jsonl"
    args, needle = [source, "--output", out, "--model", model_dir], None
    if case == "missing input":
        args[0], needle = tmp_path / "nope.jsonl", "does not exist"
    elif case == "input folder":
        args[0], needle = tmp_path, "is a folder"
    elif case == "compressed input":
        (tmp_path / "in.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(50))
        args[0], needle = tmp_path / "in.jsonl.gz", "not a text file"
    elif case == "no lines":
        source.write_text("\n  \n")
        needle = "has no input lines"
    elif case == "output folder":
        args[2], needle = tmp_path / "missing" / "out.jsonl", "does not exist"
    elif case == "output is input":
        args[2], needle = source, "the output is the input file"
    elif case == "missing model":
        args[4], needle = tmp_path / "no-model", "does not exist"
    elif case == "zero max tokens":
        args, needle = args + ["--max-new-tokens", 0], "--max-new-tokens must be a positive integer"
    elif case == "bad temperature":
        args, needle = args + ["--temperature", -0.5], "--temperature must be 0 (greedy) or more"
    elif case == "empty job question":
        args, needle = args + ["-q", "  "], "question 1 is empty"
    elif case == "not a batch output":
        out.write_text(source.read_text())
        needle = "not a multidecode batch output"
    elif case == "lock not writable":
        lock_path(out).mkdir()
        needle = f"cannot write {lock_path(out)}"
    elif case == "nothing to ask":  # -q forgotten: every line would fail alike
        write_lines(source, [{"document": "text"}, {"document": "more", "questions": []}])
        needle = "the job has no questions and no line of"
    elif case == "a question, not questions":  # a dataset's own key: the job-level error said nothing of it
        write_lines(source, [{"document": "text", "question": "why?"}])
        needle = 'line 1: the line has no "questions" (it has "question": a list of them goes in "questions")'
    elif case == "a pipe":  # /dev/stdin, <(...) or a fifo: read once to check, it said "no input lines" or hung
        os.mkfifo(tmp_path / "fifo")
        args[0], needle = tmp_path / "fifo", "is a pipe or a device, not a file"
    before = out.read_bytes() if out.exists() else None
    result = run(*args)
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "error:" in result.stderr and "hint:" in result.stderr and needle in result.stderr, result.stderr
    assert "Traceback" not in result.output
    if before is not None:
        assert out.read_bytes() == before  # never touched


def test_resume_after_a_cut_short_last_line(model_dir, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", documents(6))
    full, out = tmp_path / "full.jsonl", tmp_path / "out.jsonl"
    assert run(source, "-o", full, "--model", model_dir, "--max-new-tokens", 5).exit_code == 0
    lines = full.read_bytes().splitlines(keepends=True)
    for cut in (lines[2][:40], b'{"id": "doc-2", "li\n', b"\x00" * 30, b"{", b'{"', b'{"id'):
        # what a crash mid-write can leave: part of a record (its first bytes only, on a full disk), or zeros
        out.write_bytes(b"".join(lines[:2]) + cut)
        result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 5)
        assert result.exit_code == 0, result.output
        assert "removed the unfinished last line" in result.stderr and "2 already in" in result.stderr
        assert results(records(out)) == results(records(full))
        assert out.read_bytes().startswith(b"".join(lines[:2]))  # finished records are never rewritten
    # all of a record but its newline: the record is whole, so it is kept and the newline added
    out.write_bytes(b"".join(lines[:2]) + lines[2][:-1])
    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 5)
    assert result.exit_code == 0, result.output
    assert "removed" not in result.stderr and "3 already in" in result.stderr
    assert results(records(out)) == results(records(full)) and out.read_bytes().startswith(b"".join(lines[:3]))


def test_a_finished_job_is_not_redone_and_loads_no_model(model_dir, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", documents(3))
    out = tmp_path / "out.jsonl"
    assert run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 3).exit_code == 0
    before = out.read_bytes()
    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 3, "--json")
    assert result.exit_code == 0, result.output
    assert "Loaded" not in result.stderr and "0 to do" in result.stderr
    assert json.loads(result.stdout)["skipped"] == 3 and out.read_bytes() == before

    # lines appended to the input later: only they are done
    write_lines(source, documents(5))
    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 3, "--json")
    assert json.loads(result.stdout)["done"] == 2
    assert out.read_bytes().startswith(before) and list(by_id(records(out))) == [f"doc-{i}" for i in range(5)]


def test_other_settings_are_refused(model_dir, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    out = tmp_path / "out.jsonl"
    assert run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 3).exit_code == 0
    before = out.read_bytes()
    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 4, "-q", "who?")
    assert result.exit_code == 2, result.output
    assert "other settings" in result.stderr and "--max-new-tokens was 3, now 4" in result.stderr  # in the command's words
    assert 'questions was [], now ["who?"]' in result.stderr
    # without the settings file, the fingerprints in the records still refuse it
    meta_path(out).unlink()
    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 4)
    assert result.exit_code == 2 and "other settings" in result.stderr and "fingerprint" in result.stderr
    assert out.read_bytes() == before
    # the original settings resume (and write the settings file again)
    assert run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 3).exit_code == 0
    assert meta_path(out).exists()


def test_retry_failed_redoes_only_the_failed_lines_and_keeps_one_record_per_id(model_dir, tmp_path):
    rows = documents(4)
    rows[1] = {**rows[1], "questions": ["what failed?", ""]}
    source = write_lines(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 4).exit_code == 0
    assert by_id(records(out))["doc-1"]["error"]["message"] == "question 2 of the line is empty"
    good_lines = [line for line in out.read_text().splitlines() if '"doc-1"' not in line]

    write_lines(source, documents(4))  # the input is fixed
    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 4)
    assert result.exit_code == 0 and "0 to do" in result.stderr  # a failure is a result: not redone by default
    assert by_id(records(out))["doc-1"]["error"] is not None

    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 4, "--retry-failed", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["retried"], summary["done"], summary["skipped"], summary["failed"]) == (1, 1, 3, 0)
    got = by_id(records(out))
    assert sorted(got) == [f"doc-{i}" for i in range(4)] and got["doc-1"]["error"] is None
    assert out.read_text().splitlines()[:3] == good_lines  # the others are untouched
    assert not list(tmp_path.glob(".*tmp"))


def test_two_runs_cannot_write_one_output(tmp_path):
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    with open_batch(source, tmp_path / "out.jsonl", BatchSettings()), \
            pytest.raises(multidecode.InvalidInput, match="being written by another"):
        open_batch(source, tmp_path / "out.jsonl", BatchSettings())
    open_batch(source, tmp_path / "out.jsonl", BatchSettings()).close()  # the lock went with the job


def test_ctrl_c_while_the_model_loads_stops_the_job_with_its_summary(model_dir, tmp_path, monkeypatch):
    """--json still prints the summary (stopped, nothing done), with the resume hint and 130, as a
    job stopped between documents does: a script reading stdout gets its JSON either way."""
    import multidecode.cli.batch as batch_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(batch_cli, "load_decoder", interrupted)
    source = write_lines(tmp_path / "in.jsonl", [{"document": "The modem light is red.", "questions": ["what colour?"]}])
    result = run(source, "-o", tmp_path / "out.jsonl", "--model", model_dir, "--json")
    assert result.exit_code == 130, result.output
    summary = json.loads(result.stdout)
    assert summary["stopped"] and (summary["done"], summary["remaining"], summary["complete"]) == (0, 1, False)
    assert "run the same command again to resume" in result.stderr and "Traceback" not in result.output


def test_the_library_runs_silently_and_stops_on_request(model_dir, tmp_path, capsys):
    source = write_lines(tmp_path / "in.jsonl", documents(4))
    out = tmp_path / "out.jsonl"
    decoder = multidecode.load(str(model_dir))
    settings = BatchSettings(max_new_tokens=3, model="tiny", precision="float32")  # as run_batch labels it
    with open_batch(source, out, settings) as job:
        assert (job.total, job.skipped, len(job.pending)) == (4, 0, 4)
        for result in job.run(decoder, forest_tokens=0):  # one line at a time: none in flight at stop()
            assert result.ok and result.id == "doc-0" and result.tokens > 0
            job.stop()
        summary = job.summary()
    assert (summary.done, summary.remaining, summary.complete) == (1, 3, False)
    summary = run_batch(decoder, source, out, max_new_tokens=3, model="tiny")
    assert (summary.skipped, summary.done, summary.remaining, summary.failed) == (1, 3, 0, 0)
    assert summary.as_dict()["tokens_per_s"] > 0
    assert len(by_id(records(out))) == 4
    assert capsys.readouterr() == ("", "")


def test_speculation_gives_the_same_records_and_is_not_a_setting(model_dir, tmp_path):
    """suffix drafts (it is fed and accepts some), yet every record equals the plain run's, and the
    settings (fingerprint, meta file) do not mention speculation."""
    from multidecode.batch import total_stats
    from multidecode.proposers.suffix import SuffixProposer, SuffixStore

    source = write_lines(tmp_path / "in.jsonl", documents(6))
    decoder = multidecode.load(str(model_dir))
    settings = BatchSettings(max_new_tokens=8, model="tiny", precision="float32")  # as run_batch labels it
    with one_thread():
        run_batch(decoder, source, tmp_path / "plain.jsonl", max_new_tokens=8, model="tiny")
        with open_batch(source, tmp_path / "suffix.jsonl", settings) as job:
            lines = list(job.run(decoder, speculate=SuffixProposer(store=SuffixStore())))
        run_batch(decoder, source, tmp_path / "shared.jsonl", max_new_tokens=8, model="tiny", speculate="suffix")
    plain = results(records(tmp_path / "plain.jsonl"))
    assert results(records(tmp_path / "suffix.jsonl")) == plain
    assert results(records(tmp_path / "shared.jsonl")) == plain
    totals = total_stats(line.stats for line in lines)
    assert totals["speculate"] == "suffix" and totals["runs"] == 6
    assert totals["drafted"] > 0 and totals["accepted"] > 0  # it did speculate, from earlier documents
    assert [len(line.answers) for line in lines] == [2] * 6
    assert {record["settings"] for record in plain.values()} == {settings.fingerprint}
    metas = [json.loads(meta_path(tmp_path / f"{name}.jsonl").read_text()) for name in ("plain", "suffix", "shared")]
    assert metas[0]["settings"] == metas[1]["settings"] == metas[2]["settings"]
    assert set(metas[0]) == {"format", "fingerprint", "settings", "input", "inputs", "multidecode"}
    assert "speculat" not in json.dumps(metas[0]["settings"])


def test_total_stats_sums_counts_and_totals_again():
    from multidecode.batch import total_stats

    a = {"speculate": "suffix", "steps": 4, "forward_passes": 5, "tokens": 20, "drafted": 10, "accepted": 5,
         "steps_speculating": 2, "mean_draft_budget": 2.5}
    b = {"speculate": "lookup", "steps": 6, "forward_passes": 7, "tokens": 10, "drafted": 10, "accepted": 0,
         "steps_speculating": 6, "mean_draft_budget": 5.0}
    plain = {"speculate": None, "steps": 2, "forward_passes": 3, "tokens": 6, "drafted": 0, "accepted": 0}
    once = total_stats([a, {}, b, plain])  # a failed line has no stats
    assert once == {"speculate": "lookup+suffix", "runs": 3, "steps": 12, "forward_passes": 15, "tokens": 36,
                    "drafted": 20, "accepted": 5, "steps_speculating": 8, "tokens_per_forward": 36 / 15,
                    "acceptance": 0.25, "mean_draft_budget": (10 + 30) / 12}
    running: dict = {}
    for stats in (a, {}, b, plain):
        running = total_stats([running, stats])
    assert running == pytest.approx(once) and running["speculate"] == once["speculate"]
    assert total_stats([plain])["acceptance"] is None and total_stats([])["runs"] == 0


def test_the_command_speculates_and_resumes_with_another_mode(model_dir, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    plain, out = tmp_path / "plain.jsonl", tmp_path / "out.jsonl"
    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 6, "--speculate", "suffix", "--stats")
    assert result.exit_code == 0, result.output
    assert "2 lines answered in this run:" in result.stderr and "speculate=suffix" in result.stderr
    write_lines(source, documents(4))  # two more lines, done with another mode
    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 6, "--speculate", "lookup", "--json",
                 "--stats")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["done"] == 2 and "speculate=lookup" in result.stderr
    assert f"answered in this run: {summary['forward_passes']} forwards" in result.stderr  # the forest's, not summed
    assert run(source, "-o", plain, "--model", model_dir, "--max-new-tokens", 6).exit_code == 0
    assert results(records(out)) == results(records(plain))
    # nothing left to do: no stats to print, and a bad mode is refused before the job is opened
    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 6, "--speculate", "auto", "--stats")
    assert result.exit_code == 0 and "answered in this run" not in result.stderr
    result = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 6, "--speculate", "psychic")
    assert result.exit_code == 2 and "unknown speculation mode 'psychic'" in result.stderr


def broken(model_dir):
    """A decoder whose every forward fails unexpectedly (a device that went away)."""
    decoder = multidecode.load(str(model_dir))

    def fail(module, args, kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")

    decoder.model.register_forward_pre_hook(fail, with_kwargs=True)
    return decoder


def test_a_command_that_errors_stop_says_what_it_did(model_dir, tmp_path, monkeypatch):
    """A run ended by repeated unexpected errors printed the error alone: no summary on stderr, and
    nothing on stdout under --json. A job error before any line (a bad setting) stays one line."""
    import multidecode.cli.batch as command

    monkeypatch.setattr(command, "load_decoder", lambda *args, **kwargs: broken(model_dir))
    source = write_lines(tmp_path / "in.jsonl", documents(8))
    result = run(source, "-o", tmp_path / "out.jsonl", "--model", model_dir, "--forest-tokens", 0, "--json")
    assert result.exit_code == 1 and "5 unexpected errors in a row" in result.stderr, result.output
    assert "Stopped: 5 of 8 lines are in" in result.stderr and "RuntimeError: CUDA error" in result.stderr
    summary = json.loads(result.stdout)
    assert (summary["done"], summary["failed"], summary["remaining"], summary["stopped"]) == (5, 5, 3, True)
    assert summary["error"]["type"] == "BatchAborted" and "--retry-failed" in summary["error"]["hint"]
    refused = run(source, "-o", tmp_path / "other.jsonl", "--model", model_dir, "--max-new-tokens", 999, "--json")
    assert refused.exit_code == 2 and refused.stdout == "" and "Stopped" not in refused.stderr


def test_ctrl_c_while_the_model_loads_leaves_no_output(model_dir, tmp_path, monkeypatch):
    """It left an empty OUT.jsonl and its settings file behind (harmless to resume, but litter)."""
    import multidecode.cli.batch as command

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "load_decoder", interrupted)
    out = tmp_path / "out.jsonl"
    result = run(write_lines(tmp_path / "in.jsonl", documents(2)), "-o", out, "--model", model_dir)
    assert result.exit_code == 130 and "run the same command again" in result.stderr, result.output
    assert not out.exists() and not meta_path(out).exists()


def test_unexpected_errors_are_recorded_and_too_many_in_a_row_stop_the_job(model_dir, tmp_path):
    rows = documents(10)
    rows[3] = {"id": "bad", "document": ""}  # input errors do not count as crashes
    source = write_lines(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    with open_batch(source, out, BatchSettings()) as job, \
            pytest.raises(BatchAborted, match="5 unexpected errors in a row"):
        for _ in job.run(broken(model_dir), forest_tokens=0):
            pass
    got = records(out)
    ids = [r["id"] for r in got]
    # one line at a time, every document crashing: "bad" is recorded as soon as it is read (how far
    # the reader is ahead of the documents in flight is the threads' business) and ends the streak;
    # the job stops at the fifth crash after it, and never stopped before it
    at = ids.index("bad")
    assert got[at]["error"]["type"] == "InvalidInput"
    assert [i for i in ids if i != "bad"] == [f"doc-{n}" for n in (0, 1, 2, 4, 5, 6, 7, 8, 9)][:len(ids) - 1]
    assert at < 5 and len(ids) == at + 1 + 5
    assert all(r["error"]["type"] == "RuntimeError" for r in got if r["id"] != "bad")
    error = got[0]["error"]
    assert error["type"] == "RuntimeError"
    assert error["message"] == "CUDA error: an illegal memory access was encountered"  # its first line
    assert "--retry-failed" in error["hint"]


def test_parse_line_reads_ids_and_falls_back_to_the_line_number():
    assert parse_line(b'{"id": "a", "document": "d", "questions": ["q"]}', 4).key == "a"
    assert parse_line(b'{"id": null, "document": "d", "questions": ["q"]}', 4).id == 4
    assert parse_line(b'{"document": "d"}', 9, ["job?"]).questions == ("job?",)
    assert parse_line(b"\xff\xfe", 5).error.message.startswith("line 5 is not UTF-8")
    for bad in (b'{"id": true}', b'{"id": ""}', b'{"id": [1]}'):
        item = parse_line(bad, 3)
        assert item.id == 3 and "must be a string or an integer" in item.error.message


@pytest.mark.parametrize("case", ["two records for one id", "a bad line inside", "another file's JSON last"])
def test_an_output_that_cannot_be_repaired_is_refused_untouched(tmp_path, case):
    source = write_lines(tmp_path / "in.jsonl", documents(3))
    good = [failed_record("doc-0", 1), "", failed_record("doc-1", 2)]  # a blank line is harmless
    rows, needle = {
        "two records for one id": (good + [failed_record("doc-0", 1)], "two records for id 'doc-0' (lines 1 and 4)"),
        "a bad line inside": (good[:1] + ['{"id": "doc-1", "li'] + good[2:], "line 2 is not a result record"),
        "another file's JSON last": (good + ['{"name": "not a record"}'], "line 4 is not a result record"),
    }[case]
    out = write_lines(tmp_path / "out.jsonl", rows)
    before = out.read_bytes()
    with pytest.raises(multidecode.InvalidInput, match=re.escape(needle)):
        open_batch(source, out, BatchSettings())
    assert out.read_bytes() == before
    with open_batch(source, write_lines(out, good), BatchSettings()) as job:  # without the bad line: it opens
        assert (job.skipped, job.earlier_failures, job.repaired) == (2, 2, False)


def test_whole_json_that_is_no_record_is_refused_even_without_its_newline(tmp_path):
    """A one-line JSON file given as the output by mistake (its last line without a newline) is
    someone's data, not an interrupted write: refused, the file untouched (it was truncated)."""
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    out = tmp_path / "precious.jsonl"
    out.write_bytes(b'{"id": "precious", "document": "my only copy"}')
    with pytest.raises(multidecode.InvalidInput, match="line 1 is not a result record"):
        open_batch(source, out, BatchSettings())
    assert out.read_bytes() == b'{"id": "precious", "document": "my only copy"}'


def test_one_output_reached_by_two_names_takes_one_lock_and_stays_behind_its_link(tmp_path):
    """A symbolic link to the output is the output: a second run through it is refused while the
    first holds the lock (two writers made duplicate records), and the atomic rewrite of a retry
    replaces the file the link points to, not the link."""
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    out = write_lines(tmp_path / "out.jsonl", [failed_record("doc-0", 1)])
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    with open_batch(source, out, BatchSettings()), \
            pytest.raises(multidecode.InvalidInput, match="being written by another"):
        open_batch(source, link, BatchSettings())
    with open_batch(source, link, BatchSettings(), retry_failed=True) as job:
        assert job.retried == 1 and len(job.pending) == 2
        assert job.summary().output == str(link)  # reported as the user named it
    assert link.is_symlink() and out.read_text() == ""


def test_failures_do_not_hold_a_job_to_the_settings_that_made_them(tmp_path):
    """Records that failed carry no results: a job whose lines failed under some settings (no
    questions, a prompt too long for its max_new_tokens) goes on with the settings that mend it,
    and --retry-failed redoes them with those; a result made with other settings still refuses."""
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    out = write_lines(tmp_path / "out.jsonl", [failed_record("doc-0", 1), failed_record("doc-1", 2)])
    mended = BatchSettings(questions=("who?",), max_new_tokens=5)
    with open_batch(source, out, mended, retry_failed=True) as job:
        assert job.retried == 2 and len(job.pending) == 2
    result = dict(json.loads(failed_record("doc-0", 1)), error=None)
    write_lines(out, [json.dumps(result)])
    with pytest.raises(multidecode.InvalidInput, match="other settings"):
        open_batch(source, out, mended)


def test_retry_failed_also_drops_failures_of_ids_no_longer_in_the_input(tmp_path):
    """A bad line fixed with a new id leaves its old failure (recorded under its line number)
    behind: --retry-failed drops it too, so the output keeps one record per input line."""
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    out = write_lines(tmp_path / "out.jsonl", [failed_record("2", 2), failed_record("doc-0", 1)])
    with open_batch(source, out, BatchSettings(), retry_failed=True) as job:
        assert (job.retried, job.foreign, len(job.pending)) == (1, 0, 2)
    assert out.read_text() == ""


def test_a_lock_that_cannot_be_made_is_not_called_another_run_s(tmp_path, monkeypatch):
    """Where the lock file cannot be created (a folder like /proc, where filelock only times out),
    the refusal says so, not that another run holds it."""
    from multidecode.batch import output

    source = write_lines(tmp_path / "in.jsonl", documents(1))
    monkeypatch.setattr(output, "lock_path", lambda out: Path("/proc/self/out.jsonl.lock"))
    with pytest.raises(multidecode.InvalidInput, match="cannot write /proc/self/out.jsonl.lock"):
        open_batch(source, tmp_path / "out.jsonl", BatchSettings())


def test_job_questions_given_as_one_string_are_one_question():
    assert BatchSettings(questions="Who called?").questions == ("Who called?",)
    assert BatchSettings(stop="###").stop == ("###",)


def test_a_job_started_in_python_resumes_on_the_command_line(tmp_path, cache):
    """`run_batch` labels the model as the command line does (what `load` was given), so the
    same job resumes there: a GGUF file's model was labelled by its converted copy's path."""
    from multidecode.models.random_gguf import write_random_gguf

    model = tmp_path / "tiny.gguf"
    write_random_gguf(model, shape="tiny")
    source = write_lines(tmp_path / "in.jsonl", documents(3)[:2])
    out = tmp_path / "out.jsonl"
    summary = run_batch(multidecode.load(str(model)), source, out, questions=["who?"], max_new_tokens=3)
    assert summary.done == 2
    write_lines(source, documents(3))
    result = run(source, "-o", out, "--model", model, "-q", "who?", "--max-new-tokens", 3)
    assert result.exit_code == 0, result.output
    assert "2 already in" in result.stderr and len(records(out)) == 3


# ---------------------------------------------------------------------- real interruptions
def start(source: Path, out: Path, model_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen([str(MULTIDECODE), "batch", str(source), "--output", str(out), "--model", str(model_dir),
                             "--max-new-tokens", "8"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_lines(process: subprocess.Popen, out: Path, at_least: int, timeout: float = 60.0) -> int:
    """Poll the output until it holds at least `at_least` finished lines; returns how many."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = out.read_bytes().count(b"\n") if out.exists() else 0
        if done >= at_least:
            return done
        if process.poll() is not None:
            pytest.fail(f"the run ended before it was interrupted: {process.communicate()}")
        time.sleep(0.002)
    process.kill()
    pytest.fail("the run wrote too few lines in time")


def interrupt(source: Path, out: Path, model_dir: Path, *, after_lines: int, sig: int) -> tuple[subprocess.Popen, str]:
    """Start a batch run, send it `sig` once `after_lines` lines are written, and wait for it to
    end: the run and what it wrote to stderr, for the resume tests to check what was kept."""
    process = start(source, out, model_dir)
    wait_for_lines(process, out, at_least=after_lines)
    process.send_signal(sig)
    _stdout, stderr = process.communicate(timeout=30)
    return process, stderr


@pytest.fixture()
def job(model_dir, tmp_path):
    """60 documents and the records of an uninterrupted run over them."""
    source = write_lines(tmp_path / "in.jsonl", documents(60))
    reference = tmp_path / "reference.jsonl"
    result = run(source, "-o", reference, "--model", model_dir, "--max-new-tokens", 8)
    assert result.exit_code == 0, result.output
    return source, results(records(reference))


@pytest.mark.slow
def test_a_run_killed_part_way_resumes_without_losing_or_repeating_a_line(model_dir, tmp_path, job):
    source, reference = job
    out = tmp_path / "out.jsonl"
    process, _stderr = interrupt(source, out, model_dir, after_lines=3, sig=signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    kept = by_id([json.loads(line) for line in out.read_text().splitlines(keepends=True) if line.endswith("\n")])
    assert 3 <= len(kept) < 60, len(kept)

    again = start(source, out, model_dir)
    _stdout, stderr = again.communicate(timeout=120)
    assert again.returncode == 0, stderr
    assert f"{len(kept)} already in" in stderr and "Done: all 60 lines" in stderr
    assert results(records(out)) == reference  # every id exactly once, with the answers of a clean run
    assert [r["id"] for r in records(out)][:len(kept)] == list(kept)  # what was written stayed as it was


@pytest.mark.slow
def test_ctrl_c_finishes_the_current_document_exits_130_and_resumes(model_dir, tmp_path, job):
    source, reference = job
    out = tmp_path / "out.jsonl"
    process, stderr = interrupt(source, out, model_dir, after_lines=2, sig=signal.SIGINT)
    assert process.returncode == 130, stderr
    assert "stopping after the documents in progress (press Ctrl-C again" in stderr and "Traceback" not in stderr
    assert "run the same command again to resume: multidecode batch" in stderr
    done = records(out)  # whole lines only: it stopped between documents
    assert 2 <= len(done) < 60 and f"{len(done)} of 60 lines" in stderr

    result = run(source, "--output", out, "--model", model_dir, "--max-new-tokens", 8)
    assert result.exit_code == 0, result.output
    assert results(records(out)) == reference


@pytest.mark.parametrize("word", ["plain", "two words", "it's", "\n", "line\nbreak", "tab\tand 'quote' \\ é\n",
                                  "\x01", "\U0001f600\n"])
def test_the_resume_hint_gives_each_word_back_to_the_shell_on_one_line(word):
    """`--stop $'\\n'` came back as '<newline>': a hint over two lines that a copy would cut."""
    from multidecode.cli.batch import shell_word

    quoted = shell_word(word)
    assert quoted.isprintable()
    echoed = subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True, check=True).stdout
    assert echoed.decode("utf-8") == word


def test_the_example_input_is_valid():
    from multidecode.batch.lines import input_lines, scan_input

    data = Path(multidecode.__file__).parent / "data"
    questions = (data / "support_call_questions.txt").read_text().splitlines()
    assert len(scan_input(data / "example_batch.jsonl", questions)) == 4
    for number, raw in input_lines(data / "example_batch.jsonl"):
        assert parse_line(raw, number, questions).error is None


def test_a_run_that_ends_with_lines_left_says_the_input_changed(capsys):
    """A run not stopped that ends with lines left read its input to the end: the input changed
    under it (rewritten in place, lines removed). The summary said "Ended: ... 50 to go" and no why."""
    from multidecode.batch.job import BatchSummary
    from multidecode.cli.batch import print_summary

    summary = BatchSummary(input="in.jsonl", output="out.jsonl", total=120, skipped=0, retried=0, done=70, failed=0,
                           remaining=50, tokens=700, elapsed_s=10.0, earlier_failures=0, repaired=False)
    print_summary(summary, stopped=False)
    assert "in.jsonl changed during the run" in " ".join(capsys.readouterr().err.split())
    print_summary(summary, stopped=True)  # stopped: the lines left are simply left
    assert "changed" not in capsys.readouterr().err


def test_a_job_that_fails_before_its_first_record_leaves_no_empty_output(model_dir, tmp_path):
    """A setting only the loaded model can check fails after the output was opened: the output and
    its settings file it made are gone again; an output that was there before stays, records and all."""
    source = write_lines(tmp_path / "in.jsonl", [{"document": "text", "questions": ["why?"]}])
    out = tmp_path / "out.jsonl"
    result = run(source, "--output", out, "--model", model_dir, "--speculate", "eagle")
    assert result.exit_code == 2 and "eagle" in result.output, result.output
    assert not out.exists() and not meta_path(out).exists()

    kept = write_lines(tmp_path / "kept.jsonl", [failed_record("doc-0", 1)])
    with pytest.raises(RuntimeError, match="boom"), open_batch(source, kept, BatchSettings()):
        raise RuntimeError("boom")
    assert records(kept)[0]["id"] == "doc-0" and meta_path(kept).exists()


# ---------------------------------------------------------------------- resuming the same job only
def test_a_job_at_auto_does_not_resume_at_the_precision_auto_chose(tmp_path, cache):
    """At auto a GGUF file keeps its own codes, which --precision int8 re-codes: both were
    fingerprinted "int8", so a job resumed at the other mixed two models' answers in one output."""
    from gguf_files import write_tiny_gguf

    from multidecode.models.loading import resolve_precision

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)  # Q8_0 matrices: auto keeps them as int8 codes
    assert resolve_precision(gguf).identity == "auto (int8)" and resolve_precision(gguf, "int8").identity == "int8"
    source = write_lines(tmp_path / "in.jsonl", [{"document": "The cable.", "questions": ["why?"]}] * 2)
    out = tmp_path / "out.jsonl"
    base = [source, "-o", out, "--model", gguf, "--max-new-tokens", 2]  # its context: 128 positions
    assert run(*base, "--precision", "int8").exit_code == 0
    assert not any(record["error"] for record in records(out))  # answers bind a job to their settings
    resumed = run(*base)
    assert resumed.exit_code == 2 and "other settings" in resumed.output and "auto (int8)" in resumed.output


def test_a_job_does_not_resume_from_another_input_file(model_dir, tmp_path):
    """Another input file's lines were matched to these results by line number and taken as done,
    their answers another document's. An input moved elsewhere still resumes."""
    first, second = documents(3)[:2], documents(3)[1:]
    started = write_lines(tmp_path / "a.jsonl", [{k: v for k, v in row.items() if k != "id"} for row in first])
    other = write_lines(tmp_path / "b.jsonl", [{k: v for k, v in row.items() if k != "id"} for row in second])
    out = tmp_path / "out.jsonl"
    assert run(started, "-o", out, "--model", model_dir, "--max-new-tokens", 2).exit_code == 0
    refused = run(other, "-o", out, "--model", model_dir, "--max-new-tokens", 2)
    assert refused.exit_code == 2 and f"holds the results of {started}" in refused.output, refused.output
    moved = started.rename(tmp_path / "moved.jsonl")
    assert run(moved, "-o", out, "--model", model_dir, "--max-new-tokens", 2).exit_code == 0
    assert len(records(out)) == 2
    started.write_text("")  # a file back at the first path: another input with ids of its own still adds
    more = write_lines(tmp_path / "c.jsonl", documents(4)[3:])
    assert run(more, "-o", out, "--model", model_dir, "--max-new-tokens", 2).exit_code == 0
    assert len(records(out)) == 3


def test_a_file_of_new_ids_resumes_as_one_of_the_outputs_inputs(model_dir, tmp_path):
    """A second input that added its ids to an output could not resume there afterwards: the
    output was taken for the first file's alone, and the second's own results for the first's."""
    first = write_lines(tmp_path / "a.jsonl", documents(2))
    second = write_lines(tmp_path / "b.jsonl", documents(4)[2:])
    out = tmp_path / "out.jsonl"
    for source in (first, second, second, first):
        ran = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 2)
        assert ran.exit_code == 0, ran.output
    assert len(records(out)) == 4
    meta = json.loads(meta_path(out).read_text())
    assert meta["input"] == str(first.resolve()) and meta["inputs"] == [str(first.resolve()), str(second.resolve())]
    third = write_lines(tmp_path / "c.jsonl", documents(4)[1:2])  # one of the first file's ids: still refused
    refused = run(third, "-o", out, "--model", model_dir, "--max-new-tokens", 2)
    assert refused.exit_code == 2 and "holds the results of" in refused.output, refused.output
    assert "a.jsonl" in refused.stderr and "b.jsonl" in refused.stderr  # the records do not say which one wrote them


def test_outputs_that_are_no_file_are_refused_before_anything_is_written(model_dir, tmp_path):
    """-o /dev/null died in fsync with a traceback, leaving /dev/null.lock and .meta.json behind (a
    socket stands for the device here: no test writes into /dev); -o - wrote files named '-'."""
    import socket

    source = write_lines(tmp_path / "in.jsonl", documents(1))
    special = tmp_path / "socket"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(special))
        device = run(source, "-o", special, "--model", model_dir)
    assert device.exit_code == 2 and "not a regular file" in device.output
    assert not lock_path(special).exists() and not meta_path(special).exists()
    dash = run(source, "-o", "-", "--model", model_dir)
    assert dash.exit_code == 2 and "not to standard output" in dash.output


def test_a_full_disk_is_an_error_with_a_hint_and_the_job_resumes(model_dir, tmp_path, monkeypatch):
    """ENOSPC while appending was a traceback; the output keeps what was written, and the same
    command resumes after the last whole record."""
    from multidecode.batch import output

    source = write_lines(tmp_path / "in.jsonl", documents(3))
    out = tmp_path / "out.jsonl"
    write, appended = os.write, []

    def full_after_one(fd, data):
        if appended:
            raise OSError(28, "No space left on device")
        appended.append(data)
        return write(fd, data)

    monkeypatch.setattr(output.os, "write", full_after_one)
    full = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 2, "--forest-tokens", 0)
    assert full.exit_code == 2 and "No space left on device" in full.output and "rerun the same command" in full.output
    assert full.exception is None or isinstance(full.exception, SystemExit)
    monkeypatch.setattr(output.os, "write", write)
    assert run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 2).exit_code == 0
    assert sorted(r["id"] for r in records(out)) == [row["id"] for row in documents(3)]


def test_a_full_disk_under_the_settings_file_or_a_retry_names_that_file(model_dir, tmp_path, monkeypatch):
    """ENOSPC while writing OUT.meta.json (or rewriting OUT for --retry-failed) named no file, so the
    command blamed standard output ("send standard output where there is room"); the output stays as it was."""
    from multidecode.batch import output

    source = write_lines(tmp_path / "in.jsonl", [*documents(2), {"id": "bad", "document": "x", "questions": [""]}])
    out = tmp_path / "out.jsonl"

    def no_space(path, chunks, **how):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(output, "replace_atomically", no_space)
    fresh = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 2)
    assert fresh.exit_code == 2 and f"cannot write {meta_path(out)}: No space left on device" in fresh.stderr
    assert "standard output" not in fresh.output and "rerun the same command" in fresh.output
    monkeypatch.undo()
    assert run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 2).exit_code == 0
    before = out.read_bytes()
    monkeypatch.setattr(output, "replace_atomically", no_space)
    retry = run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 2, "--retry-failed")
    assert retry.exit_code == 2 and f"cannot write {out}: No space left on device" in retry.stderr
    assert "standard output" not in retry.output and out.read_bytes() == before


def test_a_clash_with_an_unreadable_lines_number_names_the_unreadable_line(model_dir, tmp_path):
    """Ids 0-4 with line 3 broken: 'id 3 is on lines 3 and 4' pointed at line 4, whose id is right."""
    source = tmp_path / "in.jsonl"
    rows = [json.dumps({"id": i, "document": "A line.", "questions": ["why?"]}) for i in range(5)]
    rows[2] = '{"id": 2, "document": "broken'
    source.write_text("\n".join(rows) + "\n")
    result = run(source, "-o", tmp_path / "out.jsonl", "--model", model_dir)
    assert result.exit_code == 2 and "id 3 is on lines 3 and 4 (line 3's id is its number" in result.output
    assert "not valid JSON" in result.output and "mend the lines that cannot be read" in result.output


def test_sampled_answers_carry_their_seeds(model_dir, tmp_path):
    """A sampled job without --seed could not be reproduced: its records had no seeds."""
    source = write_lines(tmp_path / "in.jsonl", documents(1))
    out = tmp_path / "out.jsonl"
    assert run(source, "-o", out, "--model", model_dir, "--max-new-tokens", 3, "--temperature", 0.8).exit_code == 0
    (record,) = records(out)
    seeds = [a["seed"] for a in record["answers"]]
    assert all(isinstance(s, int) for s in seeds) and seeds == list(range(seeds[0], seeds[0] + len(seeds)))
    again = tmp_path / "again.jsonl"
    assert run(source, "-o", again, "--model", model_dir, "--max-new-tokens", 3, "--temperature", 0.8,
               "--seed", seeds[0]).exit_code == 0
    assert [a["answer"] for a in records(again)[0]["answers"]] == [a["answer"] for a in record["answers"]]
    greedy = tmp_path / "greedy.jsonl"
    assert run(source, "-o", greedy, "--model", model_dir, "--max-new-tokens", 3).exit_code == 0
    assert all("seed" not in a for a in records(greedy)[0]["answers"])


def test_lines_added_during_a_run_leave_it_incomplete_for_the_next(model_dir, tmp_path):
    """A line appended while the job ran was passed over and the job called complete ("Done", exit
    0) though the file held a line without a result."""
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    out = tmp_path / "out.jsonl"
    decoder = multidecode.load(str(model_dir))
    settings = BatchSettings(max_new_tokens=3, model="tiny", precision="float32")  # as run_batch labels it
    with open_batch(source, out, settings) as job:
        with open(source, "a") as handle:
            handle.write(json.dumps(documents(3)[2]) + "\n")
        list(job.run(decoder))
        summary = job.summary()
    assert (summary.done, summary.remaining, summary.complete) == (2, 1, False)
    assert summary.total == summary.skipped + summary.done + summary.remaining == 3  # was 2 lines of which 1 to go
    summary = run_batch(decoder, source, out, max_new_tokens=3, model="tiny")
    assert (summary.skipped, summary.done, summary.complete) == (2, 1, True)
    assert sorted(by_id(records(out))) == ["doc-0", "doc-1", "doc-2"]


@pytest.mark.parametrize("text", ['[{"document": "a", "questions": ["why?"]},\n {"document": "b"}]\n',
                                  "document,question\nthe cable,why?\n"])
def test_an_input_no_line_of_which_can_be_read_is_the_jobs_mistake(model_dir, tmp_path, text):
    """A JSON array (or a CSV) given as input: the model loaded, every line failed, and the job said
    "Done" with exit 0."""
    source = tmp_path / "in.jsonl"
    source.write_text(text)
    result = run(source, "-o", tmp_path / "out.jsonl", "--model", model_dir, "-q", "why?")
    assert result.exit_code == 2 and "can be read as a job's line (line 1:" in result.stderr, result.output
    assert "one element per line" in result.stderr and not (tmp_path / "out.jsonl").exists()
