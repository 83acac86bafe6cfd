"""Benchmark: the wait before the first token (docs/benchmarks.md, `bench startup`): importing,
loading the model, the first token and the whole command, cold (an empty user cache, as on the
first command after install) and warm, for MultiDecode and for llama.cpp on the same GGUF file;
warm, also the command sent to a resident `multidecode serve` (`generate --server`).

Every run is a fresh process, so nothing of one run helps the next but what stays on disk (the
user cache, and the operating system's file cache, which no run can empty without root)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from ..serving.launch import ServerProcess
from ..user_cache import cache_dir
from . import llamacpp
from .common import RunOutput, Say
from .harness import OUTSIDE_TORCH, Benchmark, Case, Method, Target, run
from .results import Column, Table

PROMPT = "What is the capital of France? Answer in one word."
MD, MD_COMMAND, MD_SERVED, LLAMA = "multidecode", "multidecode_command", "multidecode_served", "llama_cpp"
PROBES = {
    MD: """
import json, resource, sys, time
start = time.perf_counter()
import multidecode
import torch, transformers.modeling_utils  # what every load needs: `import multidecode` alone defers them
imported = time.perf_counter()
md = multidecode.load(sys.argv[1] or None)
loaded = time.perf_counter()
out = md.generate(sys.argv[2], max_new_tokens=1, speculate=None)
""",
    LLAMA: """
import json, resource, sys, time
start = time.perf_counter()
import llama_cpp
imported = time.perf_counter()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[3]), verbose=False)
loaded = time.perf_counter()
out = llm(sys.argv[2], max_tokens=1)
""",
}
"""What each method does in its process: import, load, one token; the timing lines follow. MultiDecode's
import counts torch and transformers' modeling too: the package imports them on first use, so its
own import is instant and a load would otherwise carry them."""
REPORT = """
first = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"import_s": imported - start, "load_s": loaded - imported, "first_token_s": first - loaded,
                  "peak_mb": peak}))
"""


def _process(argv: list[str], environment: dict) -> tuple[float, str]:
    """Run a command to its end: (seconds from start to exit, its stdout)."""
    start = time.perf_counter()
    done = subprocess.run(argv, check=False, env=environment, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr.strip()[-400:]}")
    return seconds, done.stdout


def _probe(name: str, path: str, threads: int, environment: Callable[[], dict]) -> RunOutput:
    """One process of `name`: its own times of import, load and first token, and the whole wall."""
    seconds, out = _process([sys.executable, "-c", PROBES[name] + REPORT, path, PROMPT, str(threads)], environment())
    figures = json.loads(out.strip().splitlines()[-1])
    return RunOutput([[1]], 0, forward_passes=1, extra={**figures, "process_s": seconds})


def _command(path: str, environment: Callable[[], dict], server: str | None = None) -> RunOutput:
    """`multidecode generate` as a user types it, to its exit (server: with `--server` that URL)."""
    argv = [sys.executable, "-m", "multidecode", "generate", "-p", PROMPT, "--max-new-tokens", "8"]
    argv += (["--model", path] if path else []) + (["--server", server] if server else [])
    seconds, _ = _process(argv, environment())
    return RunOutput([[1]], 0, forward_passes=1, extra={"process_s": seconds})


@contextmanager
def _fresh_cache():
    """An empty user cache but for the compiled kernels (setup builds those): the first command after install."""
    with tempfile.TemporaryDirectory(prefix="multidecode-cold-") as folder:
        kernels = cache_dir() / "kernels"
        if kernels.exists():
            os.symlink(kernels, Path(folder) / "kernels")
        yield folder


def startup_benchmark(path: str | None, *, threads: int = 2, repeats: int = 3, with_llama: bool = True) -> Benchmark:
    """Cold and warm starts of MultiDecode (the library, and the command) and llama.cpp on `path`
    (None: the embedded model, whose file llama.cpp reads)."""
    from ..models.converted import embedded_gguf
    from ..models.loading import gguf_file

    gguf = str(gguf_file(path) if path else embedded_gguf())  # refused here, before any process starts
    where = {"cache": None}

    def environment() -> dict:
        extra = {"MULTIDECODE_CACHE": where["cache"], "MULTIDECODE_COSTS": where["cache"]} if where["cache"] else {}
        return {**os.environ, "OMP_NUM_THREADS": str(threads), **extra}

    def cold(run):
        def each(counter):
            with _fresh_cache() as folder:
                where["cache"] = folder
                try:
                    return run(counter)
                finally:
                    where["cache"] = None
        return each

    skip = llamacpp.missing(with_llama, gguf)
    resident = ServerProcess.multidecode("resident", Path(gguf).stem, model=path, threads=threads)

    def methods(is_cold: bool) -> tuple[Method, ...]:
        wrap = cold if is_cold else (lambda run: run)
        return (Method(MD, "MultiDecode, load() and one token", short="MultiDecode", model=OUTSIDE_TORCH,
                       run=wrap(lambda counter: _probe(MD, path or "", threads, environment))),
                Method(MD_COMMAND, "multidecode generate, the whole command", short="command", model=OUTSIDE_TORCH,
                       run=wrap(lambda counter: _command(path or "", environment))),
                Method(LLAMA, "llama.cpp (llama-cpp-python), same GGUF", short="llama.cpp", model=OUTSIDE_TORCH,
                       skip=skip, run=lambda counter: _probe(LLAMA, gguf, threads, environment))) + (
                () if is_cold else (Method(MD_SERVED, "multidecode generate --server, a resident multidecode serve",
                                           short="command, served", model=OUTSIDE_TORCH,
                                           run=lambda counter: _command(path or "", environment, resident.url)),))

    targets = (Target("import (multidecode, torch, transformers), warm", ("methods", MD, "extra", "import_s"), "<=", 1.0, unit=" s"),
               Target("load() of the model, warm", ("methods", MD, "extra", "load_s"), "<=", 0.5, unit=" s"),
               Target("the whole command, warm", ("methods", MD_COMMAND, "extra", "process_s"), "<=", 2.0, unit=" s"),
               Target("the whole command, warm, on a resident server", ("methods", MD_SERVED, "extra", "process_s"),
                      "<=", 2.0, unit=" s"))
    columns = (Column("start", "start"), Column("method", "label"),
               Column("import", "extra.import_s", "{:.2f} s"), Column("load", "extra.load_s", "{:.2f} s"),
               Column("first token", "extra.first_token_s", "{:.2f} s"),
               Column("whole process", "extra.process_s", "{:.2f} s"), Column("peak memory", "extra.peak_mb", "{:.0f} MB"))
    return Benchmark(
        name="startup", title=f"the wait before the first token, {Path(gguf).name}", model=None,
        cases=(Case({"start": "cold"}, methods(True), budget_s=None),
               Case({"start": "warm"}, methods(False), budget_s=None, main=True, targets=targets,
                    context=functools.partial(_ready, resident))),
        reference=None, repeats=repeats, columns=(), rows_key="starts",
        config={"model": gguf, "threads": threads, "prompt": PROMPT},
        tables=(Table("The wait before the first token (median of the runs)", columns, rows="methods", lead=2),),
        machine={"model": Path(gguf).name, "threads": threads})


@contextmanager
def _ready(server: ServerProcess):
    """`server` started and ready for the block (its start is not timed: it stays resident)."""
    with server:
        server.wait_ready()
        yield


def run_startup_benchmark(path: str | None, *, progress: Say | None = None, **settings) -> dict:
    """`startup_benchmark` measured (each run its own process: no model is loaded here)."""
    return run(startup_benchmark(path, **settings), progress=progress)

__all__ = ["run_startup_benchmark", "startup_benchmark"]
