"""A GGUF file of a real model's shape with random weights, written here: nothing is downloaded.

**Why.** A benchmark at a realistic size (Llama-3.2-1B: 1.24 billion parameters) must time
multidecode and llama.cpp on the *same* file, and no such file may be downloaded. Random weights
cost the same to multiply as trained ones, so the timings are those of the real model; only the
text it writes is noise. `write_random_gguf` writes such a file in well under a minute (17 s on
one core of the 2-core development machine, 0.5 GB peak resident memory).

**Terms.**

- *shape*: a model's dimensions (`Shape`), named in `SHAPES`: "llama-3.2-1b", or "tiny" for tests.
- *matrix*: a 2-d weight (the token embedding and the linear layers), stored quantized (`quant`:
  a GGUF type gguf-py can write, "Q4_0" by default: blocks of 32 weights, one float16 scale and
  32 four-bit codes, 18 bytes); *norm*: an RMSNorm weight, stored as float32 ones.
- *tied*: the LM head reads the token embedding (no `output.weight` in the file), as in
  Llama-3.2-1B; both llama.cpp and transformers tie a Llama without `output.weight`.
- *byte-level tokenizer*: a GPT-2 style BPE vocabulary (`tokenizer.ggml.model` "gpt2"): three
  control tokens, the 256 byte tokens, four merges (`byte_level_tokens`), then filler tokens
  `<extra_i>` up to the shape's vocabulary size. llama.cpp and transformers' GGUF loader both
  read it; it spells any text, byte by byte.

**Memory.** Tensors are written one by one (`GGUFWriter.add_tensor_info`, then
`write_tensor_data`), each generated and quantized in chunks of `CHUNK_VALUES` weights, so the
writer holds one quantized tensor (at most the embedding's: 148 MB for Llama-3.2-1B at Q4_0) and
one float32 chunk (32 MB), never the model. The file is written beside its path and renamed into
place, so an interrupted write leaves no partial file under the name.

**Determinism.** The same shape, quant and seed give the same bytes (one numpy generator draws
every tensor, in the file's order).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidInput

STD = 0.02
"""The standard deviation of every random matrix weight (Llama's initializer range)."""
CHUNK_VALUES = 1 << 23
"""How many weights are drawn and quantized at once (32 MB of float32)."""

CONTROL_TOKENS = ["<unk>", "<s>", "</s>"]
MERGES = ["h e", "l l", "ll o", "he llo"]
BYTE_TOKENS = len(CONTROL_TOKENS) + 256 + len(MERGES)
"""The real tokens of the byte-level vocabulary: <unk>, <s>, </s>, the 256 byte tokens, four merges."""


@dataclass(frozen=True)
class Shape:
    """A Llama's dimensions, as a GGUF file's metadata names them."""

    hidden: int  # embedding_length
    layers: int  # block_count
    heads: int  # attention.head_count
    kv_heads: int  # attention.head_count_kv
    ffn: int  # feed_forward_length
    vocab: int  # vocab_size: the byte-level tokens, then filler tokens
    context: int  # context_length
    rope_theta: float = 500000.0  # rope.freq_base (plain rope: no llama3 scaling)
    rms_eps: float = 1e-5  # attention.layer_norm_rms_epsilon
    tied: bool = True  # the LM head reads the token embedding
    pre: str = "llama-bpe"  # tokenizer.ggml.pre: how text is split before the merges

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape) of each tensor, in the file's order: [rows, cols] matrices
        (a linear layer's [out, in]) and [n] norms."""
        kv = self.kv_heads * self.head_dim
        listed = [("token_embd.weight", (self.vocab, self.hidden))]  # [V, H]
        for i in range(self.layers):
            listed += [
                (f"blk.{i}.attn_norm.weight", (self.hidden,)),  # [H]
                (f"blk.{i}.attn_q.weight", (self.hidden, self.hidden)),  # [heads * D, H]
                (f"blk.{i}.attn_k.weight", (kv, self.hidden)),  # [kv_heads * D, H]
                (f"blk.{i}.attn_v.weight", (kv, self.hidden)),  # [kv_heads * D, H]
                (f"blk.{i}.attn_output.weight", (self.hidden, self.hidden)),  # [H, heads * D]
                (f"blk.{i}.ffn_norm.weight", (self.hidden,)),  # [H]
                (f"blk.{i}.ffn_gate.weight", (self.ffn, self.hidden)),  # [F, H]
                (f"blk.{i}.ffn_up.weight", (self.ffn, self.hidden)),  # [F, H]
                (f"blk.{i}.ffn_down.weight", (self.hidden, self.ffn)),  # [H, F]
            ]
        listed.append(("output_norm.weight", (self.hidden,)))  # [H]
        if not self.tied:
            listed.append(("output.weight", (self.vocab, self.hidden)))  # [V, H]
        return listed

    def parameters(self) -> int:
        return sum(int(np.prod(dims)) for _, dims in self.tensors())


SHAPES = {
    # Llama-3.2-1B: 1.24e9 parameters, 0.26e9 of them the tied embedding. Its context is 131072;
    # 8192 is written, which is all a benchmark uses and keeps both tools' defaults small.
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, context=8192),
    # For tests: every dimension a multiple of 32 (one Q4_0 block), two KV heads shared by four.
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=320, context=256),
}


# ---------------------------------------------------------------------- the tokenizer
def byte_level_tokens(vocab_size: int | None = None) -> list[str]:
    """The byte-level vocabulary: <unk>, <s>, </s>, the 256 byte tokens (in GPT-2's spelling),
    the four merged tokens, then filler tokens `<extra_i>` up to `vocab_size` (None: none)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*CONTROL_TOKENS, *bytes_to_unicode().values(), "he", "ll", "llo", "hello"]
    fillers = (vocab_size or len(tokens)) - len(tokens)
    if fillers < 0:
        raise ValueError(f"a byte-level vocabulary needs at least {len(tokens)} tokens, not {vocab_size}")
    return tokens + [f"<extra_{i}>" for i in range(fillers)]


def add_byte_level_tokenizer(writer, tokens: list[str], *, pre: str = "smollm") -> None:
    """Write the byte-level BPE tokenizer of `tokens` (`byte_level_tokens`) into a GGUF writer's
    metadata: the three control tokens first (bos 1, eos 2, unk 0), every other token normal."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


# ---------------------------------------------------------------------- the file
def write_random_gguf(path: str | os.PathLike, *, shape: str = "llama-3.2-1b", quant: str = "Q4_0", seed: int = 0,
                      progress: Callable[[str], None] | None = None) -> dict:
    """Write a Llama of the shape `shape` (a key of `SHAPES`) with random weights to `path`.

    Matrices are normal with std `STD`, stored as `quant` (a GGUF type gguf-py can quantize to:
    "Q4_0", "Q4_1", "Q5_0", "Q8_0", "F16", ...); norms are float32 ones. Llama-3.2-1B takes under
    a minute on one core (17 s measured) and 0.7 GB of disk at Q4_0. progress: gets a short
    message per layer.
    Returns what was written: path, shape (its name and dimensions), quant, seed, parameters,
    file_bytes, tensor_bytes and seconds.
    """
    import gguf

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose one of {', '.join(SHAPES)}")
    dims = SHAPES[shape]
    qtype = gguf.GGMLQuantizationType[quant]
    say = progress or (lambda message: None)
    started = time.perf_counter()
    path = Path(path)
    if not path.parent.is_dir():
        raise InvalidInput(f"the folder of {path} does not exist", "create it first, or write the file elsewhere")
    if path.is_dir():
        raise InvalidInput(f"{path} is a folder", "pass a file name, such as random.gguf")
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    _add_metadata(writer, gguf, dims, name=f"random-{shape}-{quant}", quant=quant)
    listed = dims.tensors()
    for name, tensor_shape in listed:
        if len(tensor_shape) == 1:
            writer.add_tensor_info(name, tensor_shape, np.dtype(np.float32), 4 * tensor_shape[0])
            continue
        byte_shape = gguf.quants.quant_shape_to_byte_shape(tensor_shape, qtype)
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    rng = np.random.default_rng(seed)
    tensor_bytes = 0
    try:  # from the header on: the partial file exists
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, tensor_shape in listed:
            if len(tensor_shape) == 1:
                data = np.ones(tensor_shape, np.float32)
            else:
                data = _random_matrix(rng, tensor_shape, qtype, gguf)
            writer.write_tensor_data(data)
            tensor_bytes += data.nbytes
            if name.endswith("ffn_down.weight") or name == "token_embd.weight":
                say(f"{name}: {time.perf_counter() - started:.1f} s")
        writer.close()
        os.replace(partial, path)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    say(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {seconds:.1f} s")
    return {"path": str(path), "shape": shape, "dims": asdict(dims), "quant": quant, "seed": seed,
            "parameters": dims.parameters(), "file_bytes": path.stat().st_size, "tensor_bytes": tensor_bytes,
            "seconds": round(seconds, 2)}


def _add_metadata(writer, gguf, dims: Shape, *, name: str, quant: str) -> None:
    """The model's hyper-parameters and its tokenizer, under llama.cpp's key names."""
    writer.add_name(name)
    writer.add_block_count(dims.layers)
    writer.add_context_length(dims.context)
    writer.add_embedding_length(dims.hidden)
    writer.add_feed_forward_length(dims.ffn)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    writer.add_rope_freq_base(dims.rope_theta)
    writer.add_layer_norm_rms_eps(dims.rms_eps)
    writer.add_vocab_size(dims.vocab)
    writer.add_rope_dimension_count(dims.head_dim)
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{quant}", None)
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_byte_level_tokenizer(writer, byte_level_tokens(dims.vocab), pre=dims.pre)


def _random_matrix(rng: np.random.Generator, tensor_shape: tuple[int, int], qtype, gguf) -> np.ndarray:
    """A [rows, cols] matrix of normal weights (std `STD`) quantized to `qtype`, as its raw
    [rows, bytes per row] uint8 blocks, drawn and quantized `CHUNK_VALUES` weights at a time."""
    rows, cols = tensor_shape
    out = np.empty(gguf.quants.quant_shape_to_byte_shape(tensor_shape, qtype), np.uint8)  # [rows, bytes per row]
    step = max(1, CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        chunk = rng.standard_normal((stop - start, cols), dtype=np.float32)  # [step, cols]
        chunk *= STD
        out[start:stop] = gguf.quants.quantize(chunk, qtype).view(np.uint8).reshape(stop - start, -1)
    return out


__all__ = ["BYTE_TOKENS", "SHAPES", "Shape", "add_byte_level_tokenizer", "byte_level_tokens", "write_random_gguf"]
