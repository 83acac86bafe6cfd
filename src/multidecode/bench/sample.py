"""Benchmark: n sampled completions of one prompt, MultiDecode against `num_return_sequences`.

transformers' `generate(num_return_sequences=n)` copies the prompt n times before prefill: n
prefills and n copies of the prompt's cache. MultiDecode prefills the prompt once and samples n
branches over one cache. Both sides draw exactly `max_new_tokens` tokens per completion (eos
does not end a completion early), with the same sampling settings, so they do the same work;
sampled outputs are not compared token for token (the generators differ), but each side's runs
are seeded and repeat identically.

KV memory: an exact method must keep every completion's own keys, so MultiDecode's cache holds
P + n*T tokens against transformers' n*(P + T); their ratio is the floor reported as `kv_floor`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..errors import InvalidArgument
from .ask import excerpt_prompt
from .common import (
    Progress,
    RunOutput,
    environment,
    hf_sequential,
    load_average,
    measure_together,
    multidecode_forest,
    pad_id_of,
    quiet_transformers,
    torch_threads,
)

HF, MD = "hf_num_return_sequences", "multidecode"
LABELS = {HF: "transformers generate(num_return_sequences=n)", MD: "MultiDecode, one prefill, n branches"}
TARGETS = {"speedup": 2.0, "kv_ratio": 0.25}
SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 0.95}


def sample_prompt(decoder, tokens: int = 200) -> list[int]:
    """A request to continue the sample support call, about `tokens` ids long."""
    return excerpt_prompt(decoder.tokenizer, tokens, "Continue this support-call transcript.")


def run_sample_benchmark(decoder, *, n: int = 8, ns: Sequence[int] = (1, 2, 4, 8, 16), max_new_tokens: int = 64,
                         prompt_tokens: int = 200, repeats: int = 3, seed: int = 0, threads: int | None = None,
                         progress: Progress | None = None) -> dict:
    """Time n completions both ways for every n in `ns` (and `n`), side by side."""
    if any(not isinstance(k, int) or k < 1 for k in [n, *ns]):
        raise InvalidArgument(f"every n must be a positive integer, got {[n, *ns]}")
    say = progress or (lambda message: None)
    started = time.perf_counter()
    model = decoder.model
    prompt = sample_prompt(decoder, prompt_tokens)
    pad_id = pad_id_of(model, decoder.tokenizer)
    hf_settings = dict(do_sample=True, min_new_tokens=max_new_tokens, **SAMPLING)

    def hf_run(k):
        def run(counter) -> RunOutput:
            torch.manual_seed(seed)  # generate draws from torch's global generator
            return hf_sequential(model, [prompt], counter, max_new_tokens=max_new_tokens, eos_ids=[], pad_id=pad_id,
                                 num_return_sequences=k, **hf_settings)
        return run

    def md_run(k):
        sampling = dict(do_sample=True, seed=seed, **SAMPLING)
        return lambda counter: multidecode_forest(decoder, [prompt] * k, counter, max_new_tokens=max_new_tokens,
                                                  sampling=sampling, eos_token_id=[])

    rows = []
    with torch_threads(threads), quiet_transformers():
        say("warming up")
        measure_together({HF: hf_run(2), MD: md_run(2)}, 2, model, repeats=1)
        for k in sorted(set(ns) | {n}):
            m = measure_together({HF: hf_run(k), MD: md_run(k)}, k, model, repeats=repeats, budget_s=60.0)
            for measurement in m.values():
                if any(len(a) != max_new_tokens for a in measurement.answers) or len(measurement.answers) != k:
                    raise AssertionError(f"{measurement.method} did not draw {k} x {max_new_tokens} tokens")
            rows.append(_row(k, m, len(prompt), max_new_tokens))
            say(f"n={k}: transformers {m[HF].wall_s:.2f} s, MultiDecode {m[MD].wall_s:.2f} s "
                f"({rows[-1]['speedup']:.2f}x)")
    main = next(row for row in rows if row["n"] == n)
    return {
        "benchmark": "sample",
        "metadata": {**environment(model), "load_average_at_end": load_average(),
                     "elapsed_s": round(time.perf_counter() - started, 2)},
        "config": {"n": n, "ns": sorted(set(ns) | {n}), "prompt_tokens": len(prompt), "max_new_tokens": max_new_tokens,
                   "sampling": SAMPLING, "seed": seed, "repeats": repeats},
        "labels": LABELS,
        "main": main,
        "sweep": rows,
        "targets": [
            {"name": f"speed-up over num_return_sequences={n}", "target": f">= {TARGETS['speedup']}x",
             "measured": round(main["speedup"], 3), "met": main["speedup"] >= TARGETS["speedup"]},
            {"name": "KV bytes / num_return_sequences KV bytes", "target": f"<= {TARGETS['kv_ratio']}",
             "measured": round(main["kv_ratio"], 4), "met": main["kv_ratio"] <= TARGETS["kv_ratio"],
             "floor": round(main["kv_floor"], 4)},
        ],
    }


def _row(k: int, m: dict, prompt_len: int, new: int) -> dict:
    hf, md = m[HF], m[MD]
    return {
        "n": k,
        "methods": {HF: hf.as_dict(), MD: md.as_dict()},
        "speedup": hf.wall_s / md.wall_s,
        "kv_ratio": md.peak_kv_bytes / hf.peak_kv_bytes,
        "kv_floor": (prompt_len + k * new) / (k * (prompt_len + new)),
        "forward_passes": {HF: hf.forward_passes, MD: md.forward_passes},
    }


def plot_sample(result: dict, path) -> object:
    from .plot import plot_sweep

    rows = result["sweep"]
    ns = [row["n"] for row in rows]
    config = result["config"]
    return plot_sweep(
        path, xs=ns, xlabel="completions n",
        speedups={"over num_return_sequences=n": [row["speedup"] for row in rows]},
        memory_mb={label: [row["methods"][key]["peak_kv_bytes"] / 1e6 for row in rows]
                   for key, label in (("hf_num_return_sequences", "transformers"), ("multidecode", "MultiDecode"))},
        title=f"{result['metadata'].get('model', '?')}: {config['prompt_tokens']}-token prompt, "
              f"{config['max_new_tokens']} sampled tokens per completion",
        target=TARGETS["speedup"],
    )
