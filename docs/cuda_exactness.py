"""How far a forest's logits are from each path fed alone on a CUDA device: the exactness tests'
random forests (`tests/forests.py`) on tiny random models of each main architecture, in float32
and bfloat16, on the exact path (`exact=True`: on a GPU, products and norms in row tiles and the
portable attention) and on the model's own sdpa (`exact=False`). Prints one JSON row per case:
nodes fed, nodes whose logits differ from their path alone bit for bit, the largest difference,
and nodes whose arg-max differs. Run from the repository root on a machine with a GPU:

    python docs/cuda_exactness.py > cuda_exactness.jsonl

(`python docs/cuda_exactness.py cpu` runs the same cases on the CPU, where the exact kernels hold.)
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from forests import beside_alone, exact_model
from tiny_models import MAIN_ARCHITECTURES, tiny_model

from multidecode.attention import use_forest_sdpa


def case(arch: str, precision: str, on_exact: bool, seeds: int = 3, device: str = "cuda") -> dict:
    if on_exact:
        model = exact_model(arch, "sdpa", precision, device=device)
    else:
        model = copy.deepcopy(tiny_model(arch, "sdpa")).to(device, getattr(torch, precision))
        use_forest_sdpa(model)
    pairs = [pair for seed in range(seeds) for pair in beside_alone(model, seed=seed).values()]
    apart = [(row, alone) for row, alone in pairs if not torch.equal(alone, row)]
    return dict(arch=arch, dtype=precision, exact=on_exact, nodes=len(pairs), differ=len(apart),
                argmax_differs=sum(int(alone.argmax() != row.argmax()) for row, alone in apart),
                max_abs_diff=max((float((alone.float() - row.float()).abs().max()) for row, alone in apart), default=0.0))


def main(device: str = "cuda") -> None:
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(json.dumps(dict(device=name, torch=torch.__version__)), flush=True)
    for arch in MAIN_ARCHITECTURES:
        for precision in ("float32", "bfloat16"):
            for on_exact in (True, False):
                try:
                    print(json.dumps(case(arch, precision, on_exact, device=device)), flush=True)
                except Exception as err:  # noqa: BLE001 (a case that cannot run is a finding too)
                    print(json.dumps(dict(arch=arch, dtype=precision, exact=on_exact, error=repr(err)[:300])),
                          flush=True)


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    if len(sys.argv) > 2 or not where.startswith(("cuda", "cpu")):
        sys.exit("usage: python docs/cuda_exactness.py [cuda|cpu]")
    if where.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here (torch.cuda.is_available() is False): run it on a machine with a GPU, "
                 "or `python docs/cuda_exactness.py cpu` for the same cases on the CPU")
    main(where)
