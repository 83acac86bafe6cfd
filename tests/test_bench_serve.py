"""`bench serve`: the load it builds (seeded, shared heads where asked, no prompt sharing across
cells), its percentiles and counters, and the command end to end on a tiny model: two servers in
subprocesses, a handful of streamed requests per cell, a report whose shape and numbers are sane."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from local_models import tiny_model_folder, tiny_tokenizer

from multidecode.bench.serve import (
    ARRIVAL,
    FOREST,
    ONE,
    PIECES,
    WHOLE,
    arrival_figures,
    build_cells,
    cell_figures,
    metrics_delta,
    percentiles,
    queued_ttft,
)
from multidecode.cli import main
from multidecode.serving.client import StreamedRequest


def test_the_load_is_seeded_and_shares_only_what_a_cell_shares():
    tokenizer = tiny_tokenizer()
    grid = dict(requests=5, concurrency=(1, 4), shared=(0.0, 0.5, 0.9), rate=8.0, prompt_tokens=60)
    cells = build_cells(tokenizer, seed=3, **grid)
    assert cells == build_cells(tokenizer, seed=3, **grid)
    assert cells != build_cells(tokenizer, seed=4, **grid)
    assert [(c.concurrency, c.shared) for c in cells] == [(1, 0.0), (1, 0.5), (1, 0.9), (4, 0.0), (4, 0.5), (4, 0.9)]
    for cell in cells:
        assert len(cell.prompts) == len(cell.arrivals) == len(cell.prompt_tokens) == 5
        assert len(set(cell.prompts)) == 5
        assert all(55 <= n <= 75 for n in cell.prompt_tokens)  # about 60 tokens (whole words)
        assert cell.arrivals[0] == 0 and list(cell.arrivals) == sorted(cell.arrivals) and cell.arrivals[-1] > 0
        if cell.shared == 0:
            assert cell.shared_tokens <= 2  # at most a chance first token or two
        else:
            assert cell.shared * 60 <= cell.shared_tokens < cell.shared * 60 + 10
    # every prompt starts its own way across cells (a cell's head counts once): no cell hits another's cache
    heads = {p[:20] for c in cells for p in (c.prompts if c.shared == 0 else c.prompts[:1])}
    assert len(heads) == sum(5 if c.shared == 0 else 1 for c in cells)
    everything = build_cells(tokenizer, seed=0, requests=4, concurrency=(1,), shared=(0.0,), rate=float("inf"),
                             prompt_tokens=20)[0]
    assert everything.arrivals == (0.0, 0.0, 0.0, 0.0)  # rate inf: all at once


def test_percentiles_and_counters():
    got = percentiles([float(i) for i in range(1, 101)])
    assert got["p50"] == pytest.approx(50.5) and got["p95"] == pytest.approx(95.05) and got["p99"] == pytest.approx(99.01)
    assert got["mean"] == pytest.approx(50.5) and got["n"] == 100 and percentiles([]) is None
    assert percentiles([0.2])["p99"] == 0.2
    before = {"prompt_tokens": 100, "prompt_tokens_cached": 10, "forward_passes": 5, "branch_steps": 5, "rows": 120}
    after = {"prompt_tokens": 500, "prompt_tokens_cached": 370, "forward_passes": 25, "branch_steps": 85, "rows": 500,
             "busy_seconds": 2.5}
    delta = metrics_delta(before, after)
    assert delta["cache_hit_rate"] == pytest.approx(0.9) and delta["computed_share"] == pytest.approx(0.1)
    assert delta["branches_per_forward"] == pytest.approx(4.0) and delta["rows_per_forward"] == pytest.approx(19.0)
    assert delta["counters"]["prompt_tokens"] == 400 and delta["busy_seconds"] == 2.5
    assert metrics_delta({}, {})["cache_hit_rate"] is None


def test_the_ttft_of_prompts_read_in_turn():
    """Prompts that arrive together wait for each other; spaced ones do not."""
    assert queued_ttft([0.0, 0.0, 0.0], 1.0) == [1.0, 2.0, 3.0]
    assert queued_ttft([0.0, 5.0, 5.5], 1.0) == [1.0, 1.0, 1.5]
    assert queued_ttft([0.0, 0.5, 5.0], 1.0, first_s=3.0) == [3.0, 3.5, 1.0]  # a new head read first


def test_summarize_a_worked_example():
    """Two requests arriving at 0 and 1 s; the second waits 0.5 s for a slot. TTFT from send, ITL
    the gaps between tokens, TPOT (e2e - TTFT) / (tokens - 1), throughput over first send to last end."""
    a = StreamedRequest(0, 0.0, sent=10.0, token_times=[10.2, 10.3, 10.5], end=10.6, completion_tokens=3)
    b = StreamedRequest(1, 1.0, sent=11.5, token_times=[11.9, 12.0], end=12.0, completion_tokens=2)
    failed = StreamedRequest(2, 1.0, sent=11.0, end=11.1, error="APIStatusError: 503")
    got = cell_figures([a, b, failed], start=10.0)
    assert got["completed"] == 2 and got["errors"] == 1 and got["error_examples"] == ["APIStatusError: 503"]
    assert got["ttft_s"]["p50"] == pytest.approx(0.3) and got["ttft_s"]["n"] == 2
    assert got["ttft_s"]["p95"] == pytest.approx(0.39) and got["ttft_s"]["p99"] == pytest.approx(0.398)
    assert got["itl_s"]["n"] == 3 and got["itl_s"]["mean"] == pytest.approx(0.4 / 3)
    assert got["tpot_s"]["mean"] == pytest.approx((0.2 + 0.1) / 2)  # (0.6-0.2)/2 and (0.5-0.4)/1
    assert got["e2e_s"]["mean"] == pytest.approx((0.6 + 0.5) / 2)
    assert got["client_wait_s"]["p99"] == pytest.approx(0.495) and got["client_wait_s"]["p50"] == pytest.approx(0.25)
    assert got["span_s"] == pytest.approx(2.0) and got["output_tokens"] == 5
    assert got["requests_per_s"] == pytest.approx(1.0) and got["output_tokens_per_s"] == pytest.approx(2.5)


@pytest.mark.slow
def test_bench_serve_command_measures_both_servers(tmp_path):
    model = tiny_model_folder(tmp_path / "model", max_positions=512)
    out = tmp_path / "out"
    # --gather-s: the tiny model answers a request in a few milliseconds, so on a loaded machine the
    # four requests sent at once could reach the engine one after another, each done before the next;
    # the servers wait for all four of a cell (30 s at most, never reached) before their first step
    args = ["bench", "serve", "--model", str(model), "--requests", "4", "--concurrency", "1,4", "--shared", "0,0.9",
            "--max-tokens", "8", "--prompt-tokens", "40", "--rate", "inf", "--gather-s", "30", "--no-transformers",
            "--arrival-tokens", "0",  # the grid only: the arrival case has its own test below
            "--output", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert sorted(p.name for p in out.iterdir()) == ["bench_serve.json", "bench_serve.md", "bench_serve.png"]
    stored = json.loads((out / "bench_serve.json").read_text())
    assert stored["benchmark"] == "serve" and stored["config"]["gather_s"] == 30
    assert not any("skipped" in cell for cell in stored["cells"])
    # a row per cell, a method per server: what its client saw in `extra`, its comparisons in the cell's row
    rows = {(server, cell["concurrency"], cell["shared"]): {**m["extra"], **{k: v[server] for k, v in cell.items()
                                                                         if isinstance(v, dict) and server in v}}
            for cell in stored["cells"] for server, m in cell["methods"].items()}
    assert sorted(rows) == sorted((s, c, f) for s in (FOREST, ONE) for c in (1, 4) for f in (0.0, 0.9))
    for (server, concurrency, shared), row in rows.items():
        assert row["completed"] == row["requests"] == 4 and row["errors"] == 0
        assert 4 <= row["output_tokens"] <= 32  # a random tiny model may stop at eos early
        assert row["requests_per_s"] > 0 and row["output_tokens_per_s"] > 0
        for figure in ("ttft_s", "e2e_s"):
            p = row[figure]
            assert 0 < p["p50"] <= p["p95"] <= p["p99"] and p["n"] == 4
        assert row["ttft_s"]["p50"] <= row["e2e_s"]["p99"]
        m = row["server_metrics"]
        assert m["counters"]["requests_admitted"] == 4 and m["counters"]["requests_rejected"] == 0
        assert m["counters"]["prompt_tokens"] >= 4 * 40
        if shared == 0.0:
            assert m["cache_hit_rate"] < 0.1
        else:  # the first request computes the head, the others find it cached
            assert 0.5 < m["cache_hit_rate"] < 0.9
        if server == ONE:
            assert m["branches_per_forward"] <= 1.0
    # all four requests arrive at once: the forest decodes them together, one at a time does not. (At
    # 90% shared the tiny model's answers are short, 11 decode steps in all, one of 7: how many forwards
    # the forest's prompts take (1 to 4, deferred and paced by what steps cost on a loaded machine) can
    # bring its branches per forward to 1, so there the count of forwards tells.)
    assert rows[(FOREST, 4, 0.0)]["server_metrics"]["branches_per_forward"] > 1.0
    for shared in (0.0, 0.9):
        forwards = {server: rows[(server, 4, shared)]["server_metrics"]["counters"]["forward_passes"]
                    for server in (FOREST, ONE)}
        assert forwards[FOREST] < forwards[ONE], forwards
        assert rows[(FOREST, 4, shared)]["identical_to_one_at_a_time"] is True
        assert rows[(FOREST, 1, shared)]["identical_to_one_at_a_time"] is True
        assert rows[(FOREST, 4, shared)]["throughput_vs_one_at_a_time"] > 0
        # four at once, read in turn: the median waits for the first read (a whole prompt's, as solo at
        # 0% shared: the head is new) and 1.5 reads at the cell's solo TTFT
        whole, solo = (rows[(FOREST, 1, share)]["ttft_s"]["p50"] for share in (0.0, shared))
        assert rows[(FOREST, 4, shared)]["ttft_p50_in_turn_vs_solo"] == pytest.approx((whole + 1.5 * solo) / solo)
    names = [t["name"] for t in stored["targets"]]
    assert len(names) == 4 and all("concurrency 4" in n for n in names)
    md = (out / "bench_serve.md").read_text()
    assert "**Throughput" in md and "**Latency (ms)**" in md and "TTFT p50" in md and "read in turn" in md and "**Targets**" in md
    assert "one at a time" in result.output and "wrote" in result.output


def test_arrival_figures_a_worked_example():
    """Two streams at a 0.1 s pace; the long prompt is sent at 1.0 s and gives its first token at
    1.6 s: the gaps that overlap that window are its figures, the earlier ones the pace."""
    times = [0.1 * i for i in range(11)] + [1.5, 1.6, 1.7]
    streams = [StreamedRequest(i, 0.0, token_times=[t + 0.01 * i for t in times]) for i in range(2)]
    arrival = StreamedRequest(2, 0.9, sent=1.0, token_times=[1.6, 1.65], end=1.7)
    got = arrival_figures([*streams, arrival])
    assert got["pace_s"] == pytest.approx(0.1) and got["arrival_ttft_s"] == pytest.approx(0.6)
    assert got["longest_gap_s"] == pytest.approx(0.5) and got["itl_while_read_s"]["n"] == 5  # 2 + 3 gaps
    assert got["itl_p99_over_pace"] == pytest.approx(got["itl_while_read_s"]["p99"] / 0.1)


@pytest.mark.slow
def test_bench_serve_arrival_case_reads_a_long_prompt_in_pieces_and_whole(tmp_path, monkeypatch):
    # The tiny model gives the 8 streams a token every ~2 ms: with 128 tokens each, a client held up for
    # 0.2 s (a loaded machine) saw every stream end before it sent the long prompt, so no gap overlapped
    # the read and the case had no figure. 400 tokens give it 3.4 times that slack (512 positions hold them).
    monkeypatch.setitem(ARRIVAL, "stream_tokens", 400)
    model = tiny_model_folder(tmp_path / "model", max_positions=512)
    out = tmp_path / "out"
    args = ["bench", "serve", "--model", str(model), "--requests", "1", "--concurrency", "1", "--shared", "0",
            "--max-tokens", "4", "--prompt-tokens", "40", "--arrival-tokens", "200", "--no-transformers",
            "--output", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (result.output, result.exception)
    stored = json.loads((out / "bench_serve.json").read_text())
    assert stored["config"]["arrival_tokens"] == 200 and stored["config"]["arrival"]["streams"] == 8
    (row,) = [cell for cell in stored["cells"] if "arrival" in cell]
    assert sorted(row["methods"]) == sorted((PIECES, WHOLE)) and row["concurrency"] == 9
    assert row["identical_to_whole"][PIECES] is True  # read in pieces or whole, the same texts
    assert 190 <= row["load"]["arrival_prompt_tokens"] <= 220
    for name in (PIECES, WHOLE):
        extra = row["methods"][name]["extra"]
        assert extra["requests"] == extra["completed"] == 9 and extra["errors"] == 0
        assert row["arrival"][name]["arrival_ttft_s"] > 0
    (target,) = [t for t in stored["targets"] if "prompt is read" in t["name"]]
    assert target["path"] == ["arrival", PIECES, "itl_p99_over_pace"]
    assert "A long prompt arriving among 8 streams" in (out / "bench_serve.md").read_text()


def test_bench_serve_refuses_bad_settings_before_starting_anything(tmp_path):
    for extra, message in ((["--shared", "0,1.5"], "--shared needs fractions"),
                           (["--concurrency", "0"], "--concurrency needs positive integers"),
                           (["--requests", "0"], "--requests must be 1 or more"),
                           (["--rate", "0"], "--rate must be positive"),
                           (["--gather-s", "-1"], "--gather-s must be 0 or more"),
                           (["--arrival-tokens", "-1"], "--arrival-tokens must be 0 or more")):
        result = CliRunner().invoke(main, ["bench", "serve", "--output", str(tmp_path), *extra])
        assert result.exit_code == 2 and message in result.output, (extra, result.output)
