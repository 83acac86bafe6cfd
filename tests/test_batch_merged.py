"""Merged forests in the batch job: several documents' questions in the same forwards, exactly.

The oracle is `MultiDecoder.ask` on each line alone (itself tested against transformers' generate):
a merged run must give every line the same tokens, greedy and seeded-sampled, on every
architecture. The admission loop (`answer_merged`) is tested without a model, as data.
"""

from __future__ import annotations

import functools
import json
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from local_models import tiny_tokenizer
from pacers import FixedPacer
from tiny_models import ARCHITECTURES, EOS, MAIN_ARCHITECTURES

from multidecode import MultiDecoder, memory
from multidecode.batch import BatchSettings, merged, open_batch, parse_line, total_stats
from multidecode.batch.merged import ForestAnswerer, LineOutcome, answer_merged
from multidecode.runtime import Admission, Limits, Reservation, TooLarge

WORDS = ["router", "cable", "ticket", "fiber", "modem", "signal", "storm", "light"]


@functools.cache
def decoder_for(arch: str) -> MultiDecoder:
    """A tiny random `arch` model with the tiny chat tokenizer (its vocabulary sized to it)."""
    tokenizer = tiny_tokenizer()
    config, cls = ARCHITECTURES[arch]()
    config.vocab_size = len(tokenizer)
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    model = cls(config).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    return MultiDecoder(model, tokenizer)


def lines(n: int) -> list:
    """n parsed input lines, of different lengths and 1 to 3 questions each."""
    rows = [{"id": f"doc-{i}", "document": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + 4 * (i % 3))),
             "questions": ["what failed?", "when?", "who called?"][: 1 + i % 3]} for i in range(n)]
    return [parse_line(json.dumps(row).encode(), i + 1) for i, row in enumerate(rows)]


def answers_of(outcomes) -> dict:
    return {o.item.line: [list(a.token_ids) for a in o.answers] for o in outcomes}


@pytest.mark.parametrize("arch", MAIN_ARCHITECTURES)
def test_merged_lines_equal_each_line_asked_alone(arch):
    decoder, items = decoder_for(arch), lines(6)
    settings = BatchSettings(max_new_tokens=6)
    with ForestAnswerer(decoder, settings) as answerer:
        outcomes = list(answer_merged(answerer, items))
        counters = answerer.runtime.counters
    assert all(o.error is None for o in outcomes) and len(outcomes) == 6
    got = answers_of(outcomes)
    alone = {item.line: [list(a.token_ids) for a in decoder.ask(item.document, list(item.questions),
                                                                 max_new_tokens=6)] for item in items}
    assert got == alone
    # they did share forwards: far fewer steps than the lines' own steps added up
    assert counters.steps < sum(o.answers[0].stats["steps"] for o in outcomes)


def test_documents_read_in_pieces_give_the_same_answers():
    """--prefill-chunk: a document is fed a few tokens a step while other lines decode; the
    answers are those of documents fed whole."""
    decoder, items = decoder_for("llama"), lines(6)
    settings = BatchSettings(max_new_tokens=24)  # the first line decodes long enough for the others to arrive

    def arriving(answerer):
        """The first line, then the others once the runtime has stepped: they arrive while it
        decodes (all at once, they could all be read whole in the first step, no stream beside)."""
        yield items[0]
        while not answerer.runtime.pacer.recent:
            time.sleep(0.001)
        yield from items[1:]

    with ForestAnswerer(decoder, settings, prefill_chunk=4) as answerer:
        answerer.runtime.pacer = FixedPacer(4, 4)  # pieces of 4 tokens, whatever a step costs here
        pieces = answers_of(answer_merged(answerer, arriving(answerer)))
        steps = list(answerer.runtime.pacer.recent)
    with ForestAnswerer(decoder, settings) as answerer:
        whole = answers_of(answer_merged(answerer, items))
    assert pieces == whole
    assert any(s.streams and 0 < s.prompt_tokens <= 4 for s in steps)  # a document read in pieces beside a line


def test_seeded_sampling_is_the_same_merged_or_alone():
    decoder, items = decoder_for("llama"), lines(5)
    sampling = {"do_sample": True, "temperature": 1.3, "top_k": 50, "seed": 11}
    settings = BatchSettings(max_new_tokens=8, sampling=sampling)
    with ForestAnswerer(decoder, settings) as answerer:
        merged = answers_of(answer_merged(answerer, items))
    with ForestAnswerer(decoder, settings, forest_tokens=0) as answerer:
        one_by_one = answers_of(answer_merged(answerer, items))
    alone = {item.line: [list(a.token_ids) for a in decoder.ask(item.document, list(item.questions),
                                                                 max_new_tokens=8, **sampling)] for item in items}
    assert merged == one_by_one == alone
    assert len({tuple(a) for answers in alone.values() for a in answers}) > 5  # it did sample


def test_a_line_past_the_machines_memory_fails_in_the_batch_jobs_words(monkeypatch):
    """The runtime's admission refuses a line that needs more bytes than the machine has, even
    alone; its error names the line and the job's knobs, not a server's."""
    monkeypatch.setenv(memory.ENVIRONMENT, "1000")  # bytes: less than any line needs
    decoder, items = decoder_for("llama"), lines(2)
    with ForestAnswerer(decoder, BatchSettings(max_new_tokens=4)) as answerer:
        outcomes = list(answer_merged(answerer, items))
    assert len(outcomes) == 2 and all(isinstance(o.error, TooLarge) for o in outcomes)
    error = outcomes[0].error
    assert error.message.startswith("the line needs about") and "this job may use" in error.message
    assert "--max-new-tokens" in error.hint and "server" not in str(error) and "max_tokens" not in str(error)


def test_a_merged_job_writes_the_same_records_as_one_line_at_a_time(tmp_path):
    decoder = decoder_for("qwen2")
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i.id, "document": i.document, "questions": list(i.questions)}) + "\n"
                              for i in lines(7)))
    settings = BatchSettings(max_new_tokens=5, model="tiny")

    forwards = {}  # forest_tokens -> (the forests' forwards, each line's summed)

    def run(out, forest_tokens):
        with open_batch(source, out, settings) as job:
            results = list(job.run(decoder, forest_tokens=forest_tokens))
            assert job.summary().complete
            forwards[forest_tokens] = (job.summary().forward_passes, total_stats(r.stats for r in results)["forward_passes"])
        return {r["id"]: {k: v for k, v in r.items() if k != "elapsed_s"}
                for r in map(json.loads, out.read_text().splitlines())}

    assert run(tmp_path / "merged.jsonl", 4096) == run(tmp_path / "one.jsonl", 0)
    # a forward counts once, however many lines it carried (--stats summed the lines' own)
    assert forwards[0][0] == forwards[0][1] and 0 < forwards[4096][0] < forwards[4096][1] / 2, forwards


def test_stop_lets_the_lines_in_flight_finish_and_a_rerun_completes(tmp_path):
    decoder = decoder_for("llama")
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i.id, "document": i.document, "questions": list(i.questions)}) + "\n"
                              for i in lines(8)))
    out, settings = tmp_path / "out.jsonl", BatchSettings(max_new_tokens=4, model="tiny")
    with open_batch(source, out, settings) as job:
        first = None
        for result in job.run(decoder, forest_tokens=600):
            first = first or result
            job.stop()
        summary = job.summary()
    assert first.ok and 1 <= summary.done < 8 and summary.done + summary.remaining == 8
    with open_batch(source, out, settings) as job:
        assert len(job.pending) == summary.remaining
        for _ in job.run(decoder):
            pass
        assert job.summary().complete
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"doc-{i}" for i in range(8))


# ---------------------------------------------------------------------- the admission loop, as data
class FakeAnswerer:
    """`prepare`/`submit` without a model, admitted by the runtime's own `Admission` under the
    batch job's limits: line i reserves tokens[i] and one question; a line finishes only when the
    loop would otherwise wait (the oldest first). Records the tokens in flight at each submit."""

    def __init__(self, tokens: dict[int, int], budget: int, branches: int) -> None:
        self.tokens = tokens
        self.in_flight: dict[int, Future] = {}
        self.peaks: list[int] = []
        self.prepared: list[int] = []
        limits = Limits(max_live_tokens=budget, max_branches=branches, oversized_runs_alone=True)
        self.admission = Admission(limits, budget_bytes=1 << 40)

    def prepare(self, item):
        self.prepared.append(item.line)
        if item.error is not None:
            return LineOutcome(item, error=item.error)
        return SimpleNamespace(item=item, need=Reservation(self.tokens[item.line], 1, 0))

    def submit(self, ticket, *, wait: bool = False) -> Future | None:
        if self.admission.refusal(ticket.need) is not None:
            assert not wait, "nothing in flight, and still no room"
            return None
        self.admission.hold(ticket.need)
        future: Future = Future()
        self.in_flight[ticket.item.line] = future
        self.peaks.append(sum(self.tokens[line] for line in self.in_flight))
        return future

    def finish_oldest(self) -> None:
        line = next(iter(self.in_flight))
        self.admission.release(Reservation(self.tokens[line], 1, 0))
        self.in_flight.pop(line).set_result(LineOutcome(parse_line(b'{"document": "d", "questions": ["q"]}', line)))


def drive(monkeypatch, tokens: dict[int, int], budget: int, *, bad=(), stop_after: int | None = None,
          branches: int = 1000):
    """Run `answer_merged` over lines of `tokens` with a fake answerer; returns (lines in the
    order they came back, the fake)."""
    fake = FakeAnswerer(tokens, budget, branches)
    real_wait = merged.wait

    def wait(futures, return_when):
        if not any(f.done() for f in futures):
            fake.finish_oldest()
        return real_wait(futures, return_when=return_when)

    monkeypatch.setattr(merged, "wait", wait)
    items = [parse_line(b"[]" if line in bad else b'{"document": "d", "questions": ["q"]}', line) for line in tokens]
    stopped, out = [False], []
    for outcome in answer_merged(fake, items, stopping=lambda: stopped[0]):
        out.append(outcome.item.line)
        stopped[0] = stop_after is not None and len(out) >= stop_after
    return out, fake


def test_admission_keeps_in_flight_tokens_under_the_budget(monkeypatch):
    done, fake = drive(monkeypatch, {line: 100 for line in range(1, 11)}, 250)
    assert sorted(done) == list(range(1, 11))
    assert max(fake.peaks) == 200  # two lines of 100 at a time, never three


def test_a_line_over_the_budget_runs_alone_and_budget_zero_is_one_at_a_time(monkeypatch):
    done, fake = drive(monkeypatch, {1: 50, 2: 900, 3: 50}, 300)
    assert sorted(done) == [1, 2, 3] and max(fake.peaks) == 900
    done, fake = drive(monkeypatch, {line: 10 for line in range(1, 6)}, 0)
    assert sorted(done) == [1, 2, 3, 4, 5] and max(fake.peaks) == 10


def test_the_questions_in_flight_are_capped_too(monkeypatch):
    done, fake = drive(monkeypatch, {line: 10 for line in range(1, 9)}, 10_000, branches=3)
    assert sorted(done) == list(range(1, 9)) and max(fake.peaks) == 30  # one question each: 3 lines


def test_bad_lines_come_back_at_once_and_stop_starts_nothing_new(monkeypatch):
    done, fake = drive(monkeypatch, {line: 100 for line in range(1, 7)}, 1000, bad=(2,))
    assert done[0] == 2 and sorted(done) == list(range(1, 7))  # recorded before any line finishes
    done, fake = drive(monkeypatch, {line: 100 for line in range(1, 21)}, 300, stop_after=1)
    assert len(done) == 3 and len(fake.prepared) == 4  # the 3 in flight finish; lines are read lazily
