"""The learned cost curve: a prior before any timing, a probe held to its budget, forwards that teach
it, a file that keeps what every run learned, and a stored curve that is not trusted blindly.

No wall-clock assertions: timings are fed in (or a fake clock runs the probe); what is checked
is what `auto` decides from them."""

from __future__ import annotations

import json

import pytest
import torch
from byte_tokenizer import ByteTokenizer
from hash_lm import HashLM
from tiny_models import tiny_model

from multidecode import MultiDecoder, cost
from multidecode.api import start_forest
from multidecode.cost import (
    CPU_PRIOR,
    PROBE_BUDGET_S,
    CostCurve,
    LearnedCurve,
    choose_draft_count,
    class_prior,
    cost_curve,
    fit_table,
    non_decreasing,
    probe_cost,
    probe_due,
)
from multidecode.engine import Engine, time_forwards
from multidecode.sampling_params import SamplingParams

CHANCES = [0.9, 0.6, 0.3, 0.2, 0.1, 0.1, 0.1]
"""A draft whose first guesses are good and whose tail is not: how much of it pays depends on the curve."""


@pytest.fixture
def costs(tmp_path, monkeypatch):
    """A folder of its own for the curves, and none in memory from earlier tests."""
    monkeypatch.setattr(cost, "_CURVES", {})
    monkeypatch.setenv("MULTIDECODE_COSTS", str(tmp_path))
    return tmp_path


def drafts(curve, context: int = 300) -> int:
    return choose_draft_count(curve, required=1, expected=1, chances=CHANCES, context=context)


# ---------------------------------------------------------------------- before any timing
def test_a_prior_decides_before_anything_is_timed(costs):
    """With no probe at all (a budget of 0), the curve exists and the first step decides from the
    machine class's prior, without a single forward."""
    model = HashLM()
    curve = cost_curve(model, budget_s=0)
    assert model.calls == 0 and not curve.complete and probe_due(model)
    assert drafts(curve) == drafts(CostCurve.from_relative(CPU_PRIOR)) == 2
    gpu = LearnedCurve("gpu", class_prior(torch.device("cuda")))
    assert drafts(gpu) == len(CHANCES)  # where rows cost next to nothing, every draft rides along


# ---------------------------------------------------------------------- timings change the decisions
def test_timed_forwards_change_the_budget_the_way_they_should():
    """Today's measured curve says 8 rows cost 1.82x one: 2 drafts pay. Forwards of 8 rows timed at
    the cost of one: auto drafts more; at 8 times one: it drafts nothing."""
    measured = CostCurve.from_relative(CPU_PRIOR)
    flat, steep = (LearnedCurve("k", class_prior(torch.device("cpu"))) for _ in range(2))
    for _ in range(3):
        for q in range(1, 9):
            flat.record(q, 300, 0.02)
            steep.record(q, 300, 0.02 * q)
    assert drafts(flat) == len(CHANCES) > drafts(measured) == 2 > drafts(steep) == 0
    # the shape timed at 300 cached tokens holds at other lengths too, until they are timed
    assert drafts(flat, context=3000) == len(CHANCES) and drafts(steep, context=40) == 0


def test_a_few_wild_timings_do_not_move_the_curve():
    """Medians: a cell's outliers (a stall, a busy neighbour) leave its estimate alone."""
    curve = LearnedCurve("k", class_prior(torch.device("cpu")))
    for i in range(12):
        curve.record(1, 300, 0.02)
        curve.record(4, 300, 2.0 if i % 4 == 0 else 0.02)  # every fourth one stalls
    assert curve.relative(4, 300) == pytest.approx(1.0, abs=0.02)  # the stalls' mean would say 17x
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]  # a dip is averaged, not a spike carried


def test_a_cell_timed_too_rarely_borrows_its_shape():
    """One timing of 8 rows at a new length does not override the shape timed elsewhere: the row's
    and the length's effects (median polish) decide until the cell has its own few timings."""
    prior = class_prior(torch.device("cpu"))
    cells = {}
    curve = LearnedCurve("k", prior, cells)
    for _ in range(3):
        for q in (1, 8):
            curve.record(q, 100, 0.02)  # flat at 100 cached tokens
        curve.record(1, 2000, 0.04)  # one row costs twice as much at 2,000
    curve.record(8, 2000, 1.0)  # one wild timing there
    assert curve.relative(8, 2000) == pytest.approx(1.0, abs=0.02)  # the wild one alone would say 50x
    untimed = fit_table(prior, {})  # no timing at all: the prior
    assert [untimed.time(q, 500) for q in (1, 5, 64)] == pytest.approx([prior.time(q, 500) for q in (1, 5, 64)])


# ---------------------------------------------------------------------- the engine teaches it
def test_the_engine_reports_each_forward_but_its_first_and_only_to_its_recorder():
    model = HashLM()
    seen = []
    time_forwards(model, lambda rows, cached, seconds: seen.append((rows, cached, seconds > 0)))
    try:
        engine = Engine(model)
        head = engine.feed_chain([5, 6, 7]).nodes[-1]  # the first forward: a warm-up, not reported
        engine.feed([8, 9], [head, head])
        engine.feed([10], [head])
    finally:
        assert time_forwards(model, None) is not None
    assert seen == [(2, 3, True), (1, 5, True)]
    Engine(model).feed_chain([1, 2])
    Engine(model).feed_chain([1, 2])
    assert len(seen) == 2  # no recorder: nothing timed


def test_what_one_run_learns_the_next_one_reads(costs):
    """A run over the model teaches the curve from its own forwards; saved (as at exit, or every
    `SAVE_EVERY` timings), a second decoder in another process reads it back."""
    model = HashLM()
    run = start_forest(model, [3, 4, 5, 6] * 40, [[7], [8]], max_new_tokens=12, speculate="auto",
                       sampling=[SamplingParams()] * 2)
    run.finish()
    first = cost._CURVES[cost.model_key(model)]
    probed = cost.cell_of(1, cost.PROBE_CONTEXT)[1]
    assert first.pending and all(c != probed for (_, c), _ in first.pending)  # timed over 160 tokens and more
    first.save()
    cost._CURVES.clear()  # the next process
    second = cost_curve(model, measure=False)
    assert second == first and second is not first
    assert second.time(3, 40) == first.time(3, 40)


def test_two_processes_learning_at_once_keep_both(costs):
    model = HashLM()
    first = cost_curve(model, budget_s=0)
    cost._CURVES.clear()
    second = cost_curve(model, budget_s=0)
    first.record(2, 500, 0.03)
    second.record(3, 2000, 0.05)
    first.save()
    second.save()
    cost._CURVES.clear()
    kept = cost_curve(model, measure=False)
    assert {cost.cell_of(2, 500), cost.cell_of(3, 2000)} <= set(kept.cells)


# ---------------------------------------------------------------------- the probe
class SlowLM(HashLM):
    """A HashLM whose forwards take (fake) time: 10 ms plus 2 ms a row."""

    def __init__(self, clock) -> None:
        super().__init__()
        self.clock = clock

    def forward(self, input_ids, position_ids=None, **kwargs):
        self.clock.now += 0.01 + 0.002 * input_ids.shape[1]
        return super().forward(input_ids, position_ids, **kwargs)


class FakeClock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_probe_keeps_to_its_budget_and_later_runs_finish_it():
    clock = FakeClock()
    model = SlowLM(clock)
    curve = LearnedCurve("k", class_prior(torch.device("cpu")))
    runs = 0
    while not curve.complete:
        taken = probe_cost(curve, model, PROBE_BUDGET_S, clock=clock)
        assert 0 < taken <= PROBE_BUDGET_S
        runs += 1
    assert runs > 1 and sum(curve.probed.values()) == 36
    # the probe's timings: 8 rows cost 26 ms, one 12 ms
    assert curve.relative(8, cost.PROBE_CONTEXT) == pytest.approx(0.026 / 0.012, rel=0.02)
    assert probe_cost(curve, model, PROBE_BUDGET_S, clock=clock) == 0  # complete: nothing more to time


def test_a_machine_too_slow_to_probe_in_time_is_not_probed():
    clock = FakeClock()
    model = SlowLM(clock)
    curve = LearnedCurve("k", class_prior(torch.device("cpu")))
    probe_cost(curve, model, 0.1, clock=clock)  # one row takes 12 ms: a prefill would not fit in 0.1 s
    assert not curve.probed and clock.now < 0.1


# ---------------------------------------------------------------------- what is kept on disk
def stored_files(key: str) -> dict[str, str]:
    """Files that must not be trusted: corrupt ones and stale ones."""
    kept = LearnedCurve(key, class_prior(torch.device("cpu")), {(0, 2): [1.0]}, {1: 1}).as_dict()
    return {
        "not json": "{half a file",
        "today's measured table": json.dumps(CostCurve.from_relative({1: 1.0, 8: 1.2}).as_dict() | {"key": key}),
        "another model's": json.dumps(kept | {"key": "another"}),
        "another format": json.dumps(kept | {"format": 1}),
        "a bin we do not keep": json.dumps(kept | {"cells": [[5, 128, [1.0]]]}),
        "a timing that is not one": json.dumps(kept | {"cells": [[1, 128, [float("nan")]]]}),
        "a count past any number": json.dumps(kept).replace('"probed": {"1": 1}', '"probed": {"1": 1e400}'),
        "a prior that is not a table": json.dumps(kept | {"prior": {"sizes": [1, 1], "contexts": [0],
                                                                     "seconds": [[1.0, 1.0]]}}),
    }


@pytest.mark.parametrize("what", list(stored_files("key")))
def test_corrupt_and_stale_curves_are_rebuilt_not_trusted(costs, what):
    model = HashLM()
    key = cost.model_key(model)
    path = costs / f"{key}.json"
    path.write_text(stored_files(key)[what], encoding="utf-8")
    assert cost_curve(model, measure=False) is None and probe_due(model)
    rebuilt = cost_curve(model)
    assert rebuilt.complete  # probed afresh
    assert cost.read_curve(path, key) == rebuilt  # and written over the bad file


# ---------------------------------------------------------------------- the benchmark
def test_bench_speculate_compares_auto_on_the_learned_and_the_measured_curve():
    from multidecode.bench.speculate import OURS_AUTO, OURS_AUTO_MEASURED, OURS_AUTO_QUICK, run_speculate_benchmark

    settings = {"names": ["story"], "max_new_tokens": 4, "repeats": 1, "warmup": False, "compare_cost": True}
    result = run_speculate_benchmark(MultiDecoder(tiny_model("llama"), ByteTokenizer()), **settings)
    assert result["answers_identical"] is True
    (row,) = result["workloads"]
    assert list(row["methods"])[-2:] == [OURS_AUTO_MEASURED, OURS_AUTO_QUICK]
    assert row["methods"][OURS_AUTO_QUICK]["extra"]["curve_s"] >= 0
    assert row[f"{OURS_AUTO}_vs"][OURS_AUTO_MEASURED]["speedup"] > 0
    assert row[f"{OURS_AUTO_QUICK}_vs"][OURS_AUTO_MEASURED]["speedup"] > 0
    assert result["config"]["full_measurement_s"] > 0
    assert [t["name"] for t in result["targets"]][-2:] == [
        "story: MD auto no worse than on a full measurement",
        "story: MD auto quick no worse than on a full measurement"]
