"""Benchmark: the OpenAI-compatible server under load, a case per cell of the grid (concurrency x
shared share) and the arrival of a long prompt, the servers in subprocesses (docs/benchmarks.md, `bench serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

from .. import data
from ..errors import InvalidArgument, check_positive
from ..prompts import common_prefix_length
from ..runtime import Limits
from ..serving.client import StreamedRequest, drive, openai_module, stream_completion
from ..serving.launch import ServerFailed, ServerProcess, stopped_on_sigterm
from .common import RunOutput, Say, ratio, spread
from .harness import OUTSIDE_TORCH, Benchmark, Case, Method, Plot, Target, Unavailable, run
from .results import CHARTS, Chart, Column, Line, Panel, Table

FOREST, ONE, HF = "forest", "one_at_a_time", "transformers"
PIECES, WHOLE = "prompt_in_pieces", "prompt_whole"
LABELS = {
    FOREST: ("multidecode serve (one forest)", "forest"),
    ONE: ("multidecode serve, one request at a time (max_running=1)", "one at a time"),
    HF: ("transformers serve", "transformers serve"),
    PIECES: ("multidecode serve, a long prompt read in pieces (its default --prefill-chunk)", "arrival in pieces"),
    WHOLE: ("multidecode serve, a long prompt read whole (--prefill-chunk 0)", "arrival whole"),
}
TEXTS = ("water_board_meeting.txt", "support_call.txt")
"""The texts the prompts are cut from, read as one stream of words."""
SERVED_NAME = "bench-model"
THROUGHPUT_TARGET, TTFT_TARGET, GAP_TARGET = 5.0, 2.0, 2.0
PERCENTILES = (50, 95, 99)
METRICS = ("prompt_tokens", "prompt_tokens_cached", "generation_tokens", "steps", "forward_passes", "rows",
           "branch_steps", "busy_seconds", "requests_admitted", "requests_rejected", "requests_cancelled")
"""The server's counters diffed around a run (multidecode_<name>_total in /metrics)."""
GRID = {"requests": 32, "concurrency": (1, 4, 16), "shared": (0.0, 0.5, 0.9), "max_tokens": 32, "prompt_tokens": 300,
        "arrival_tokens": 4000}
"""The full grid's load, then an `arrival_tokens`-token prompt's arrival (0: none); --quick runs `QUICK`."""
QUICK = {"requests": 6, "concurrency": (1, 4), "shared": (0.0, 0.9), "max_tokens": 8, "prompt_tokens": 120,
         "arrival_tokens": 0}
ARRIVAL = {"streams": 8, "stream_tokens": 128, "after_tokens": 16, "max_tokens": 8}
"""The arrival case: once each stream has `after_tokens`, the long prompt arrives and asks for `max_tokens`."""


@dataclass(frozen=True)
class Cell:
    """One point of the grid: its load, the same for every server."""

    concurrency: int
    shared: float
    prompts: tuple[str, ...]
    arrivals: tuple[float, ...]  # seconds after the cell's start
    prompt_tokens: tuple[int, ...]  # each prompt's ids, as the server tokenizes it
    shared_tokens: int  # the ids every prompt of the cell starts with

    def first(self, n: int) -> Cell:
        """The same load cut to its first `n` requests."""
        return Cell(self.concurrency, self.shared, self.prompts[:n], self.arrivals[:n], self.prompt_tokens[:n],
                    self.shared_tokens)


class WordStream:
    """The shipped texts as one circular stream of words with their token counts, to cut prompts from."""

    def __init__(self, tokenizer, texts: Sequence[str] = TEXTS) -> None:
        self.words = [w for name in texts for w in data.text(name).split()]
        counts = {w: max(1, len(tokenizer(" " + w, add_special_tokens=False)["input_ids"])) for w in set(self.words)}
        self.tokens = [counts[w] for w in self.words]

    def take(self, start: int, tokens: int) -> list[str]:
        """Words from `start` on (wrapping around) until they make at least `tokens` tokens."""
        out, got, i = [], 0, start
        while got < tokens:
            out.append(self.words[i % len(self.words)])
            got += self.tokens[i % len(self.words)]
            i += 1
        return out


def build_cells(tokenizer, *, requests: int, concurrency: Sequence[int], shared: Sequence[float], rate: float,
                prompt_tokens: int, seed: int) -> list[Cell]:
    """The grid's loads, from `seed` alone: every prompt (and cell's shared head) at its own word offset."""
    stream = WordStream(tokenizer)
    grid = [(c, s) for c in concurrency for s in shared]
    starts_needed = sum(requests + (s > 0) for _, s in grid)
    if starts_needed > len(stream.words):
        raise InvalidArgument(f"{starts_needed} distinct prompts asked for; the shipped text has only "
                              f"{len(stream.words)} starting words", "ask for fewer --requests or a smaller grid")
    starts = iter(random.Random(seed).sample(range(len(stream.words)), starts_needed))
    cells = []
    for c, s in grid:
        head_tokens = round(s * prompt_tokens)
        head = stream.take(next(starts), head_tokens) if head_tokens else []
        texts = [" ".join(head + stream.take(next(starts), max(1, prompt_tokens - head_tokens)))
                 for _ in range(requests)]
        ids = [list(tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts]
        gaps = random.Random(f"{seed}:{c}:{s}")
        arrivals = accumulate((gaps.expovariate(rate) if math.isfinite(rate) else 0.0 for _ in texts[1:]), initial=0.0)
        shared_tokens = common_prefix_length(ids) if len(ids) > 1 else 0
        cells.append(Cell(c, s, tuple(texts), tuple(arrivals), tuple(map(len, ids)), shared_tokens))
    return cells


@dataclass(frozen=True)
class Arrival:
    """The arrival case's load: the streams' prompts and the long prompt (its ids as the server counts them)."""

    streams: tuple[str, ...]
    prompt: str
    prompt_tokens: int


def build_arrival(tokenizer, *, prompt_tokens: int, arrival_tokens: int, seed: int) -> Arrival:
    """The arrival case's prompts, from `seed` alone, each from its own word offset."""
    stream = WordStream(tokenizer)
    starts = random.Random(f"{seed}:arrival").sample(range(len(stream.words)), ARRIVAL["streams"] + 1)
    texts = [" ".join(stream.take(start, prompt_tokens)) for start in starts[:-1]]
    prompt = " ".join(stream.take(starts[-1], arrival_tokens))
    return Arrival(tuple(texts), prompt, len(tokenizer(prompt, add_special_tokens=True)["input_ids"]))


def drive_cell(url: str, model: str, cell: Cell, max_tokens: int, timeout_s: float) -> tuple[list, float]:
    """Send the cell's requests at their arrival times, at most `cell.concurrency` in flight."""
    async def send_all(client, start: float) -> list[StreamedRequest]:
        slots, outcomes = asyncio.Semaphore(cell.concurrency), [StreamedRequest(i, a) for i, a in enumerate(cell.arrivals)]

        async def send(outcome: StreamedRequest) -> None:
            await asyncio.sleep(max(0.0, start + outcome.arrival - time.perf_counter()))
            async with slots:
                await stream_completion(client, model, cell.prompts[outcome.index], outcome, max_tokens)

        await asyncio.gather(*map(send, outcomes))
        return outcomes

    return drive(url, timeout_s, send_all)


def drive_arrival(url: str, model: str, load: Arrival, timeout_s: float) -> tuple[list, float]:
    """Start the streams; once each has `ARRIVAL["after_tokens"]` tokens (or ended), send the long prompt."""
    async def send_all(client, start: float) -> list[StreamedRequest]:
        streams = [StreamedRequest(i, 0.0) for i in range(len(load.streams))]
        running = [asyncio.create_task(stream_completion(client, model, text, outcome, ARRIVAL["stream_tokens"]))
                   for text, outcome in zip(load.streams, streams)]
        while not all(len(o.token_times) >= ARRIVAL["after_tokens"] or o.end for o in streams):
            await asyncio.sleep(0.005)
        arrival = StreamedRequest(len(streams), time.perf_counter() - start)
        await stream_completion(client, model, load.prompt, arrival, ARRIVAL["max_tokens"])
        await asyncio.gather(*running)
        return [*streams, arrival]

    return drive(url, timeout_s, send_all)


def arrival_figures(outcomes: Sequence[StreamedRequest]) -> dict:
    """What the long prompt (the last outcome) did to the streams' gaps while it was read, and its own TTFT."""
    *streams, arrival = outcomes
    read_until = arrival.token_times[0] if arrival.token_times else arrival.end
    gaps = [(a, b) for o in streams for a, b in zip(o.token_times, o.token_times[1:])]
    pace = [b - a for a, b in gaps if b < arrival.sent]
    during = [b - a for a, b in gaps if a < read_until and b > arrival.sent]
    pace_s = statistics.median(pace) if pace else None
    while_read = percentiles(during)
    return {"pace_s": pace_s, "itl_while_read_s": while_read, "longest_gap_s": max(during, default=None),
            "itl_p99_over_pace": while_read["p99"] / pace_s if while_read and pace_s else None,
            "arrival_ttft_s": read_until - arrival.sent if arrival.token_times else None}


def percentiles(values: Sequence[float]) -> dict | None:
    """p50/p95/p99 (linear interpolation) and the mean of `values`, in seconds; None if empty."""
    if not values:
        return None
    cuts = statistics.quantiles(list(values) * (2 if len(values) == 1 else 1), n=100, method="inclusive")
    return {**{f"p{q}": cuts[q - 1] for q in PERCENTILES}, "mean": statistics.fmean(values), "n": len(values)}


def cell_figures(outcomes: Sequence[StreamedRequest], start: float) -> dict:
    """A cell's latency percentiles and throughput from its requests (`start`: when arrivals count
    from); client_wait_s: how long requests waited for a slot."""
    done = [o for o in outcomes if o.error is None and o.token_times]
    errors = [o.error or "no token streamed" for o in outcomes if o not in done]
    span = (max(o.end for o in done) - min(o.sent for o in outcomes)) if done else 0.0
    tokens = sum(o.tokens for o in done)
    return {
        "completed": len(done), "errors": len(errors), "error_examples": sorted(set(errors))[:3],
        "output_tokens": tokens, "span_s": span,
        "requests_per_s": len(done) / span if span else None,
        "output_tokens_per_s": tokens / span if span else None,
        "ttft_s": percentiles([o.token_times[0] - o.sent for o in done]),
        "itl_s": percentiles([b - a for o in done for a, b in zip(o.token_times, o.token_times[1:])]),
        "tpot_s": percentiles([(o.end - o.token_times[0]) / (o.tokens - 1) for o in done if o.tokens > 1]),
        "e2e_s": percentiles([o.end - o.sent for o in done]),
        "client_wait_s": percentiles([o.sent - start - o.arrival for o in done]),
        "usage_cached_tokens": sum(o.cached_tokens or 0 for o in done) if any(
            o.cached_tokens is not None for o in done) else None,
    }


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """The counters' change over a cell, and the ratios the benchmark reports."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRICS}

    def over(a: float, b: float) -> float | None:
        return a / b if b else None

    return {"counters": {k: (round(v, 4) if k == "busy_seconds" else int(v)) for k, v in d.items()},
            "cache_hit_rate": over(d["prompt_tokens_cached"], d["prompt_tokens"]),
            "computed_share": over(d["prompt_tokens"] - d["prompt_tokens_cached"], d["prompt_tokens"]),
            "branches_per_forward": over(d["branch_steps"], d["forward_passes"]),
            "rows_per_forward": over(d["rows"], d["forward_passes"]),
            "busy_seconds": d["busy_seconds"], "ms_per_step": over(1000 * d["busy_seconds"], d["steps"])}


def model_folder(model: str | None) -> tuple[str, dict]:
    """The local folder (and loading kwargs) of `model`, the embedded model's float32 copy by default."""
    from ..models import converted, loading

    return (str(converted.embedded_copy()), {}) if model is None else loading.locate(model)


def warm_up(server: ServerProcess, max_tokens: int, gather: int = 1) -> None:
    """Two short requests one after the other, then two at once (a server that gathers: `gather` at once, twice)."""
    prompts = ("Warm-up: the quick brown fox", "Warm-up, again: a lazy dog")
    if gather > 1:
        prompts = tuple(prompts[i % 2] + f" ({i})" for i in range(gather))
    for concurrency in (1, 2) if gather <= 1 else (gather, gather):
        cell = Cell(concurrency, 0.0, prompts, (0.0,) * len(prompts), (0,) * len(prompts), 0)
        failed = [o.error for o in drive_cell(server.url, server.model, cell, min(max_tokens, 4), 600.0)[0] if o.error]
        if failed:
            raise ServerFailed(f"the {server.name} server failed a warm-up request: {failed[0]}; {server.log_tail()}")


def load_run(server: ServerProcess, send: Callable[[str, str], tuple[list[StreamedRequest], float]], *,
             texts: dict, more: Callable[[list[StreamedRequest]], dict] | None = None) -> RunOutput:
    """One load `send(url, model)` against `server`, as a run: the client's figures (and the server's
    counters, and what `more` adds); every request's text (None: failed) kept in `texts[server.name]`."""
    server.alive()
    counted = server.name != HF  # transformers serve has no counters
    before = server.metrics() if counted else None
    outcomes, start = send(server.url, server.model)
    figures = {"requests": len(outcomes), **cell_figures(outcomes, start), **(more(outcomes) if more else {})}
    forwards = None
    if counted:
        after = server.metrics()
        m = figures["server_metrics"] = metrics_delta(before, after)
        m["cache_slots_at_end"] = int(after.get("cache_slots", 0))
        m["busy_share"] = m["busy_seconds"] / figures["span_s"] if figures["span_s"] else None
        forwards = m["counters"]["forward_passes"]
    texts[server.name] = [o.text if o.error is None else None for o in outcomes]
    return RunOutput([], 0, forward_passes=forwards, extra={**figures, "texts": texts[server.name][:2]},
                     seconds=figures["span_s"] or None, new_tokens=figures["output_tokens"])


@dataclass
class Servers:
    """The servers the cases run against, started as they need them: a fresh multidecode pair per
    cell, transformers serve once for the grid's corners (kept in `kept` to the end of the run)."""

    model: str | None
    launched: dict  # how the multidecode servers start
    limits: dict  # their admission limits
    max_tokens: int
    timeout_s: float
    gather_s: float
    transformers_cb: bool
    kept: contextlib.ExitStack
    running: dict = field(default_factory=dict)  # server name -> the process the current case drives
    texts: dict = field(default_factory=dict)  # server name -> its texts in the current case
    ready_s: list = field(default_factory=list)  # seconds each multidecode server took to be ready
    transformers_failed: str | None = None

    def multidecode(self, name: str, **options) -> ServerProcess:
        """`multidecode serve` as `launched` says (float32: the texts are compared), with the limits."""
        return ServerProcess.multidecode(
            name, SERVED_NAME, model=self.model, log_level="warning", drain_timeout=10, dtype=self.launched["dtype"],
            device=self.launched["device"], threads=self.launched["threads"], **self.limits, **options)

    @contextlib.contextmanager
    def started(self, servers: dict[str, ServerProcess], gather: int = 1, timed: bool = True):
        """`servers` loading at once, each then ready and warmed up, run by the case in the block
        (`timed`: their seconds to ready kept in `ready_s`)."""
        with contextlib.ExitStack() as stack:
            for server in servers.values():
                stack.enter_context(server)
            for server in servers.values():
                ready_s = server.wait_ready()
                if timed:
                    self.ready_s.append(ready_s)
                warm_up(server, self.max_tokens, gather)
            self.running = servers
            yield

    def pair(self, cell: Cell):
        """A forest and a one-at-a-time server for `cell` (gathering its requests where `gather_s`)."""
        gather = cell.concurrency if self.gather_s > 0 else 1
        options = {"gather": gather, "gather_s": self.gather_s} if gather > 1 else {}
        return self.started({FOREST: self.multidecode(FOREST, **options),
                             ONE: self.multidecode(ONE, max_running=1, **options)}, gather)

    def arrival_pair(self):
        """A server that reads a long prompt in pieces (its default) and one that reads it whole."""
        return self.started({PIECES: self.multidecode(PIECES), WHOLE: self.multidecode(WHOLE, prefill_chunk=0)})

    @contextlib.contextmanager
    def transformers(self):
        """transformers serve, started for the first corner and kept; `Unavailable` where it fails."""
        if self.transformers_failed is None and HF not in self.running:
            try:
                folder, kwargs = model_folder(self.model)
                if kwargs:
                    raise ServerFailed("transformers serve takes a model folder here, not a .gguf file")
                server = ServerProcess.transformers(HF, folder, continuous_batching=self.transformers_cb)
                self.kept.enter_context(self.started({HF: server}, timed=False))
            except ServerFailed as error:
                self.transformers_failed = str(error)[:600]
        if self.transformers_failed is not None:
            raise Unavailable(self.transformers_failed)
        yield

    def run(self, name: str, cell: Cell) -> RunOutput:
        return load_run(self.running[name], lambda url, model: drive_cell(url, model, cell, self.max_tokens,
                                                                          self.timeout_s), texts=self.texts)

    def run_arrival(self, name: str, load: Arrival) -> RunOutput:
        return load_run(self.running[name], lambda url, model: drive_arrival(url, model, load, self.timeout_s),
                        texts=self.texts, more=lambda outcomes: {"arrival": arrival_figures(outcomes)})

    def same_texts(self, name: str, other: str, key: str) -> dict:
        """Whether `name`'s texts equal `other`'s, request by request (failed ones left out)."""
        pairs = [(a, b) for a, b in zip(self.texts[name], self.texts[other]) if a is not None and b is not None]
        return {key: {name: all(a == b for a, b in pairs)}, "differing_texts": {name: sum(a != b for a, b in pairs)}}

    def compared(self, cell: Cell, order: Sequence[str], got: dict) -> dict:
        """A multidecode cell's load, which server went first, and whether the forest's texts are one at a time's."""
        load = {"concurrency": cell.concurrency, "shared": cell.shared, "shared_tokens": cell.shared_tokens,
                "prompt_tokens": spread(cell.prompt_tokens), "arrivals_span_s": round(cell.arrivals[-1], 3),
                "first_prompt": cell.prompts[0][:200] + "..."}
        return {"load": load, "measured_first": order[0], **self.same_texts(FOREST, ONE, "identical_to_one_at_a_time")}

    def compared_arrival(self, load: Arrival, got: dict) -> dict:
        """The arrival case's load, what the long prompt did, and whether read in pieces it gave the same texts."""
        return {"load": {"streams": len(load.streams), "stream_tokens": ARRIVAL["stream_tokens"],
                         "arrival_prompt_tokens": load.prompt_tokens, "first_prompt": load.prompt[:200] + "..."},
                "arrival": {name: got[name].extra["arrival"] for name in (PIECES, WHOLE) if name in got},
                **self.same_texts(PIECES, WHOLE, "identical_to_whole")}


def serve_benchmark(*, model: str | None = None, requests: int = 32, concurrency: Sequence[int] = (1, 4, 16),
                    shared: Sequence[float] = (0.0, 0.5, 0.9), rate: float = 8.0, max_tokens: int = 32,
                    prompt_tokens: int = 300, seed: int = 0, threads: int | None = None, transformers: bool = True,
                    transformers_requests: int = 8, transformers_cb: bool = False,
                    max_live_tokens: int = Limits.max_live_tokens,
                    prefix_cache_tokens: int = Limits.prefix_cache_tokens, gather_s: float = 0.0,
                    arrival_tokens: int = 0, timeout_s: float = 600.0, kept: contextlib.ExitStack) -> Benchmark:
    """Every cell of the grid against fresh servers, as data (model: a folder or .gguf file, None: the
    embedded model); transformers serve on the grid's corners, kept running in `kept`."""
    _check(requests=requests, concurrency=concurrency, shared=shared, rate=rate, max_tokens=max_tokens,
           prompt_tokens=prompt_tokens, gather_s=gather_s, arrival_tokens=arrival_tokens)
    openai_module()
    launched = _launched(model, threads)
    folder, kwargs = model_folder(model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    cells = build_cells(tokenizer, requests=requests, concurrency=concurrency, shared=shared,
                        rate=rate, prompt_tokens=prompt_tokens, seed=seed)
    servers = Servers(model, launched, {"max_live_tokens": max_live_tokens, "prefix_cache_tokens": prefix_cache_tokens},
                      max_tokens, timeout_s, gather_s, transformers_cb, kept)
    hf_label, hf_short = LABELS[HF]
    labels = {**LABELS, HF: (hf_label + " --continuous-batching" * transformers_cb, hf_short
                             + (f" ({transformers_requests} requests)" if transformers_requests != requests else ""))}

    def case(cell: Cell, order: Sequence[str], context) -> Case:
        methods = tuple(Method.named(labels, name, run=lambda counter, name=name: servers.run(name, cell),
                                     model=OUTSIDE_TORCH) for name in order)
        multidecode = HF not in order
        return Case({"concurrency": cell.concurrency, "shared": cell.shared}, methods, budget_s=None, context=context,
                    targets=_targets(cell) if multidecode and cell.concurrency == max(concurrency) else (),
                    report=functools.partial(servers.compared, cell, order) if multidecode else None)

    cases = [case(cell, (FOREST, ONE) if i % 2 == 0 else (ONE, FOREST), functools.partial(servers.pair, cell))
             for i, cell in enumerate(cells)]  # alternate: no server always first
    corners = [c for c in cells if c.concurrency in (min(concurrency), max(concurrency))
               and c.shared in (min(shared), max(shared))] if transformers else []
    cases += [case(c.first(transformers_requests), (HF,), servers.transformers) for c in corners]
    if arrival_tokens:
        load = build_arrival(tokenizer, prompt_tokens=prompt_tokens, arrival_tokens=arrival_tokens, seed=seed)
        cases.append(_arrival_case(servers, labels, load))
    what = (f"{requests} requests a cell, ~{prompt_tokens}-token prompts, {max_tokens} tokens each, Poisson arrivals "
            f"at {rate if math.isfinite(rate) else 'inf'}/s")
    return Benchmark(
        name="serve", title="the OpenAI-compatible server under load", model=None, machine=launched,
        cases=tuple(cases), reference=None, repeats=1, columns=(), rows_key="cells", plot=Plot("sweep", (), "concurrency"),
        config={"requests": requests, "transformers_requests": transformers_requests if transformers else None,
                "transformers_continuous_batching": transformers_cb if transformers else None,
                "server_threads": threads, "concurrency": list(concurrency), "shared": list(shared),
                "rate_per_s": rate if math.isfinite(rate) else "inf", "max_tokens": max_tokens,
                "prompt_tokens": prompt_tokens, "seed": seed, "temperature": 0, "endpoint": "/v1/completions",
                "stream": True, "max_live_tokens": max_live_tokens, "prefix_cache_tokens": prefix_cache_tokens,
                "gather_s": gather_s, "arrival_tokens": arrival_tokens, "arrival": ARRIVAL if arrival_tokens else None,
                "client": "openai.AsyncOpenAI (max_retries=0), in the benchmark's process; servers in subprocesses"},
        tables=_tables(what, arrival=bool(arrival_tokens)),
        summary=functools.partial(_compare_cells, servers, {(c.concurrency, c.shared): c.arrivals for c in cells}),
    )


def run_serve_benchmark(*, progress: Say | None = None, **settings) -> dict:
    """`serve_benchmark(**settings)` measured, every server stopped on the way out; `ServerFailed` where one fails."""
    with contextlib.ExitStack() as kept, stopped_on_sigterm():
        (progress or (lambda message: None))("building the load")
        return run(serve_benchmark(**settings, kept=kept), progress=progress)


def _arrival_case(servers: Servers, labels: dict, load: Arrival) -> Case:
    """The arrival case: the streams' gaps while the long prompt is read within `GAP_TARGET` times their pace."""
    methods = tuple(Method.named(labels, name, run=lambda counter, name=name: servers.run_arrival(name, load),
                                 model=OUTSIDE_TORCH) for name in (PIECES, WHOLE))
    target = Target(f"the {len(load.streams)} streams' inter-token p99 while a {load.prompt_tokens:,}-token prompt "
                    "is read, over their median gap before it", ("arrival", PIECES, "itl_p99_over_pace"), "<=",
                    GAP_TARGET)
    return Case({"concurrency": len(load.streams) + 1, "shared": 0.0}, methods, budget_s=None,
                context=servers.arrival_pair, targets=(target,),
                report=functools.partial(servers.compared_arrival, load))


def _targets(cell: Cell) -> tuple[Target, ...]:
    """The forest's throughput over one at a time (binding at 16 in flight, 90% shared) and its p50 TTFT over solo."""
    where = f"at concurrency {cell.concurrency}, {cell.shared:.0%} shared"
    main = abs(cell.shared - 0.9) < 1e-9 and cell.concurrency == 16
    throughput = Target(f"output tokens/s {where}, over one at a time" + ("" if main else
                        " (the target is set for 90% shared)"), ("throughput_vs_one_at_a_time", FOREST), ">=",
                        THROUGHPUT_TARGET, binding=main)
    ttft = Target(f"p50 TTFT {where}, over solo (concurrency 1)", ("ttft_p50_vs_solo", FOREST), "<=", TTFT_TARGET,
                  binding=cell.concurrency == 16)
    return (throughput, ttft) if cell.concurrency > 1 else (throughput,)


def served(result: dict) -> dict[tuple, tuple[dict, dict]]:
    """(server, concurrency, shared) -> (what the server's run saw, its case's row), over every row."""
    return {(name, row["concurrency"], row["shared"]): (m["extra"], row)
            for row in result["cells"] for name, m in row["methods"].items()}


def _p50_ttft(figures: dict | None) -> float | None:
    return figures["ttft_s"]["p50"] if figures and figures["ttft_s"] else None


def _compare_cells(servers: Servers, arrivals: dict[tuple, Sequence[float]], result: dict) -> dict:
    """Each server's throughput and p50 TTFT over one at a time and over its own solo, and the forest's
    `queued_ttft` over solo, added to the rows; the servers' start times."""
    found = served(result)
    for (name, concurrency, share), (figures, row) in found.items():
        one = found.get((ONE, concurrency, share), (None,))[0]
        solo = found.get((name, 1, share), (None,))[0]
        ratios = {"ttft_p50_vs_solo": ratio(_p50_ttft(figures), _p50_ttft(solo))}
        if name != ONE and one is not None:
            ratios |= {"throughput_vs_one_at_a_time": ratio(figures["output_tokens_per_s"], one["output_tokens_per_s"]),
                       "ttft_p50_vs_one_at_a_time": ratio(_p50_ttft(figures), _p50_ttft(one))}
        for key, value in ratios.items():
            if value is not None:
                row.setdefault(key, {})[name] = value
        if name == FOREST and concurrency > 1 and _p50_ttft(solo):
            cold = found.get((name, 1, 0.0), (None,))[0]  # a whole prompt read: the head's first read
            in_turn = statistics.median(queued_ttft(arrivals[concurrency, share], _p50_ttft(solo), _p50_ttft(cold)))
            row.setdefault("ttft_p50_in_turn_vs_solo", {})[name] = in_turn / _p50_ttft(solo)
    ready = servers.ready_s
    return {"multidecode_ready_s": {"min": round(min(ready), 1), "max": round(max(ready), 1)}} if ready else {}


def queued_ttft(arrivals: Sequence[float], read_s: float, first_s: float | None = None) -> list[float]:
    """Each request's TTFT from a server that only reads prompts in turn, each in `read_s` (the first in
    `first_s`, default `read_s`): what queueing alone costs at this load."""
    free, waits = 0.0, []
    for i, at in enumerate(arrivals):
        free = max(free, at) + (first_s if i == 0 and first_s is not None else read_s)
        waits.append(free - at)
    return waits


def _launched(model: str | None, threads: int | None) -> dict:
    """How the multidecode servers start: float32 (their texts are compared), the default device, the threads."""
    import torch

    from ..models.loading import resolve_device

    return {"model": Path(model or model_folder(None)[0]).name, "dtype": "float32",
            "device": str(resolve_device(None)), "threads": threads or torch.get_num_threads()}


def _check(*, requests, concurrency, shared, rate, max_tokens, prompt_tokens, gather_s=0.0, arrival_tokens=0) -> None:
    for name, value in (("requests", requests), ("max_tokens", max_tokens), ("prompt_tokens", prompt_tokens)):
        check_positive(name, value)
    for ok, problem, hint in (
            (prompt_tokens >= 4, f"prompt_tokens must be at least 4, got {prompt_tokens}", "use 100 or more"),
            (concurrency and min(concurrency) >= 1, f"concurrency levels must be 1 or more, got {list(concurrency)}",
             "e.g. 1,4,16"),
            (shared and all(0 <= s < 1 for s in shared), f"shared shares must be in [0, 1), got {list(shared)}",
             "e.g. 0,0.5,0.9"),
            (rate > 0, f"the arrival rate must be positive, got {rate}", "e.g. 8 (requests per second) or inf"),
            (gather_s >= 0, f"gather_s must be 0 or more, got {gather_s}", "e.g. 0 (off) or 30"),
            (arrival_tokens >= 0, f"arrival_tokens must be 0 or more, got {arrival_tokens}", "e.g. 4000, or 0 (no arrival)")):
        if not ok:
            raise InvalidArgument(problem, hint)


def _tables(what: str, *, arrival: bool = False) -> tuple[Table, ...]:
    """Throughput and latencies, a row per cell and server; with the arrival case, what the long prompt did."""
    lead = (Column("shared", "shared", "{:.0%}"), Column("concurrency", "concurrency"), Column("server", "label"))
    throughput = (
        Column("requests/s", "extra.requests_per_s", "{:.2f}"), Column("output tok/s", "extra.output_tokens_per_s", "{:.1f}"),
        Column("over one at a time", "throughput_vs_one_at_a_time.{name}", "{:.2f}x"),
        Column("cache hit", "extra.server_metrics.cache_hit_rate", "{:.0%}"),
        Column("branches/forward", "extra.server_metrics.branches_per_forward", "{:.2f}"),
        Column("ms/step", "extra.server_metrics.ms_per_step", "{:.0f}"),
        Column("same text", "identical_to_one_at_a_time.{name}", "yes/no"), Column("errors", "extra.errors"))
    latency = tuple(Column(f"{name} p{q}", f"extra.{key}.p{q}", "{:.0f}", 1000)
                    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("TPOT", "tpot_s"), ("e2e", "e2e_s"))
                    for q in PERCENTILES) + (Column("p50 TTFT over solo", "ttft_p50_vs_solo.{name}", "{:.2f}x"),
                                            Column("read in turn at solo speed", "ttft_p50_in_turn_vs_solo.{name}", "{:.2f}x"))
    grid = tuple(Table(title, lead + columns, rows="methods", lead=3, sort=("shared", "concurrency"))
                 for title, columns in ((f"Throughput ({what})", throughput), ("Latency (ms)", latency)))
    gaps = (Column("server", "label"), Column("streams' median gap before it", "pace_s", "{:.0f}", 1000),
            Column("gap p99 while it is read", "itl_while_read_s.p99", "{:.0f}", 1000),
            Column("over the median before", "itl_p99_over_pace", "{:.2f}x"),
            Column("longest gap", "longest_gap_s", "{:.0f}", 1000), Column("its TTFT", "arrival_ttft_s", "{:.0f}", 1000),
            Column("same text", "identical_to_whole.{name}", "yes/no"))
    stretched = Table(f"A long prompt arriving among {ARRIVAL['streams']} streams (ms)", gaps, rows="arrival")
    return grid + (stretched,) * arrival


def chart(result: dict) -> Chart:
    """Output tokens/s, its ratio over one at a time, and p50 TTFT against concurrency: a colour per
    share, a line style per server, the targets as reference lines."""
    found, cfg, short = served(result), result["config"], result["layout"]["short"]
    shares = sorted({share for _, _, share in found})
    colors = dict(zip(shares, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")))
    styles = {FOREST: ("o", "-"), ONE: ("s", "--"), HF: ("^", ":")}

    def lines(value, servers=tuple(styles), notes: str | None = None) -> list[Line]:
        out = []
        for server in servers:
            for share in shares:
                points = [(c, v) for (name, c, s), (figures, row) in sorted(found.items(), key=lambda f: f[0][1])
                          if name == server and s == share and (v := value(name, figures, row)) is not None]
                style = {"marker": styles[server][0], "ls": styles[server][1], "color": colors[share]}
                if points:
                    out.append(Line(f"{short[server]}, {share:.0%} shared", points, style,
                                    [notes.format(v) for _, v in points] if notes else None))
        return out

    def ttft(name, figures, row) -> float | None:
        return 1000 * figures["ttft_s"]["p50"] if figures["ttft_s"] else None

    solo = {s: ms for (name, c, s), (figures, row) in found.items() if name == FOREST and c == 1
            and (ms := ttft(name, figures, row)) is not None}
    ttft_targets = [(TTFT_TARGET * ms, {"color": colors[share], "ls": "-.", "alpha": 0.7,
                                        "label": f"{TTFT_TARGET:g}x solo TTFT, {share:.0%} shared (target)"})
                    for share, ms in solo.items()]
    return Chart([
        Panel("output tokens/s", lines(lambda name, figures, row: figures["output_tokens_per_s"])),
        Panel("output tokens/s over one at a time",
              lines(lambda name, figures, row: row.get("throughput_vs_one_at_a_time", {}).get(name), (FOREST, HF),
                    "{:.1f}x"),
              [(1.0, {"color": "grey", "ls": "--"}), (THROUGHPUT_TARGET, {
                  "color": "tab:red", "ls": ":", "label": f"target {THROUGHPUT_TARGET:g}x (c=16, 90% shared)"})]),
        Panel("p50 TTFT (ms, log)", lines(ttft), ttft_targets, log_y=True),
    ], sorted({c for name, c, _ in found if name in styles}), "concurrency (requests in flight)", legend="figure",
        title=f"{result['title']}: {cfg['requests']} requests a cell, ~{cfg['prompt_tokens']}-token prompts, "
              f"{cfg['max_tokens']} new tokens, Poisson {cfg['rate_per_s']}/s")


CHARTS["serve"] = chart
