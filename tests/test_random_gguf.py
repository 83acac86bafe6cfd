"""The random GGUF files for benchmarks at size (`multidecode.models.random_gguf`), on the "tiny" shape.

What a benchmark relies on: the same seed writes the same bytes (two tools timed on one file, a
file written again is the same file); the file says what `Shape` says (gguf-py reads back the
tensors `Shape.tensors()` lists, matrices in the asked type, no `output.weight`: the head is tied);
multidecode's own loader loads it at `auto` (the 4-bit codes kept) and at float32, with the
shape's config, a tied head, and a greedy `generate` that runs; an unknown shape is refused; no
`.partial` file is left, after a write or after an interrupted one. The files are 61 KB; the
loader's cache points at the test's own folder (MULTIDECODE_CACHE), never the user's.
"""

from __future__ import annotations

import hashlib

import pytest

import multidecode
from multidecode.models import random_gguf
from multidecode.models.packed import PackedEmbedding, PackedLinear
from multidecode.models.random_gguf import BYTE_TOKENS, SHAPES, byte_level_tokens, write_random_gguf

TINY = SHAPES["tiny"]


@pytest.fixture
def tiny(tmp_path):
    """The "tiny" shape at Q4_0, seed 0, and what `write_random_gguf` returned."""
    written = write_random_gguf(tmp_path / "tiny.gguf", shape="tiny")
    return tmp_path / "tiny.gguf", written


# ---------------------------------------------------------------------- the bytes
def test_the_same_seed_writes_the_same_bytes_and_another_seed_others(tmp_path):
    first = write_random_gguf(tmp_path / "a.gguf", shape="tiny", seed=7)
    again = write_random_gguf(tmp_path / "b.gguf", shape="tiny", seed=7)
    other = write_random_gguf(tmp_path / "c.gguf", shape="tiny", seed=8)
    a, b, c = ((tmp_path / name).read_bytes() for name in ("a.gguf", "b.gguf", "c.gguf"))
    digest = [hashlib.sha256(data).hexdigest() for data in (a, b, c)]
    assert digest[0] == digest[1]
    assert digest[0] != digest[2] and len(a) == len(c)  # the same layout, other weights
    assert first["file_bytes"] == len(a) and first["tensor_bytes"] == other["tensor_bytes"] < len(a)
    assert first["seed"] == again["seed"] == 7 and other["seed"] == 8


def test_what_is_written_is_said(tiny):
    path, written = tiny
    assert written["path"] == str(path) and written["shape"] == "tiny" and written["quant"] == "Q4_0"
    assert written["parameters"] == TINY.parameters()
    assert written["dims"]["hidden"] == TINY.hidden and written["dims"]["vocab"] == TINY.vocab
    assert written["file_bytes"] == path.stat().st_size


# ---------------------------------------------------------------------- the file, as gguf-py reads it
@pytest.mark.parametrize("quant", ["Q4_0", "Q8_0"])
def test_gguf_reads_back_the_shapes_tensors_and_metadata(tmp_path, quant):
    import gguf

    path = tmp_path / f"tiny-{quant}.gguf"
    written = write_random_gguf(path, shape="tiny", quant=quant)
    reader = gguf.GGUFReader(str(path))
    listed = TINY.tensors()
    assert [t.name for t in reader.tensors] == [name for name, _ in listed]
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied
    for tensor, (name, dims) in zip(reader.tensors, listed, strict=True):
        assert tuple(int(n) for n in tensor.shape) == tuple(reversed(dims)), name  # ggml order: [cols, rows]
        expected = gguf.GGMLQuantizationType[quant] if len(dims) == 2 else gguf.GGMLQuantizationType.F32
        assert tensor.tensor_type == expected, name
        if len(dims) == 1:
            assert (tensor.data == 1).all(), name  # norms are ones
    assert written["tensor_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    fields = {key: field.contents() for key, field in reader.fields.items()
              if key.startswith(("general.", "llama.", "tokenizer.ggml.")) and key != "tokenizer.ggml.merges"}
    assert fields["general.architecture"] == "llama"
    assert fields["general.name"] == f"random-tiny-{quant}"
    assert fields["general.file_type"] == getattr(gguf.LlamaFileType, f"MOSTLY_{quant}")
    assert (fields["llama.embedding_length"], fields["llama.block_count"], fields["llama.feed_forward_length"],
            fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"],
            fields["llama.vocab_size"], fields["llama.context_length"], fields["llama.rope.dimension_count"]) == (
        TINY.hidden, TINY.layers, TINY.ffn, TINY.heads, TINY.kv_heads, TINY.vocab, TINY.context, TINY.head_dim)
    assert fields["llama.rope.freq_base"] == TINY.rope_theta
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == TINY.pre
    tokens = fields["tokenizer.ggml.tokens"]
    assert tokens == byte_level_tokens(TINY.vocab) and len(tokens) == TINY.vocab
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[BYTE_TOKENS] == "<extra_0>"
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (1, 2)


# ---------------------------------------------------------------------- the file, as multidecode loads it
@pytest.mark.parametrize("precision", ["auto", "float32"])
def test_multidecode_loads_it_with_the_shapes_config_and_a_tied_head(cache, tiny, precision):
    path, _ = tiny
    decoder = multidecode.load(str(path), precision=precision, device="cpu")
    config = decoder.model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (
        TINY.hidden, TINY.layers, TINY.heads, TINY.kv_heads, TINY.ffn, TINY.vocab)
    assert config.tie_word_embeddings
    embed, head = decoder.model.get_input_embeddings(), decoder.model.get_output_embeddings()
    memory = decoder.memory()
    if precision == "auto":
        assert memory["precision"] == "int4"
        matrices = 1 + 7 * TINY.layers  # the embedding and each layer's seven linears
        assert memory["formats"] == {"Q4_0 kept as 4-bit codes": matrices, "F32 as bfloat16": 2 * TINY.layers + 1}
        assert isinstance(embed, PackedEmbedding) and isinstance(head, PackedLinear)
        assert head is embed.head[0]  # one set of planes, read by both
    else:
        assert memory["precision"] == "float32"
        assert head.weight is embed.weight
    result = decoder.generate("hello world", max_new_tokens=8, speculate=None, chat=False)
    assert 0 < len(result.token_ids) <= 8 and result.finish_reason in ("length", "stop")
    assert all(0 <= token < TINY.vocab for token in result.token_ids)


# ---------------------------------------------------------------------- refusals and leftovers
def test_an_unknown_shape_is_refused_and_nothing_written(tmp_path):
    with pytest.raises(ValueError, match="unknown shape 'llama-9b'.*llama-3.2-1b, tiny"):
        write_random_gguf(tmp_path / "x.gguf", shape="llama-9b")
    assert list(tmp_path.iterdir()) == []


def test_a_vocabulary_smaller_than_the_byte_tokens_is_refused():
    assert len(byte_level_tokens()) == BYTE_TOKENS and len(byte_level_tokens(BYTE_TOKENS + 5)) == BYTE_TOKENS + 5
    with pytest.raises(ValueError, match=f"at least {BYTE_TOKENS} tokens"):
        byte_level_tokens(BYTE_TOKENS - 1)


def test_no_partial_file_is_left_after_a_write(tiny, tmp_path):
    path, _ = tiny
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_an_interrupted_write_leaves_neither_the_file_nor_a_partial_one(tmp_path, monkeypatch):
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("stopped half-way through the tensors")
        return real(*args, **kwargs)

    real = random_gguf._random_matrix
    monkeypatch.setattr(random_gguf, "_random_matrix", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_random_gguf(tmp_path / "tiny.gguf", shape="tiny")
    assert len(calls) == 3 and list(tmp_path.iterdir()) == []
