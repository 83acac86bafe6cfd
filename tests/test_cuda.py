"""The CUDA path: forests, speculation and beam search on a GPU equal transformers' own results
there. Skipped where no GPU is present (CI and the CPU machines run everything else)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES, VOCAB

import multidecode
from multidecode.api import start_forest
from multidecode.cost import measure_cost
from multidecode.sampling import SamplingParams
from multidecode.strategies.beam import run_beam_search

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PREFIX = [7, 19, 33, 7, 19, 33, 41, 5]
BRANCHES = [[], [9, 12], [7, 19]]


def cuda_model(arch: str):
    config, cls = ARCHITECTURES[arch]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    return cls(config).to("cuda", torch.float32).eval()


def generate(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=VOCAB, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "gpt2"])
@pytest.mark.parametrize("speculate", [None, "lookup", "suffix", "lookahead", "auto"])
def test_forest_on_cuda_equals_generate(arch, speculate):
    model = cuda_model(arch)
    run = start_forest(model, PREFIX, BRANCHES, max_new_tokens=16, eos_token_id=[VOCAB],
                       sampling=[SamplingParams()] * len(BRANCHES), speculate=speculate).finish()
    assert [b.output.token_ids for b in run.branches] == [generate(model, PREFIX + b, 16) for b in BRANCHES]
    assert run.engine.cache.layers[0].keys.device.type == "cuda"


def test_beam_search_on_cuda_equals_generate():
    model = cuda_model("llama")
    run = run_beam_search(model, PREFIX, num_beams=3, max_new_tokens=8, eos_token_id=[VOCAB])
    ids = torch.tensor([PREFIX], device="cuda")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3, max_new_tokens=8,
                             eos_token_id=VOCAB, pad_token_id=0)
    assert run.beams[0].token_ids == out[0, len(PREFIX):].tolist()


def test_seeded_sampling_on_cuda_is_the_same_with_speculation():
    model = cuda_model("llama")
    out = [multidecode.decode(model, PREFIX, BRANCHES, max_new_tokens=12, eos_token_id=VOCAB, do_sample=True,
                              temperature=0.8, seed=3, speculate=s) for s in (None, "lookup")]
    assert out[0] == out[1]


def test_cost_curve_on_cuda():
    curve = measure_cost(cuda_model("llama"), sizes=(1, 2, 8, 32), contexts=(64,), repeats=2)
    assert all(b >= a > 0 for a, b in zip(curve.seconds[0], curve.seconds[0][1:]))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_draft_models_on_cuda_equal_generate(arch):
    """A self-draft (one layer skipped) and a draft identical to the target, on the GPU."""
    from multidecode.proposers.draft import DraftModel
    from multidecode.proposers.self_draft import self_draft
    from multidecode.speculation import Speculation

    model = cuda_model(arch)
    expected = [generate(model, PREFIX + b, 16) for b in BRANCHES]
    for draft in (self_draft(model, [1]), model):
        run = start_forest(model, PREFIX, BRANCHES, max_new_tokens=16, eos_token_id=[VOCAB],
                           sampling=[SamplingParams()] * len(BRANCHES),
                           speculate=Speculation(DraftModel(draft, confidence=0.0), budget=4)).finish()
        assert [b.output.token_ids for b in run.branches] == expected


def test_sampled_draft_speculation_on_cuda_runs_the_rule_against_q():
    from multidecode.proposers.draft import DraftModel
    from multidecode.proposers.self_draft import self_draft

    model = cuda_model("llama")
    out = multidecode.decode(model, PREFIX, BRANCHES, max_new_tokens=12, eos_token_id=VOCAB, do_sample=True,
                             temperature=0.8, seed=3, speculate=DraftModel(self_draft(model, [1])))
    assert [len(o) for o in out] == [12] * len(BRANCHES)
