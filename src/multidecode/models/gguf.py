"""A GGUF file's weights as the file keeps them: its 4- and 8-bit codes packed, never widened.

A GGUF tensor is stored in blocks of 32 weights (or super-blocks of 256 in the K formats). The
4-bit formats are read as their codes with one step and one low per group of 32 (see `packed`):
Q4_0 (`w = d * (q - 8)`: codes centred on 8, no low kept), Q4_1 (`w = d * q + m`), Q4_K
(`w = d * sc * q - dmin * mn`, with six-bit sub-block scales); Q8_0 (`w = d * q`, q signed 8-bit)
is read as 8-bit codes. Any other format (Q5, Q6_K, F16, F32, ...) is de-quantized to the
model's compute dtype: the nearest precision kept, and `load_packed` says which format each
tensor ended in.

The model itself is built from the file's config on the meta device (nothing allocated), its
linear layers replaced by `PackedLinear`s (module replacement, as transformers' quantizers do),
its other tensors filled from the file, and what no file holds (rotary frequencies) initialized
by the model class's own initializer. The config and the tokenizer come from the cache of
converted models (`converted.gguf_copy(described=True)`: parsed once, seconds saved on every
later load). The weights are read out of the memory-mapped file once (`read_weights`: codes
taken apart and put in the kernels' layout) and kept beside the config (`packed_cache`); every
later load memory-maps what was kept, and converts nothing.

Tensor names and the row permutations some architectures' GGUF files apply (Llama's q and k
projections) are transformers' own (`modeling_gguf_pytorch_utils`); a permutation of rows moves
whole blocks, so it applies to the raw blocks as it does to de-quantized rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import UnsupportedModel
from ..kernels import portable
from . import packed as packing
from .converted import locked_copy
from .packed import GROUP, Codes, PackedEmbedding, PackedLinear, quantize
from .packed_cache import PackedFile, PackedWeights
from .reading import sdpa_or_eager
from .tensor_directory import TensorDirectory
from .vetting import check_supported

PACKED_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8}
"""GGUF tensor types kept as codes, and their bits."""
RECODED = {"Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q6_K": 8, "Q8_1": 8, "Q8_K": 8, "Q2_K": 4, "Q3_K": 4,
           "IQ4_NL": 4, "IQ4_XS": 4}
"""Quantized GGUF types no packed kernel reads, re-coded at `auto` as the nearest width that keeps
their precision (float types stay float, at the activations' dtype)."""
ROW_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor")
"""transformers' GGUF tensor processors that at most permute a linear weight's rows."""


def codes_of(raw: np.ndarray, kind: str) -> Codes:
    """The codes of a GGUF matrix's raw blocks ([rows, bytes per row] uint8)."""
    rows = raw.shape[0]
    if kind == "Q4_K":
        return _q4_k(raw)
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = raw.reshape(rows, -1, size)  # [N, K / 32, bytes]
    scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K / 32]
    if kind == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8)  # [N, K / 32, 32]
        return Codes(_tensor(codes.reshape(rows, -1)), _tensor(scale), torch.zeros(scale.shape), 8)
    packed = blocks[..., 4 if kind == "Q4_1" else 2:]  # [N, K / 32, 16]: element j and j + 16 share byte j
    codes = np.concatenate([packed & 0x0F, packed >> 4], -1)  # [N, K / 32, 32]
    if kind == "Q4_0":  # w = d * (q - 8): codes centred on 8, no low kept
        return Codes(_tensor(codes.reshape(rows, -1)), _tensor(scale), None, 4)
    low = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # Q4_1: w = d * q + m
    return Codes(_tensor(codes.reshape(rows, -1)), _tensor(scale), _tensor(low), 4)


def _q4_k(raw: np.ndarray) -> Codes:
    """Q4_K super-blocks of 256: d, dmin (float16), 8 six-bit scales and mins, 128 bytes of codes
    (32 bytes per pair of sub-blocks: low halves the first, high halves the second)."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    blocks = raw.reshape(-1, 144)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # [B, 8] each
    quads = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (quads & 0x0F).reshape(-1, 8, 32)  # [B, 8 sub-blocks, 32]
    scale = d * sc.astype(np.float32)  # [B, 8]
    low = -dmin * mn.astype(np.float32)
    return Codes(_tensor(codes.reshape(rows, -1)), _tensor(scale.reshape(rows, -1)), _tensor(low.reshape(rows, -1)), 4)


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


# ---------------------------------------------------------------------- the model
def load_packed(path: str | Path, folder: str | Path, *, bits: int | None,
                dtype: torch.dtype) -> tuple[nn.Module, dict[str, str]]:
    """The model of the GGUF file `path` (its config in `folder`), linear weights packed.

    bits: the codes' width, None to keep each tensor's own (a tensor of another width than asked
    is de-quantized and re-coded). dtype: the compute dtype of activations and unpacked tensors.
    The packed weights are read from the file once and kept in `folder` (`packed_cache`), then
    memory-mapped from there. Returns the model and what each tensor ended as (by the file's
    tensor name).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = sdpa_or_eager(lambda attention: AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                                                 attn_implementation=attention))
    check_supported(model)  # before a single weight is read: a model no forest runs exactly is refused as such
    model.generation_config = GenerationConfig.from_pretrained(folder)
    weights = _kept_weights(Path(path), Path(folder), model, bits=bits, dtype=dtype)
    _fill(model, weights, dtype)
    _tie(model, config)
    _initialize_leftovers(model)
    model.eval()
    return model, dict(weights.report)


def _kept_weights(path: Path, folder: Path, model: nn.Module, *, bits: int | None, dtype: torch.dtype) -> PackedWeights:
    """The packed weights kept in the cache for this file, bits and dtype, else read from the file
    (under the copy's lock, so two first loads read it once) and kept there."""
    kept = PackedFile.of(path, folder, bits=bits, dtype=dtype, makers=(portable, packing, sys.modules[__name__]))
    weights = kept.read()
    if weights is not None:
        return weights
    with locked_copy(folder.name, or_unlocked=True):
        weights = kept.read()  # another process may have written it meanwhile
        if weights is None:
            weights = read_weights(path, folder, model, bits=bits, dtype=dtype)
            kept.write(weights)
    return weights


def read_weights(path: Path, folder: Path, model: nn.Module, *, bits: int | None, dtype: torch.dtype) -> PackedWeights:
    """The packed weights of the GGUF file `path` for `model` (built from its config on the meta
    device, not changed here), read out of the memory-mapped file (see the module notes)."""
    from gguf import GGMLQuantizationType, dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    directory = TensorDirectory.load(folder)
    text_config = model.config.get_text_config()
    processor = TENSOR_PROCESSORS.get(directory.architecture, TensorProcessor)(config=text_config.to_dict())
    names = _names(model, directory.architecture, text_config.num_hidden_layers)
    row_only = type(processor).__name__ in ROW_PROCESSORS
    weights = PackedWeights({}, {}, {})
    for file_name, kind, raw in directory.arrays(path):
        name = names.get(file_name)
        if name is None:
            continue
        linear = raw.ndim == 2 and _linear_like(_module(model, name), name)
        if row_only and linear and kind in PACKED_TYPES:
            codes = codes_of(processor.process(weights=raw, name=file_name).weights, kind)
            weights.report[file_name] = f"{kind} kept as {codes.bits}-bit codes"
            if bits is not None and bits != codes.bits:
                codes = quantize(codes.dequantize(), bits)
                weights.report[file_name] = f"{kind} re-coded as {bits}-bit codes (asked for)"
            _add_codes(weights, name, codes)
            continue
        values = dequantize(raw, GGMLQuantizationType[kind])
        values = torch.from_numpy(np.array(processor.process(weights=values, name=file_name).weights, copy=True))
        width = bits or PACKED_TYPES.get(kind) or RECODED.get(kind)
        if linear and width is not None:  # codes no packed kernel reads as they are: re-coded
            _add_codes(weights, name, quantize(values, width))
            why = "a transform of its rows" if kind in PACKED_TYPES else f"{kind} has no packed kernel"
            weights.report[file_name] = f"{kind} re-coded as {width}-bit codes ({why})"
        else:
            weights.tensors[name] = values.to(dtype).reshape(_current(model, name).shape)
            weights.report[file_name] = f"{kind} as {str(dtype).removeprefix('torch.')}"
    return weights


def _add_codes(weights: PackedWeights, name: str, codes: Codes) -> None:
    """Add a linear weight's codes (`name`: the weight's parameter name) in the kernels' layout."""
    module = name.rsplit(".", 1)[0]
    rows, inner = codes.shape
    weights.packed[module] = (codes.bits, rows, inner)
    weights.tensors[f"{module}.codes"], weights.tensors[f"{module}.scales"] = codes.packed()


def _names(model: nn.Module, architecture: str, layers: int) -> dict[str, str]:
    """The file's tensor names -> the model's parameter names (gguf-py's own name table)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise UnsupportedModel(f"gguf-py does not know the architecture {architecture!r}",
                               "update the gguf package, or load the model from a Hugging Face folder")
    table = get_tensor_name_map(arch, layers)
    names = {}
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        file_base = table.get_name(base)
        if file_base is not None:
            names[f"{file_base}.{suffix}"] = hf_name
    return names


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0])


def _linear_like(module: nn.Module, name: str) -> bool:
    """A linear layer's weight, or the input embedding's (read back out of its packed codes)."""
    if not name.endswith(".weight"):
        return False
    return isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.shape[-1] % GROUP == 0


def _fill(model: nn.Module, weights: PackedWeights, dtype: torch.dtype) -> None:
    """Put `weights` into `model`: each packed module in place of its layer (a linear layer
    becomes a `PackedLinear`, the input embedding a `PackedEmbedding` with a packed LM head of
    its own codes), every other tensor where it belongs."""
    tensors = dict(weights.tensors)
    for module, (bits, rows, inner) in weights.packed.items():
        codes, scales = tensors.pop(f"{module}.codes"), tensors.pop(f"{module}.scales")
        bias = tensors.pop(f"{module}.bias", None)
        _place(model, module, PackedLinear(codes, scales, inner, rows, bias=bias, bits=bits, dtype=dtype))
    for name, value in tensors.items():
        _set_tensor(model, name, value)


def _place(model: nn.Module, path: str, linear: PackedLinear) -> None:
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    module = getattr(parent, child)
    if isinstance(module, nn.Embedding):
        embed_scale = _materialized(getattr(module, "embed_scale", None))
        linear = PackedEmbedding(linear, padding_idx=module.padding_idx, embed_scale=embed_scale)
    setattr(parent, child, linear)


def _materialized(value):
    return None if value is None or getattr(value, "is_meta", False) else value


def _current(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` of `model` as it stands (on the meta device: its shape)."""
    module_name, _, attribute = name.rpartition(".")
    return getattr(model.get_submodule(module_name) if module_name else model, attribute)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if isinstance(getattr(module, attribute), nn.Parameter):
        module._parameters[attribute] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attribute] = value


def _tie(model: nn.Module, config) -> None:
    """A model whose LM head is its embedding reads the embedding's codes in both places."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
    if isinstance(embed, PackedEmbedding) and tied:
        model.set_output_embeddings(embed.head[0])
    elif isinstance(head, nn.Linear) and head.weight.is_meta and tied and hasattr(embed, "weight"):
        head.weight = embed.weight


def _initialize_leftovers(model: nn.Module) -> None:
    """Give what the file does not hold (rotary frequencies, scaling buffers) real storage and
    the model class's own initial values; refuse a model that would keep an empty parameter."""
    for module in model.modules():
        meta = [n for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                if t.is_meta]
        if not meta:
            continue
        module.to_empty(device="cpu", recurse=False)
        model._init_weights(module)
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise UnsupportedModel(f"the GGUF file holds no values for {', '.join(empty[:3])}",
                               "load it in float32 or bfloat16 (--precision bfloat16), which transformers converts")


__all__ = ["PACKED_TYPES", "codes_of", "load_packed", "read_weights"]
