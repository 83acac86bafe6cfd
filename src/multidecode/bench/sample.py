"""Benchmark: n sampled completions of one prompt, one prefill and n branches against transformers'
`num_return_sequences` (docs/benchmarks.md, `bench sample`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import check_counts
from .common import Setup, excerpt_prompt, hf_sequential, multidecode_forest
from .harness import Benchmark, Case, Method, Plot, Target, runs

HF, MD = "hf_num_return_sequences", "multidecode"
SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 0.95}


def sample_benchmark(decoder, *, n: int = 8, ns: Sequence[int] = (1, 2, 4, 8, 16), max_new_tokens: int = 64,
                     prompt_tokens: int = 200, repeats: int = 3, budget_s: float = 60.0, seed: int = 0) -> Benchmark:
    """n completions both ways for every n in `ns` (and `n`, the main point), as data."""
    check_counts("n", [n, *ns], "pass n=8, ns=(1, 2, 4, 8, 16)")
    setup = Setup.of(decoder)
    prompt = excerpt_prompt(setup.tokenizer, prompt_tokens, "Continue this support-call transcript.")

    def methods(k: int, new: int) -> tuple[Method, ...]:
        hf = setup.baseline(hf_sequential, [prompt], new, eos_ids=[], num_return_sequences=k, do_sample=True,
                            min_new_tokens=new, **SAMPLING)

        def seeded_hf(counter):
            torch.manual_seed(seed)  # generate draws from torch's global generator
            return hf(counter)

        def md(counter):
            return multidecode_forest(decoder, [prompt] * k, counter, max_new_tokens=new, eos_token_id=[],
                                      sampling=dict(do_sample=True, seed=seed, **SAMPLING))

        return (Method(HF, "transformers generate(num_return_sequences=n)", run=seeded_hf, short="transformers"),
                Method(MD, "MultiDecode, one prefill, n branches", run=md, short="MultiDecode"))

    def report(k: int):
        def check(got: dict) -> dict:
            for m in got.values():
                if len(m.answers) != k or any(len(a) != max_new_tokens for a in m.answers):
                    raise AssertionError(f"{m.method} did not draw {k} x {max_new_tokens} tokens")
            return {"kv_floor": (len(prompt) + k * max_new_tokens) / (k * (len(prompt) + max_new_tokens))}
        return check

    ns = sorted(set(ns) | {n})
    main_targets = (
        Target(f"speed-up over num_return_sequences={n}", ("multidecode_vs", HF, "speedup"), ">=", 2.0),
        Target("KV bytes / num_return_sequences KV bytes", ("multidecode_vs", HF, "kv_bytes_ratio"), "<=", 0.25,
               unit=""),
    )
    return Benchmark(
        name="sample", title=f"n sampled completions of a {len(prompt)}-token prompt, {max_new_tokens} tokens each",
        model=decoder.model, reference=None, pairs=((MD, HF),), repeats=repeats,
        cases=tuple(Case({"n": k}, methods(k, max_new_tokens), budget_s=budget_s, main=k == n, report=report(k),
                         targets=main_targets if k == n else ()) for k in ns),
        config={"n": n, "ns": ns, "prompt_tokens": len(prompt), "max_new_tokens": max_new_tokens, "sampling": SAMPLING,
                "seed": seed},
        warmup=methods(2, 2),
        columns=("wall_s", "forward_passes", "tokens_per_s", "peak_kv_bytes", "prefill_s", "decode_ms_per_step"),
        plot=Plot("sweep", figures=("peak_kv_bytes",), x="n", xlabel="completions n"),
    )


run_sample_benchmark = runs(sample_benchmark)
