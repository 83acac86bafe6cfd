"""Precision: what `auto` chooses, packed weights read from GGUF codes, and bad input.

The exactness of every precision (random forests equal their paths alone, bit for bit) is
tests/test_exact.py's; here: the choice of precision, the codes read out of each GGUF type as
gguf-py reads them, the packed layers against their de-quantized weights, a GGUF model loaded
packed without a float copy (and what its memory report says), and the errors a user can cause.
Every GGUF file is a tiny one written by the test (`gguf_files`).
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf_files import q4_k_blocks, write_tiny_gguf

import multidecode
from multidecode import cost
from multidecode.bench.results import environment
from multidecode.cli import main
from multidecode.errors import InvalidArgument
from multidecode.models import precision
from multidecode.models.gguf import codes_of
from multidecode.models.packed import PackedEmbedding, PackedLinear, linear_of, quantize
from multidecode.models.tensor_directory import TensorDirectory

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


# ---------------------------------------------------------------------- choosing a precision
@pytest.mark.parametrize("given, name", [(None, "auto"), ("AUTO", "auto"), ("bf16", "bfloat16"), ("fp32", "float32"),
                                         ("q4", "int4"), ("int8", "int8"), (torch.bfloat16, "bfloat16")])
def test_precision_names_and_aliases(given, name):
    assert precision.parse(given) == name


def test_an_unknown_precision_names_the_choices():
    with pytest.raises(InvalidArgument, match="unknown precision 'fp8'") as caught:
        precision.parse("fp8")
    assert "auto, float32, bfloat16, float16, int8, int4" in caught.value.hint


def test_a_precision_the_device_cannot_run_is_refused():
    with pytest.raises(InvalidArgument, match="float16 has no fast kernels on a CPU"):
        precision.check("float16", CPU)
    with pytest.raises(InvalidArgument, match="packed CPU kernels"):
        precision.check("int4", CUDA)
    for name in ("auto", "float32", "bfloat16", "int8", "int4"):
        precision.check(name, CPU)


@pytest.mark.parametrize("types, folder, device, chosen", [
    (Counter(Q4_1=210, Q8_0=1), None, CPU, "int4"),
    (Counter(Q4_K=100, Q6_K=20), None, CPU, "int4"),
    (Counter(Q8_0=50), None, CPU, "int8"),
    (Counter(Q5_0=50), None, CPU, "int8"),  # no kernel reads 5-bit codes: re-coded as 8-bit, not widened to bfloat16
    (Counter(Q6_K=40, Q5_K=10), None, CPU, "int8"),
    (Counter(Q3_K=40, Q5_K=10), None, CPU, "int4"),
    (Counter(F32=50), None, CPU, "float32"),
    (Counter(F16=50), None, CPU, "bfloat16"),
    (None, torch.float32, CPU, "float32"),
    (None, None, CPU, "float32"),
    (None, torch.bfloat16, CPU, "bfloat16"),
    (None, torch.float16, CPU, "bfloat16"),
    (Counter(Q4_1=210), None, CUDA, "bfloat16"),
])
def test_auto_keeps_what_the_file_holds(types, folder, device, chosen):
    resolved = precision.resolve("auto", device, gguf_types=types, folder_dtype=folder)
    assert resolved.name == chosen and resolved.reason.startswith("auto")
    assert precision.resolve("int8", device).name == "int8"  # a named precision is itself


# ---------------------------------------------------------------------- codes, as gguf-py reads them
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_codes_of_each_gguf_type_give_the_weights_gguf_reads(kind):
    import gguf

    rng = np.random.default_rng(1)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "Q4_K":
        raw = q4_k_blocks(rng, 8, 512)
    else:
        raw = gguf.quants.quantize((rng.standard_normal((8, 512)) * 0.1).astype(np.float32), qtype)
    codes = codes_of(raw, kind)
    assert codes.bits == (8 if kind == "Q8_0" else 4) and codes.shape == (8, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    torch.testing.assert_close(codes.dequantize(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_packed_linear_computes_with_its_codes_weights_and_any_row_count_alike(bits):
    torch.manual_seed(0)
    weight = torch.randn(90, 128) * 0.05  # 90 rows: the kernel's panels of 16 outputs, the last padded
    codes = quantize(weight, bits)
    assert (codes.dequantize() - weight).abs().max() < (0.05 if bits == 4 else 0.004)
    layer = linear_of(codes, bias=torch.randn(90).to(torch.bfloat16))
    assert isinstance(layer, PackedLinear)
    x = torch.randn(9, 128).to(torch.bfloat16)
    expected = x.float() @ codes.dequantize().T + layer.bias.float()
    torch.testing.assert_close(layer(x).float(), expected, rtol=0.02, atol=0.02)
    for rows in range(1, 10):  # row-count invariant: a row does not depend on the others
        assert torch.equal(layer(x[:rows]), layer(x)[:rows])


@pytest.mark.parametrize("bits", [4, 8])
def test_a_packed_embedding_reads_the_rows_of_its_head(bits):
    torch.manual_seed(0)
    codes = quantize(torch.randn(130, 64) * 0.05, bits)
    embedding = PackedEmbedding(linear_of(codes))
    ids = torch.tensor([[0, 5, 64, 129]])
    torch.testing.assert_close(embedding(ids)[0].float(), codes.dequantize()[ids[0]], rtol=0.01, atol=0.002)


# ---------------------------------------------------------------------- GGUF models, packed
@pytest.mark.parametrize("kind, bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_auto_keeps_a_gguf_files_codes_and_answers_like_its_float_copy(cache, tmp_path, kind, bits):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type=kind)
    packed = multidecode.load(str(path), device="cpu")
    memory = packed.memory()
    assert memory["precision"] == f"int{bits}" and "GGUF file" in memory["reason"]
    assert memory["formats"] == {f"{kind} kept as {bits}-bit codes": 16, "F32 as bfloat16": 5}  # 5 norms
    assert memory["file_tensor_bytes"] == TensorDirectory.read(path).tensor_bytes()
    assert isinstance(packed.model.get_input_embeddings(), PackedEmbedding)
    assert not (cache / f"{path.stem}").exists() and not any(p.name.endswith("float32") for p in cache.iterdir())
    floats = multidecode.load(str(path), precision="float32", device="cpu")
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        got, expected = packed.model(ids).logits.float(), floats.model(ids).logits
    assert torch.nn.functional.cosine_similarity(got, expected, -1).min() > 0.99


def test_types_without_a_packed_kernel_are_re_coded_and_said_so(cache, tmp_path):
    path = write_tiny_gguf(tmp_path / "mixed.gguf", matrix_type="Q4_0",
                           types={"blk.0.ffn_down.weight": "Q5_0", "blk.1.attn_v.weight": "F16"})
    memory = multidecode.load(str(path), device="cpu").memory()
    assert memory["precision"] == "int4"
    assert memory["formats"]["Q5_0 re-coded as 8-bit codes (Q5_0 has no packed kernel)"] == 1
    assert memory["formats"]["F16 as bfloat16"] == 1
    asked = multidecode.load(str(path), precision="int4", device="cpu").memory()["formats"]
    assert asked["F16 re-coded as 4-bit codes (F16 has no packed kernel)"] == 1


def test_a_packed_model_speculates_exactly(cache, tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type="Q4_1")
    decoder = multidecode.load(str(path), device="cpu")
    prompt = "hello hello hello world hello hello"
    plain = decoder.generate(prompt, max_new_tokens=16, speculate=None, chat=False)
    for mode in ("lookup", "lookahead"):
        spec = decoder.generate(prompt, max_new_tokens=16, speculate=mode, chat=False)
        assert spec.token_ids == plain.token_ids, mode


def test_a_float_folder_packed_at_int4_reports_smaller_weights(model_dir):
    floats = multidecode.load(str(model_dir), precision="float32").memory()
    packed = multidecode.load(str(model_dir), precision="int4").memory()
    assert floats["precision"] == "float32" and packed["precision"] == "int4"
    assert packed["weights_bytes"] < floats["weights_bytes"] / 3
    assert floats["kv_bytes_per_token"] == 2 * packed["kv_bytes_per_token"]  # float32 cache vs bfloat16


def test_each_precision_has_its_own_cost_curve_and_benchmark_metadata(model_dir):
    """int4 and int8 compute in the same dtype and hold their codes as buffers, not parameters:
    both must still tell apart (a cost curve timed at one precision is wrong for the other), and a
    packed model counts the weights its codes stand for."""
    models = {name: multidecode.load(str(model_dir), precision=name).model for name in ("float32", "int4", "int8")}
    keys = {name: cost.model_key(model) for name, model in models.items()}
    assert len(set(keys.values())) == 3
    assert cost.model_key(multidecode.load(str(model_dir), precision="int4").model) == keys["int4"]  # stable
    meta = {name: environment(model) for name, model in models.items()}
    assert [meta[name]["dtype"] for name in models] == ["float32", "int4", "int8"]
    assert meta["int4"]["compute_dtype"] == "bfloat16"
    assert meta["int4"]["parameters"] == meta["int8"]["parameters"] == meta["float32"]["parameters"]


# ---------------------------------------------------------------------- the command line
@pytest.mark.parametrize("args, message", [
    (["--precision", "fp8"], "unknown precision 'fp8'"),
    (["--precision", "float16"], "float16 has no fast kernels on a CPU"),
    (["--dtype", "float16"], "float16 has no fast kernels on a CPU"),
])
def test_cli_bad_precision_exits_2_before_loading(model_dir, args, message):
    for command in (["generate", "-p", "hi"], ["ask", "--document", "-", "-q", "Why?"], ["beam", "-p", "hi"]):
        result = CliRunner().invoke(main, [*command, "--model", str(model_dir), *args], input="A document.")
        assert result.exit_code == 2, (command, result.output)
        assert message in result.output and "hint:" in result.output and "Traceback" not in result.output
        assert "Loaded" not in result.output


def test_cli_runs_a_gguf_at_each_cpu_precision_with_the_same_speculative_and_plain_tokens(cache, tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type="Q8_0")
    runner = CliRunner()
    for name in ("auto", "int4", "bfloat16", "float32"):
        rows = []
        for speculate in ("off", "lookup"):
            result = runner.invoke(main, ["generate", "--model", str(path), "-p", "hello hello hello", "--no-chat",
                                          "--max-new-tokens", "8", "--precision", name, "--speculate", speculate,
                                          "--json"])
            assert result.exit_code == 0, result.output
            rows.append(json.loads(result.stdout.strip().splitlines()[-1])["token_ids"])
        assert rows[0] == rows[1], name
        assert f"tiny.gguf (llama, {'auto (int8)' if name == 'auto' else name}, cpu)" in result.stderr


def test_weights_a_packed_precision_cannot_pack_are_said_not_packed(tmp_path):
    """An MLP 80 wide (no whole groups of 32) at int4: its 3 down projections stay bfloat16. The
    load said int4 and listed only what it packed; the report and the command line's note now name
    what was not packed (as they would a mixture of experts' stacked weights)."""
    import transformers as tf
    from local_models import tiny_tokenizer
    from tiny_models import COMMON, ROPE

    torch.manual_seed(0)
    folder = tmp_path / "odd"
    tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, **{**ROPE, "intermediate_size": 80})).save_pretrained(folder)
    tiny_tokenizer(vocab_size=COMMON["vocab_size"]).save_pretrained(folder)
    formats = multidecode.load(str(folder), precision="int4").memory()["formats"]
    assert sum(n for became, n in formats.items() if "not packed" in became) == 3, formats
    result = CliRunner().invoke(main, ["generate", "--model", str(folder), "--precision", "int4", "-p", "hi",
                                       "--max-new-tokens", "2"])
    assert result.exit_code == 0 and "int4, 3 weights not packed" in result.stderr, result.output
