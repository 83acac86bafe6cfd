"""The compiled step's sums are added in aten's order (`multidecode.compiled`, the `eager_sums` pass).

Inductor's own CPU reduction adds a row in another order than aten's: for random bfloat16 rows of
576 (the embedded model's width), the mean of squares an RMSNorm takes differs from eager's in the
last bit for about a third of the rows (702 of 2,048 with torch 2.13), and on the embedded model
that was 0.56 in a logit. Compiled with `compiled.options()`, every sum and mean of the graph is
aten's, so each must give eager's bits.
"""

from __future__ import annotations

import pytest
import torch

from multidecode import compiled

pytestmark = pytest.mark.slow  # each compiles a small graph (seconds)


def _compile(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True, options=compiled.options())


def _rows(count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(count, 576, generator=generator) * 3).to(torch.bfloat16)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm, less the weight: the mean of squares in float32, and the row scaled by it."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return variance, (h * torch.rsqrt(variance + 1e-5)).to(x.dtype)


def sums(x: torch.Tensor):
    """Each form of sum and mean the pass replaces: over a dim, over every dim, with a dtype."""
    h = x.float()
    return h.sum(-1), h.sum(0, keepdim=True), h.sum(), h.mean(), x.sum(-1, dtype=torch.float32), h.mean(-1)


def test_a_norms_mean_of_squares_is_eagers():
    x = _rows(2048)
    eager = rms_norm(x)
    for one_row in (False, True):  # a forest's rows, and a one-row step (its own graph)
        rows = x[:1] if one_row else x
        for got, want in zip(_compile(rms_norm)(rows), rms_norm(rows) if one_row else eager):
            assert torch.equal(got, want)


def test_every_sum_and_mean_is_eagers():
    x = _rows(256, seed=1)
    for got, want in zip(_compile(sums)(x), sums(x)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_pass_replaces_them_all():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    aten = torch.ops.aten
    nodes = [graph.call_function(aten.sum.dim_IntList, (x, [-1], True)),
             graph.call_function(aten.sum.default, (x,)),
             graph.call_function(aten.mean.dim, (x, [0])),
             graph.call_function(aten.mean.default, (x,), {"dtype": None})]
    graph.output(tuple(nodes))
    compiled.eager_sums()(graph)
    targets = [node.target for node in graph.nodes if node.op == "call_function"]
    ops = torch.ops.multidecode
    assert targets == [ops.eager_sum.default, ops.eager_sum.default, ops.eager_mean.default, ops.eager_mean.default]
    assert compiled.eager_sums().uuid() == compiled.eager_sums().uuid()  # cacheable: the same pass, the same key
