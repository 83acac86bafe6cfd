"""8 questions about the shipped support call: transformers' `generate` one question at a time
against the MultiDecode forest, alone and with every branch speculating (Medusa heads, the EAGLE
head, auto), side by side: the median of 3 interleaved rounds, answers checked identical.

    python docs/ask8.py [PRECISION]

The learned heads are the ones `multidecode train-drafter` trained for the embedded model (in the
user cache); `docs/benchmarks.md` reports a run.
"""

from __future__ import annotations

import statistics
import sys
import time

import multidecode as md
from multidecode import data
from multidecode.bench.common import ForwardCounter, Setup, hf_sequential, multidecode_forest

NEW_TOKENS = 32


def main(precision: str | None = None) -> None:
    decoder = md.load(precision=precision)
    setup = Setup.of(decoder)
    prompts = decoder.question_prompts(data.sample_document(), data.sample_questions())
    eos = list(setup.eos_ids)

    def forest(mode):
        return lambda counter: multidecode_forest(decoder, prompts, counter, max_new_tokens=NEW_TOKENS,
                                                  eos_token_id=eos, speculate=decoder.speculation(mode))

    methods = {"hf_one_by_one": lambda counter: hf_sequential(decoder.model, prompts, counter, max_new_tokens=NEW_TOKENS,
                                                              eos_ids=setup.eos_ids, pad_id=setup.pad_id),
               "forest": forest(None), "forest_medusa": forest("medusa"), "forest_eagle": forest("eagle"),
               "forest_auto": forest("auto")}
    times: dict[str, list[float]] = {name: [] for name in methods}
    answers, stats = {}, {}
    for _ in range(3):
        for name, run in methods.items():
            with ForwardCounter(decoder.model) as counter:
                start = time.perf_counter()
                out = run(counter)
                times[name].append(time.perf_counter() - start)
            answers[name] = out.answers
            stats[name] = {k: out.extra.get(k) for k in ("drafted", "accepted")}
    base = statistics.median(times["hf_one_by_one"])
    for name in methods:
        median = statistics.median(times[name])
        same = answers[name] == answers["hf_one_by_one"]
        print(f"{name:16s} {median:6.2f} s  {base / median:5.2f}x over one by one  identical={same}  {stats[name]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
