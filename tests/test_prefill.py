"""Prefill in pieces: a long prompt is fed between decode steps within a per-step token budget.

A piece is a forest feed like any other (a chain under the previous piece's last node), so a
request prefilled in pieces gets exactly the logits, hence the tokens, of one prefilled whole,
greedy or seeded sampling, alone or beside other streams; and while a prompt is read, every
stream already decoding still gets a token in every step. All of it is counted in tokens per
step, never in wall time. The prefix cache offers a prompt only as far as it is fed.
"""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch
from click.testing import CliRunner
from pacers import FixedPacer
from tiny_models import NO_EOS, tiny_model

from multidecode import exact
from multidecode.branches import admit
from multidecode.cli import main
from multidecode.runtime import ForestRuntime, Job, Limits
from multidecode.runtime.pacing import MIN_PIECE, PACE_EVERY, PacedStep, PrefillPacer
from multidecode.sampling_params import SamplingParams
from multidecode.scheduler import new_scheduler

GREEDY = SamplingParams()
SEEDED = SamplingParams(do_sample=True, temperature=0.9, top_k=40, seed=11)
PIECE = 8


@pytest.fixture(scope="module")
def model():
    """The tiny llama on the exact kernels, with an eos it never produces (nothing stops early)."""
    model = copy.deepcopy(tiny_model("llama"))
    exact.use_exact_kernels(model)
    model.generation_config.eos_token_id = NO_EOS
    return model


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 250) for _ in range(n)]


def kept_logits(group) -> list[torch.Tensor]:
    """Record the logits of every step the group settles (a piece of its prompt has none)."""
    rows, settle = [], group.settle

    def settle_and_keep(fed, result):
        if result.logits.numel():
            rows.append(result.logits.clone())
        return settle(fed, result)

    group.settle = settle_and_keep
    return rows


def decode_beside(model, budget: int | None, sampling: SamplingParams, others: int) -> tuple[list, list, list]:
    """A group of two prompts (a 70-token shared prefix) decoded 6 tokens, its prompts fed within
    `budget` tokens a step (None: whole), beside `others` single-prompt groups already decoding:
    its logits per step, its tokens per branch, and the others' tokens."""
    scheduler = new_scheduler(model)
    streams = [admit(scheduler, tokens(10 + i, 12), [[]], max_new_tokens=30, sampling=[GREEDY]) for i in range(others)]
    if others:
        scheduler.step()
    prefix = tokens(1, 70)
    run = admit(scheduler, prefix, [tokens(2, 5), tokens(3, 3)], max_new_tokens=6, sampling=[sampling] * 2)
    rows, pieces = kept_logits(run.group), 0
    while not run.group.done:
        emitted = [len(s.branches[0].output.token_ids) for s in streams]
        fed = run.group.pace_prompt(budget)
        pieces += not run.group.started and fed > 0
        scheduler.step()
        if budget is not None and not run.group.started:
            assert fed <= budget
        assert [len(s.branches[0].output.token_ids) for s in streams] == [n + 1 for n in emitted]  # a token each
    if budget is not None:
        assert pieces == -(-(len(prefix) - 1) // budget) + 1  # pieces of the prefix, then the rest
    return rows, [b.output.token_ids for b in run.branches], [s.branches[0].output.token_ids for s in streams]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("others", [0, 3], ids=["alone", "beside-streams"])
def test_a_prompt_fed_in_pieces_gives_the_logits_of_one_fed_whole(model, sampling, others):
    whole_rows, whole_tokens, whole_others = decode_beside(model, None, sampling, others)
    rows, got, got_others = decode_beside(model, PIECE, sampling, others)
    assert got == whole_tokens
    assert [o[: len(w)] for o, w in zip(got_others, whole_others)] == whole_others  # more steps ran, the same tokens
    assert len(rows) == len(whole_rows) == 6
    assert all(torch.equal(a, b) for a, b in zip(rows, whole_rows))  # bit for bit


def test_the_pacer_budget_follows_what_steps_cost():
    pacer = PrefillPacer(512, 1.5)
    assert pacer.budget(0) is None  # nobody decoding: prompts whole
    assert pacer.budget(3) == 512  # nothing measured yet
    for _ in range(10):
        pacer.record(PacedStep(3, 0, 512, seconds=0.1))
    for i in range(PACE_EVERY):
        assert pacer.budget(3) > 0
        pacer.record(PacedStep(3, 40, 40, seconds=0.1 + 40 * 0.001))
    assert pacer.budget(3) == 0 and pacer.finish_budget(3) == 0  # streams alone for a step: their pace measured again as the cache grows
    pacer.record(PacedStep(3, 0, 0, seconds=0.1))
    assert pacer.pace_s == pytest.approx(0.1) and pacer.token_s == pytest.approx(0.001)
    assert pacer.budget(3) == 50  # (1.5 - 1) x 0.1 s / 1 ms a token
    assert pacer.budget(3, prefilling=6) == 200  # six wait for a first token, three for a next: (1 + 6/3 - 1) x 100
    assert pacer.finish_budget(3) == 200  # a step that finishes prompts: (2 x 1.5 - 1) x 100
    assert pacer.finish_budget(3, prefilling=6) == 500  # (2 x 3 - 1) x 100, the chunk's 512 above it
    assert pacer.finish_budget(0) is None and PrefillPacer(64, 0).finish_budget(2) == 64  # as the budget, unadapted
    for _ in range(30):
        pacer.record(PacedStep(3, 40, 40, seconds=0.1 + 40 * 0.1))
        pacer.record(PacedStep(3, 0, 0, seconds=0.1))
    assert pacer.budget(3) == MIN_PIECE  # costly tokens: the fewest, never none
    assert pacer.finish_budget(3) >= MIN_PIECE
    assert PrefillPacer(64, 0).budget(2) == 64 and PrefillPacer(0, 1.5).budget(2) is None
    cheap = PrefillPacer(256, 2.0)
    cheap.record(PacedStep(1, 0, 256, seconds=0.05))
    cheap.record(PacedStep(1, 100, 100, seconds=0.0501))
    assert cheap.budget(1) == 256  # a cheap token: the chunk caps it


# ---------------------------------------------------------------------- in the runtime
class Recorder:
    """A job's sink that notes the step (the runtime's step count) each token came in."""

    def __init__(self, forest: ForestRuntime, on_token=None, on_trace=None) -> None:
        self.forest, self.on_token, self.on_trace = forest, on_token, on_trace
        self.items, self.token_steps, self.traces = [], [], []
        self.done = threading.Event()

    def __call__(self, item: tuple) -> None:
        self.items.append(item)
        if item[0] == "token":
            self.token_steps.append(self.forest.counters.steps)
            if self.on_token:
                self.on_token(len(self.token_steps))
        elif item[0] == "trace":
            self.traces.append(item[1])
            if self.on_trace:
                self.on_trace(len(self.traces))
        else:
            self.done.set()

    @property
    def events(self) -> list:
        return [(e.token_id, e.logprob, e.top_logprobs) for kind, e in self.items if kind == "token"]


def wait_idle(forest: ForestRuntime) -> None:
    deadline = time.monotonic() + 60
    while (forest.busy or forest.scheduler.works) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not forest.busy


def serve_arrival(model, limits: Limits, sampling: SamplingParams, prompt: list[int]) -> tuple[ForestRuntime, list, Recorder]:
    """Three streams decoding; once the first has 2 tokens, `prompt` arrives (6 new tokens, with
    log-probabilities). Returns the runtime, the streams' sinks and the arrival's."""
    forest, streams, (arrival,) = serve_arrivals(model, limits, sampling, [prompt])
    return forest, streams, arrival


def serve_arrivals(model, limits: Limits, sampling: SamplingParams, prompts: list[list[int]],
                   pacer: PrefillPacer | None = None) -> tuple[ForestRuntime, list, list]:
    """Three streams decoding; once the first has 2 tokens, `prompts` arrive together, admitted in
    their order (6 new tokens each, with log-probabilities), the runtime paced by `pacer` if given.
    Returns the runtime, the streams' sinks and the arrivals'."""
    forest = ForestRuntime(model, None, limits=limits)
    forest.pacer = pacer or forest.pacer
    arrivals = [Recorder(forest) for _ in prompts]
    jobs = [Job(prompts=[prompt], max_new_tokens=6, sampling=[sampling], logprobs=3, sink=sink)
            for prompt, sink in zip(prompts, arrivals)]

    def arrive(count: int) -> None:
        if count == 2:
            for job in jobs:
                forest.submit(job)

    streams = [Recorder(forest, arrive if i == 0 else None) for i in range(3)]
    for i, sink in enumerate(streams):
        forest.submit(Job(prompts=[tokens(20 + i, 10)], max_new_tokens=24, sampling=[GREEDY], sink=sink))
    forest.start()
    try:
        for arrival in arrivals:
            assert arrival.done.wait(60)
        wait_idle(forest)
    finally:
        forest.stop()
    return forest, streams, arrivals


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_long_arrival_is_read_in_pieces_and_every_stream_keeps_its_pace(model, sampling):
    prompt = tokens(5, 100)
    forest, streams, arrival = serve_arrival(model, Limits(prefill_chunk=PIECE, prefill_stretch=0), sampling, prompt)
    whole, whole_streams, whole_arrival = serve_arrival(model, Limits(prefill_chunk=0), sampling, prompt)
    assert arrival.items[-1][0] == "done" and len(arrival.events) == 6
    assert arrival.events == whole_arrival.events  # tokens and log-probabilities, exactly
    assert [s.events for s in streams] == [s.events for s in whole_streams]
    # the prompt came in pieces of at most the budget, each beside the three streams ...
    read = [(s.streams, s.prompt_tokens, s.budget) for s in forest.pacer.recent if s.prompt_tokens]
    assert read[0] == (0, 30, None)  # the streams' own prompts, together, before anyone decoded
    assert read[1:] == [(3, PIECE, PIECE)] * 12 + [(3, 4, PIECE)]  # 99 of 100 tokens in pieces, then the rest
    assert [(s.streams, s.prompt_tokens) for s in whole.pacer.recent if s.prompt_tokens][1:] == [(3, 100)]
    # ... and every stream got a token in every step from its first to its last
    for sink in streams:
        assert sink.token_steps == list(range(sink.token_steps[0], sink.token_steps[0] + 24))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prompt_that_fits_the_finish_budget_goes_whole_and_a_long_one_in_pieces(model, sampling):
    """A long prompt admitted first and a short one after it, beside three streams, with budgets of
    4 (pieces) and 12 (finishing): the short one is read whole in the first step, the long one
    in pieces of 4 until its rest fits 12, then whole; each gets exactly the tokens of prompts
    read whole, and every stream a token in every step."""
    long_prompt, short_prompt = tokens(5, 40), tokens(6, 10)
    forest, streams, arrivals = serve_arrivals(model, Limits(), sampling, [long_prompt, short_prompt],
                                               pacer=FixedPacer(4, 12))
    _, whole_streams, whole_arrivals = serve_arrivals(model, Limits(prefill_chunk=0), sampling,
                                                          [long_prompt, short_prompt])
    assert [a.events for a in arrivals] == [a.events for a in whole_arrivals]
    assert [s.events for s in streams] == [s.events for s in whole_streams]
    read = [s.prompt_tokens for s in forest.pacer.recent if s.prompt_tokens and s.streams]
    assert read == [10] + [4] * 7 + [12]  # the short prompt whole; 28 of the long one's 40 in pieces, its rest whole
    assert arrivals[1].token_steps[0] < arrivals[0].token_steps[0]  # the short one's first token came first
    for sink in streams:
        assert sink.token_steps == list(range(sink.token_steps[0], sink.token_steps[0] + 24))


def test_the_prefix_cache_offers_a_prompt_only_as_far_as_it_is_fed(model):
    """Beside a stream, a job cancelled after 3 pieces of its prompt leaves those cached, and only
    those: a second job with the same prompt hangs under them. A third, sent while the second
    still reads the rest, waits for it (it would compute any uncached token again), then finds it
    all cached. The answers agree."""
    prompt = tokens(6, 60)
    forest = ForestRuntime(model, None, limits=Limits(prefill_chunk=PIECE, prefill_stretch=0, defer_tokens=1))
    first, second, third = (Job(prompts=[prompt], max_new_tokens=4, sampling=[GREEDY], trace=True) for _ in range(3))

    def cancel_first(pieces: int) -> None:
        if pieces == 3:
            forest.cancel(first)
            forest.submit(second)

    first.sink = Recorder(forest, on_trace=cancel_first)
    second.sink = Recorder(forest, on_trace=lambda pieces: forest.submit(third) if pieces == 1 else None)
    third.sink = Recorder(forest)
    stream = Job(prompts=[tokens(30, 10)], max_new_tokens=60, sampling=[GREEDY])
    stream.sink = Recorder(forest, on_token=lambda n: forest.submit(first) if n == 1 else None)
    forest.submit(stream)
    forest.start()
    try:
        assert second.sink.done.wait(30) and third.sink.done.wait(30)
        wait_idle(forest)
    finally:
        forest.stop()
    assert first.finished and forest.counters.cancelled == 1 and not first.sink.done.is_set()
    assert [len(t["nodes"]) for t in first.sink.traces] == [PIECE] * 3  # three pieces, drawn as prompt nodes
    assert all(n[3] == "prompt" for t in first.sink.traces for n in t["nodes"])
    assert all(t["heads"] == [] for t in first.sink.traces)
    assert second.cached_tokens == 3 * PIECE  # it hung under the pieces fed, no further
    assert third.cached_tokens == len(prompt) - 1  # it waited for the second's pieces, then hit them all
    assert second.sink.events == third.sink.events
    assert forest.index.match(prompt)[0] == len(prompt)


def test_serve_refuses_prefill_settings_that_cannot_pace():
    for args, message in ((["--prefill-chunk", "-1"], "--prefill-chunk must be at least 0"),
                          (["--prefill-stretch", "0.5"], "--prefill-stretch must be over 1"),
                          # nan and inf passed the checks: the server started and every request was a 500
                          (["--prefill-stretch", "nan"], "--prefill-stretch must be a finite number"),
                          (["--prefill-stretch", "inf"], "--prefill-stretch must be a finite number"),
                          (["--gather-s", "nan"], "--gather-s must be a finite number"),
                          (["--drain-timeout", "nan"], "--drain-timeout must be a finite number"),
                          (["--drain-timeout", "-1"], "--drain-timeout must be a finite number")):
        result = CliRunner().invoke(main, ["serve", *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
