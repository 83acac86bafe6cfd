"""llama.cpp as a measured baseline on the same GGUF file, through llama-cpp-python's low-level batch API
(docs/benchmarks.md, "How the benchmarks measure"); `missing()` says why it cannot run here."""

from __future__ import annotations

import functools
import importlib.util
import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..prompts import common_prefix_length
from .common import DECODE, PREFILL, ForwardCounter, RunOutput, trim_at_eos

INSTALL = "pip install 'multidecode[peers]' (builds llama-cpp-python from source, about 5 minutes)"
BATCH = 512
"""Tokens per `llama_decode` call while reading prompts (llama.cpp's own default)."""


PORTABLE_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
                  "-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
                  '-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" '
                  "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python")
"""A llama.cpp build for the instruction sets named, not all the CPU reports: AMX, which a VM may
report and not enable (an Intel Xeon, model 207, here: `tilezero` died of SIGILL), left out."""
TRIAL = ("import sys; from multidecode.bench.llamacpp import LlamaCpp; "
         "LlamaCpp(sys.argv[1], threads=1, context=64, sequences=1).generate([[1, 2, 3]], max_new_tokens=2, eos_ids=[])")
"""A child's two-token run of a GGUF file in llama.cpp (`runs_here`)."""


def missing(wanted: bool = True, gguf: str | Path | None = None) -> str | None:
    """Why llama.cpp does not run here (None: it does); `wanted` False: left out by the user. With
    a `gguf` file, llama.cpp must also run it in a child process first (`runs_here`)."""
    if not wanted:
        return "left out (--no-llama)"
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed: {INSTALL}"
    return None if gguf is None else runs_here(str(gguf))


@functools.cache
def runs_here(gguf: str) -> str | None:
    """Why llama.cpp cannot run `gguf` on this machine (None: it ran two tokens), tried in a child
    process: a llama.cpp built for instructions the CPU reports but does not run (AMX tiles in a
    VM that does not enable them) dies of SIGILL, which would end the benchmark's own process
    and lose its measurements."""
    child = subprocess.run([sys.executable, "-c", TRIAL, gguf], capture_output=True, text=True, check=False)
    if child.returncode == 0:
        return None
    if child.returncode < 0:
        name = signal.Signals(-child.returncode).name
        return (f"llama.cpp died of {name} on this machine (built for instructions this CPU reports but does not "
                f"run, such as AMX in a VM): rebuild it for named ones, {PORTABLE_BUILD}")
    last = (child.stderr.strip().splitlines() or ["no message"])[-1]
    return f"llama.cpp could not run {Path(gguf).name} ({last})"


class LlamaCpp:
    """One GGUF file loaded in llama.cpp, a context of `context` cells shared by up to `sequences` sequences."""

    def __init__(self, path: str | Path, *, threads: int, context: int = 4096, sequences: int = 16) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self._log = llama_cpp.llama_log_callback(_quiet)  # kept: llama.cpp holds the pointer
        llama_cpp.llama_log_set(self._log, None)
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = context, BATCH, BATCH
        params.n_seq_max, params.kv_unified = sequences, True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(BATCH, 0, sequences)
        self.sequences = sequences
        self.file_bytes = Path(path).stat().st_size
        self.weights_bytes = int(llama_cpp.llama_model_size(self.model))  # its tensors, as llama.cpp holds them
        self.record = None

    def close(self) -> None:
        lib = self.lib
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)

    def _decode(self, entries: Sequence[tuple[int, int, Sequence[int], bool]], phase: str,
                pick: Picker | None = None) -> list[int]:
        """Decode (token, position, sequences, wants logits) entries, BATCH at a time, each call told to
        `self.record`: the token `pick` chooses for each entry that wants logits."""
        picked = []
        for start in range(0, len(entries), BATCH):
            part = entries[start : start + BATCH]
            batch = self.batch
            batch.n_tokens = len(part)
            for i, (token, position, sequences, logits) in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, len(sequences), logits
                for j, sequence in enumerate(sequences):
                    batch.seq_id[i][j] = sequence
            start = time.perf_counter()
            if self.lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (the context is too small?)")
            if self.record is not None:
                self.record(phase, time.perf_counter() - start, (1, len(part)))
            picked += [pick(sequences[0], i) for i, (_, _, sequences, logits) in enumerate(part) if logits]
        return picked

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_ids: Sequence[int],
                 grammar: str | None = None) -> dict:
        """Greedy continuations of `prompts` (their common prefix decoded once, each held to `grammar`), and
        the run's times: {"answers", "prefill_s", "decode_s", "steps"}."""
        if len(prompts) > self.sequences:
            raise ValueError(f"{len(prompts)} prompts, but the context holds {self.sequences} sequences")
        self.lib.llama_memory_clear(self.memory, True)
        pick = Picker(self, len(prompts), grammar)
        try:
            started = time.perf_counter()
            shared = common_prefix_length(prompts)
            if shared == min(map(len, prompts)):
                shared -= 1  # every sequence keeps a token of its own, for its logits
            self._decode([(t, p, [0], False) for p, t in enumerate(prompts[0][:shared])], PREFILL)
            for sequence in range(1, len(prompts)):
                self.lib.llama_memory_seq_cp(self.memory, 0, sequence, 0, shared)
            own = [(t, p, [s], p == len(prompt) - 1) for s, prompt in enumerate(prompts)
                   for p, t in enumerate(prompt) if p >= shared]
            heads = self._decode(own, PREFILL, pick)
            decoding = time.perf_counter()
            answers: list[list[int]] = [[h] for h in heads]
            live = [s for s, h in enumerate(heads) if h not in eos_ids and max_new_tokens > 1]
            steps = 0
            while live:
                tokens = self._decode([(answers[s][-1], len(prompts[s]) + len(answers[s]) - 1, [s], True)
                                       for s in live], DECODE, pick)
                steps += 1
                for s, token in zip(live, tokens):
                    answers[s].append(token)
                live = [s for s in live if answers[s][-1] not in eos_ids and len(answers[s]) < max_new_tokens]
            ended = time.perf_counter()
        finally:
            pick.close()
        return {"answers": answers, "prefill_s": decoding - started, "decode_s": ended - decoding, "steps": steps}


class Picker:
    """A sequence's next token from the logits at a batch index: the argmax, or with a GBNF grammar a
    sampler chain per sequence (the grammar's, then greedy)."""

    def __init__(self, engine: LlamaCpp, sequences: int, grammar: str | None) -> None:
        self.engine, lib, self.chains = engine, engine.lib, []
        if grammar is not None:
            vocab = lib.llama_model_get_vocab(engine.model)
            for _ in range(sequences):
                chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_grammar(vocab, grammar.encode(), b"root"))
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
                self.chains.append(chain)

    def __call__(self, sequence: int, index: int) -> int:
        engine = self.engine
        if self.chains:
            return int(engine.lib.llama_sampler_sample(self.chains[sequence], engine.ctx, index))
        row = np.ctypeslib.as_array(engine.lib.llama_get_logits_ith(engine.ctx, index), shape=(engine.vocab,))
        return int(row.argmax())

    def close(self) -> None:
        for chain in self.chains:
            self.engine.lib.llama_sampler_free(chain)
        self.chains = []


def json_schema_grammar(schema: dict) -> str:
    """llama.cpp's GBNF grammar of a JSON schema (llama-cpp-python's converter, as its `json_schema` uses)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(json.dumps(schema))


def llama_run(engine: LlamaCpp, prompts: Sequence[Sequence[int]], counter: ForwardCounter, *, max_new_tokens: int,
              eos_ids: Sequence[int], grammar: str | None = None) -> RunOutput:
    """A benchmark run of llama.cpp, each `llama_decode` call recorded on `counter`."""
    engine.record = counter.record
    try:
        out = engine.generate(prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids, grammar=grammar)
    finally:
        engine.record = None
    answers = [trim_at_eos(a, eos_ids) for a in out.pop("answers")]
    return RunOutput(answers, 0, extra=out)


def _quiet(level, text, data) -> None:
    """llama.cpp's log callback: say nothing (the library never prints)."""


__all__ = ["INSTALL", "LlamaCpp", "Picker", "json_schema_grammar", "llama_run", "missing", "runs_here"]
