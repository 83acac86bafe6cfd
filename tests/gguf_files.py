"""Tiny GGUF files written with the `gguf` package: nothing is downloaded.

`write_tiny_gguf` writes a Llama with random weights and a byte-level BPE vocabulary in its
metadata (the library's own: `multidecode.models.random_gguf`, which writes files of real models'
shapes for benchmarks). Its matrices are stored in a chosen GGUF type (`matrix_type`, or per
tensor through `types`); `q4_k_blocks` makes Q4_K data by hand, which gguf-py can read but not write.
"""

from __future__ import annotations

import numpy as np

from multidecode.models.random_gguf import BYTE_TOKENS, add_byte_level_tokenizer, byte_level_tokens


def write_tiny_gguf(path, *, seed: int = 0, name: str = "tiny", matrix_type: str = "Q8_0", types=None,
                    hidden: int = 32, ffn: int = 64, heads: int = 4, layers: int = 2, extra_tokens: int = 0,
                    architecture: str = "llama"):
    """A Llama with random weights and a byte-level BPE tokenizer, as a GGUF file (architecture:
    the name its header gives, another one's for a file no forest runs: the tensors stay Llama's).

    matrix_type: the GGUF type of its matrices ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "F16", ... or
    "Q4_K"); types: {tensor name: type} for some tensors; extra_tokens: filler tokens after the
    real ones (a vocabulary of a round size)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = byte_level_tokens(BYTE_TOKENS + extra_tokens)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads // 2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(hidden // heads)
    add_byte_level_tokenizer(writer, tokens, pre="smollm")

    def matrix(tensor, rows, cols):
        kind = (types or {}).get(tensor, matrix_type)
        data = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(tensor, data)
        elif kind == "Q4_K":
            writer.add_tensor(tensor, q4_k_blocks(rng, rows, cols), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(tensor, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    matrix("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        kv = hidden // 2
        for tensor, rows, cols in [("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                   ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden),
                                   ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)]:
            matrix(f"blk.{i}.{tensor}.weight", rows, cols)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    matrix("output.weight", len(tokens), hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q4_k_blocks(rng, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K data [rows, cols / 256 * 144] uint8: super-blocks of 256 weights with small
    finite float16 scales (d, dmin) and random 6-bit sub-scales and 4-bit codes."""
    assert cols % 256 == 0, "Q4_K needs rows of whole 256-weight super-blocks"
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full(len(blocks), 0.002, np.float16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = np.full(len(blocks), 0.001, np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
