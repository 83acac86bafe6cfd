"""How far a forest's logits are from each path fed alone on a CUDA device: random forests (the
exactness tests' own, `tests/forests.py`) on tiny random models of each main architecture, in
float32 and bfloat16, on the exact kernels (`exact=True`, which on CUDA still run torch's own
products) and on the model's own sdpa (`exact=False`). Prints one JSON row per case: nodes fed,
nodes whose logits differ from their path alone bit for bit, the largest difference, and nodes
whose arg-max differs. Run from the repository root on a machine with a GPU:

    python docs/cuda_exactness.py > cuda_exactness.jsonl

(`python docs/cuda_exactness.py cpu` runs the same cases on the CPU, where the exact kernels hold.)
"""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from forests import random_forest
from tiny_models import MAIN_ARCHITECTURES, tiny_model

from multidecode import exact
from multidecode.attention import use_forest_sdpa
from multidecode.engine import Engine


def case(arch: str, dtype: torch.dtype, on_exact: bool, seeds: int = 3, device: str = "cuda") -> dict:
    model = copy.deepcopy(tiny_model(arch, "sdpa")).to(device, dtype)
    if on_exact:
        exact.use_exact_kernels(model)
    else:
        use_forest_sdpa(model)
    fed = differ = flipped = 0
    largest = 0.0
    for seed in range(seeds):
        engine = Engine(model)
        for node, row in random_forest(engine, random.Random(seed)).items():
            alone = Engine(model).feed_chain(engine.forest.path_tokens(node)).logits[0]
            fed += 1
            if not torch.equal(alone, row):
                differ += 1
                largest = max(largest, float((alone.float() - row.float()).abs().max()))
                flipped += int(alone.argmax() != row.argmax())
    return dict(arch=arch, dtype=str(dtype).removeprefix("torch."), exact=on_exact, nodes=fed, differ=differ,
                argmax_differs=flipped, max_abs_diff=largest)


def main(device: str = "cuda") -> None:
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(json.dumps(dict(device=name, torch=torch.__version__)), flush=True)
    for arch in MAIN_ARCHITECTURES:
        for dtype in (torch.float32, torch.bfloat16):
            for on_exact in (True, False):
                try:
                    print(json.dumps(case(arch, dtype, on_exact, device=device)), flush=True)
                except Exception as err:  # noqa: BLE001 (a case that cannot run is a finding too)
                    print(json.dumps(dict(arch=arch, dtype=str(dtype), exact=on_exact, error=repr(err)[:300])),
                          flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
