"""The cost of exact activations (`kernels.in_flat_tiles`), side by side in one process: the tiles
switched off (each activation handed to torch whole) and on, in turns, medians.

    PYTHONPATH=src python docs/results/activation_tiles.py

(a) 64 greedy tokens of `generate` from the embedded model at auto (int4), ms a token;
(b) a float32 prefill of the sample document (one `feed_chain`), seconds.
"""

import statistics
import time

import multidecode
from multidecode import data, kernels
from multidecode.engine import Engine

TILED = kernels.in_flat_tiles


def whole(layer, x):
    return layer(x)


def side_by_side(run, rounds: int) -> dict[str, float]:
    run()  # warm-up
    times: dict[str, list[float]] = {"tiles": [], "whole": []}
    for _ in range(rounds):
        for name, how in (("tiles", TILED), ("whole", whole)):
            kernels.in_flat_tiles = how
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    kernels.in_flat_tiles = TILED
    return {name: statistics.median(t) for name, t in times.items()}


auto = multidecode.load()
steps = side_by_side(lambda: auto.generate("Write a short story about a lighthouse keeper.", max_new_tokens=64,
                                           eos_token_id=[]), rounds=4)
print("(a) ms a token:", {k: round(1000 * v / 64, 2) for k, v in steps.items()})
fp32 = multidecode.load(precision="float32")
ids = fp32.tokenizer(data.sample_document())["input_ids"]
prefill = side_by_side(lambda: Engine(fp32.model).feed_chain(ids), rounds=3)
print(f"(b) {len(ids)}-token float32 prefill, s:", {k: round(v, 3) for k, v in prefill.items()})
