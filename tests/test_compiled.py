"""The compiled step's sums are added in aten's order (`multidecode.compiled`, the `eager_ops` pass).

Inductor's own CPU reduction adds a row in another order than aten's: for random bfloat16 rows of
576 (the embedded model's width), the mean of squares an RMSNorm takes differs from eager's in the
last bit for about a third of the rows (702 of 2,048 with torch 2.13), and on the embedded model
that was 0.56 in a logit. Compiled with `compiled.options()`, every sum and mean of the graph is
aten's, so each must give eager's bits.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
from batch_files import records, write_lines
from click.testing import CliRunner
from forests import THREADS, differing, exact_model, random_forest, threads
from local_models import tiny_model_folder

import multidecode
from multidecode import compiled
from multidecode.cli import main
from multidecode.engine import Engine
from multidecode.errors import InvalidArgument
from multidecode.serving.launch import ServerProcess

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
    compiled.eager_ops()(graph)
    targets = [node.target for node in graph.nodes if node.op == "call_function"]
    ops = torch.ops.multidecode
    assert targets == [ops.eager_sum.default, ops.eager_sum.default, ops.eager_mean.default, ops.eager_mean.default]
    assert compiled.eager_ops().uuid() == compiled.eager_ops().uuid()  # cacheable: the same pass, the same key


def test_rotary_angles_are_eagers():
    """Inductor's own cos and sin were a unit in the last place off aten's for about a third of
    float32 angles: a float32 forest compiled gave no node its path's logits (the first forward,
    eager, fed the prompt). The pass hands them to aten, as it does sums."""
    angles = torch.arange(1, 4097, dtype=torch.float32)[:, None] * torch.logspace(0, -4, 32)[None]  # [4096, 32]

    def rotary(x):
        return x.cos(), x.sin()

    for got, want in zip(_compile(rotary)(angles), rotary(angles)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------- the compiled engine
@pytest.mark.parametrize(("arch", "precision"), [("llama", "float32"), ("llama", "bfloat16"), ("llama", "int4"),
                                                  ("qwen2-hybrid", "bfloat16"), ("qwen2-hybrid", "int4")])
def test_a_compiled_forest_gives_the_eager_forests_bits_and_each_node_its_path_alone(arch, precision):
    """Random forests fed through the compiled forward (after each engine's first forward, which
    allocates the cache and runs eagerly) give the eager engine's logits bit for bit, and every
    node the logits of its path fed alone (eagerly, in a fresh engine), at 1 thread and at all."""
    model = exact_model(arch, "sdpa", precision)
    eager = random_forest(Engine(model), random.Random(0))
    compiled.compile_forward(model)
    try:
        for count in THREADS:
            with threads(count):
                got = random_forest(Engine(model), random.Random(0))
                assert got.keys() == eager.keys() and all(torch.equal(got[n], eager[n]) for n in got)
                bad, fed = differing(model, seed=1)
                assert fed and not bad, f"{len(bad)} of {fed} nodes differ from their paths alone"
        assert compiled.compiled_forward(model).refused is None
    finally:
        compiled.uncompile(model)


def test_two_compiled_models_of_one_process_keep_their_own_graphs():
    """The step keeps only the guards on what a call passes (`compiled.call_guards`), so nothing
    about the model is checked before a graph runs: each model's key must keep another model's
    graph from running it. Two models of one shape, one with GELU where the other has SiLU (an
    operation the graph holds, not an input it reads), compiled side by side, forests
    interleaved: each gives its eager forest's logits. (Dynamo's guard on the backend keeps them
    apart too today, as each model is compiled with its own; the key holds it whatever dynamo does.)"""
    models = [exact_model("llama", "sdpa", "bfloat16") for _ in range(2)]
    for layer in models[1].model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    eager = [random_forest(Engine(model), random.Random(2), steps=2) for model in models]
    assert not torch.equal(*(next(iter(e.values())) for e in eager))
    for model in models:
        compiled.compile_forward(model)
    try:
        for _ in range(2):
            for model, expected in zip(models, eager):
                got = random_forest(Engine(model), random.Random(2), steps=2)
                assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)
                assert compiled.compiled_forward(model).refused is None
    finally:
        for model in models:
            compiled.uncompile(model)


def test_the_step_checks_what_a_call_passes_and_not_the_model():
    entries = [type("Guard", (), {"name": name}) for name in
               ("self.model.model.layers[0]._forward_hooks", "GG['__import_torch']", "G['kernels']",
                "dict(type(self).__dict__)", "L['input_ids']", "input_ids", "cache.layers[0]._k", "key", "")]
    assert compiled.call_guards(entries) == [False] * 4 + [True] * 5


def test_a_model_whose_graph_reduces_otherwise_runs_eagerly_and_says_why():
    """GPT-2's layer norms reduce by `var_mean`, whose order inductor would choose: its compile is
    refused (before the graph runs: the cache is untouched) and the engine runs it eagerly, the
    same logits."""
    model = exact_model("gpt2", "sdpa", "bfloat16")
    eager = random_forest(Engine(model), random.Random(0), steps=2)
    compiled.compile_forward(model)
    try:
        got = random_forest(Engine(model), random.Random(0), steps=2)
        assert all(torch.equal(got[n], eager[n]) for n in eager)
        assert "var_mean" in compiled.compiled_forward(model).refused
    finally:
        compiled.uncompile(model)


def test_a_model_on_another_device_is_refused_at_once():
    """The compiled step is built and checked on the CPU; a model on a GPU (here the meta device
    stands for one) keeps its own exact path there, eagerly: refused before any graph."""
    model = exact_model("llama", "sdpa", "float32").to("meta")
    try:
        assert "on meta" in compiled.compile_forward(model).refused
    finally:
        compiled.uncompile(model)


def test_inductors_note_on_mixed_half_precisions_is_not_printed():
    """compile=True at int8 and int4 printed inductor's "bf16 and fp16 are mixed in the scheduler
    node" on stderr: the library prints nothing. Other warnings still pass."""
    import warnings

    model = exact_model("llama", "sdpa", "float32").to("meta")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.resetwarnings()  # no filter of pytest's: only what compiling installs
            warnings.simplefilter("always")
            compiled.compile_forward(model)
            for text in ("bf16 and fp16 are mixed in the scheduler node", "something else"):
                warnings.warn_explicit(text, UserWarning, "cpp.py", 1, module="torch._inductor.codegen.cpp")
        assert [str(w.message) for w in seen] == ["something else"]
    finally:
        compiled.uncompile(model)


def test_load_with_compile_gives_the_same_tokens(tmp_path):
    folder = str(tiny_model_folder(tmp_path / "model"))

    def tokens(decoder) -> list[list[int]]:
        run = decoder.start([[5, 6, 7, 8], [5, 6, 9]], max_new_tokens=6, speculate=None)
        for _ in run.events:
            pass
        return [list(branch.output.token_ids) for branch in run.branches]

    want = tokens(multidecode.load(folder, precision="bfloat16"))
    decoder = multidecode.load(folder, precision="bfloat16", compile=True)
    assert tokens(decoder) == want
    assert compiled.compiled_forward(decoder.model).refused is None
    with pytest.raises(InvalidArgument, match="compile=True needs exact=True"):
        multidecode.load(folder, exact=False, compile=True)


def test_batch_with_compile_writes_the_records_of_a_run_without(model_dir, tmp_path):
    rows = [{"id": i, "document": text, "questions": ["why?", "when?"]}
            for i, text in enumerate(["The router drops the line every evening.", "The cable was cut by the storm."])]
    source = write_lines(tmp_path / "in.jsonl", rows)
    outputs = {}
    for flags in ([], ["--compile"]):
        out = tmp_path / f"out{len(flags)}.jsonl"
        result = CliRunner().invoke(main, ["batch", str(source), "-o", str(out), "--model", str(model_dir),
                                           "--max-new-tokens", "6", *flags])
        assert result.exit_code == 0, result.output
        outputs[len(flags)] = {r["id"]: r["answers"] for r in records(out)}
    assert outputs[1] == outputs[0]
    refused = CliRunner().invoke(main, ["batch", str(source), "-o", str(tmp_path / "x.jsonl"), "--compile", "--ray"])
    assert refused.exit_code == 2 and "--compile runs the job in this process" in refused.output


def test_serve_with_compile_answers_as_without(model_dir):
    """`multidecode serve --compile` (a subprocess): the same completion as a server without it."""
    import httpx

    texts = []
    for flags in ([], ["--compile"]):
        command = [sys.executable, "-m", "multidecode", "serve", "--port", "{port}", "--served-model-name", "m",
                   "--model", str(model_dir), "--log-level", "warning", *flags]
        with ServerProcess("compiled" if flags else "eager", command, model="m") as server:
            server.wait_ready(240)
            body = {"model": "m", "prompt": "The router drops the line", "max_tokens": 8, "temperature": 0}
            reply = httpx.post(server.url + "/v1/completions", json=body, timeout=240)
            assert reply.status_code == 200, reply.text
            texts.append(reply.json()["choices"][0]["text"])
    assert texts[1] == texts[0]
