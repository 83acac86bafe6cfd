"""Packed weights: linear layers and embeddings whose weights stay 4- or 8-bit in memory.

A step of a small model on a CPU is bound by reading its weights, so it reads as few bytes as
the model's file holds, and computes on them with `kernels.qlinear`: activations quantized per
row to int8, integer dot products against the codes, each output's groups added in order (exact
by construction, and what llama.cpp computes on a CPU).

- a **group** is `GROUP` consecutive weights of one row that share a **step** and, for 4 bits,
  a **low**: a weight is `step * code + low`, its **code** 4 bits (0..15) — the form of GGUF's
  Q4_1 (low = m) and Q4_K (six-bit sub-block steps and mins) blocks; GGUF's Q4_0 codes are
  centred on 8 (`step * (code - 8)`) and keep no low, a tenth fewer bytes — or `step * code` with
  an 8-bit signed code (Q8_0, and int8). A file's codes are kept as they are;
- steps and lows are kept as float16: GGUF's Q4_0, Q4_1 and Q8_0 store them so (kept exactly);
  a Q4_K sub-block's step (a float16 times a six-bit scale) is rounded to float16 once;
- the codes are kept in the kernel's layout (`kernels.portable.pack`: panels of 16 outputs).

`PackedLinear` replaces `nn.Linear` (and GPT-2's `Conv1D`), `PackedEmbedding` replaces
`nn.Embedding`: module replacement, as transformers' own quantizers do it; no modeling code is
touched. A tied embedding and LM head share their codes (the embedding reads rows back out of
the layout).

`quantize` makes codes from float weights (round to nearest, per group: asymmetric for 4 bits,
symmetric for 8), for `precision="int4"` / `"int8"` on a model loaded from floats.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from .. import kernels
from ..errors import UnsupportedModel
from ..kernels.portable import GROUP, pack, unpack_rows


@dataclass
class Codes:
    """Weights as codes: codes [N, K] int (0..15 for 4 bits, -127..127 for 8), and per group
    step [N, K / GROUP] and low [N, K / GROUP] (float32): weight = step * code + low (low zero for
    8 bits; None for 4-bit codes centred on 8, low = -8 step, which the layout then does not keep)."""

    codes: torch.Tensor
    step: torch.Tensor
    low: torch.Tensor | None
    bits: int

    @property
    def lows(self) -> torch.Tensor:
        """[N, K / GROUP] float32: each group's low (-8 step for centred codes: exact)."""
        return -8 * self.step if self.low is None else self.low

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 weights."""
        weights = self.codes.float() * self.step.repeat_interleave(GROUP, 1)
        return weights + self.lows.repeat_interleave(GROUP, 1) if self.bits == 4 else weights

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, steps and lows) in the kernel's layout; refused where a step is past float16."""
        halves = [self.step] + ([self.low] if self.bits == 4 and self.low is not None else [])
        if any(not torch.isfinite(h.to(torch.float16)).all() for h in halves):
            raise UnsupportedModel("a weight group's scale is past float16's range, which the packed kernels keep",
                                   "load the model in bfloat16 or float32 (--precision bfloat16)")
        return pack(self.codes, self.step, self.low if self.bits == 4 else None, self.bits)


def quantize(weight: torch.Tensor, bits: int) -> Codes:
    """Round-to-nearest codes of a float weight [N, K] (K a multiple of GROUP), per group of
    GROUP: 4 bits asymmetric (the group's range in 16 steps), 8 bits symmetric. Steps and lows are
    rounded to float16 first (as they are kept), and the codes made against the rounded values."""
    rows, inner = weight.shape
    groups = weight.float().reshape(rows, inner // GROUP, GROUP)
    if bits == 4:
        low = groups.amin(-1).to(torch.float16).float()
        step = ((groups.amax(-1) - low) / 15).to(torch.float16).float()
        safe = torch.where(step > 0, step, torch.ones_like(step))
        codes = ((groups - low[..., None]) / safe[..., None]).round().clamp(0, 15)
        return Codes(codes.reshape(rows, inner).to(torch.int8), step, low, 4)
    step = (groups.abs().amax(-1) / 127).to(torch.float16).float()
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = (groups / safe[..., None]).round().clamp(-127, 127)
    return Codes(codes.reshape(rows, inner).to(torch.int8), step, torch.zeros_like(step), 8)


def packable(weight_shape: tuple[int, ...]) -> bool:
    """Whether a [N, K] weight can be packed: K in whole groups."""
    return len(weight_shape) == 2 and weight_shape[1] % GROUP == 0


# ---------------------------------------------------------------------- the modules
class PackedLinear(nn.Module):
    """`y = x W^T + b` with W held as codes in the kernel's layout (see the module notes); x of
    float32 or bfloat16, y in x's dtype. `dtype` is the model's activation dtype (embeddings read
    from these codes come out in it)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, in_features: int, out_features: int, *,
                 bias: torch.Tensor | None = None, bits: int = 4, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features, self.bits, self.dtype = in_features, out_features, bits, dtype
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), in_features] float32: the weights of output rows `ids` ([n] long), read back."""
        return unpack_rows(self.codes, self.scales, ids.to(self.codes.device), self.in_features, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.qlinear(x, self.codes, self.scales, self.out_features, self.bits, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, group={GROUP}"


class PackedEmbedding(nn.Module):
    """An embedding whose table is the codes of a `PackedLinear` (a tied LM head's, or its own):
    rows are read back out of the layout."""

    def __init__(self, head: PackedLinear, *, padding_idx: int | None = None, embed_scale=None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx = padding_idx
        self.head = [head]  # not a submodule: the codes are counted once, as the head's
        self.embed_scale = embed_scale  # scaled embeddings (Gemma) multiply what they read

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.head[0].dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        out = head.rows(ids.reshape(-1)).to(head.dtype).reshape(*ids.shape, head.in_features)
        return out if self.embed_scale is None else out * self.embed_scale.to(out.dtype)


def linear_of(codes: Codes, *, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> PackedLinear:
    rows, inner = codes.shape
    packed, scales = codes.packed()
    return PackedLinear(packed, scales, inner, rows, bias=bias, bits=codes.bits, dtype=dtype)


def packed_bytes(module: nn.Module) -> int:
    """Bytes of a module's tensors, each storage once (shared codes and tied weights count once),
    an untied packed embedding's own codes included (held outside the module tree)."""
    seen, total = set(), 0
    outside = [t for m in packed_linears(module) for t in [*m.parameters(), *m.buffers()]]  # in the tree too: once
    for tensor in [*module.parameters(), *module.buffers(), *outside]:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total


def step_bytes(model: nn.Module) -> int:
    """The bytes of weights a decode step reads: every resident tensor once, less an input embedding
    the LM head does not share (a lookup reads only its rows)."""
    total = packed_bytes(model)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    shared = head is not None and {id(t) for t in embedding.parameters()} & {id(t) for t in head.parameters()}
    return total if shared else total - packed_bytes(embedding)


def packed_linears(model: nn.Module) -> list[PackedLinear]:
    """Every `PackedLinear` of a model once: its modules, and an untied packed embedding's own
    codes (held outside the module tree, so `modules()` alone misses them)."""
    found = {id(m): m for m in model.modules() if isinstance(m, PackedLinear)}
    for module in model.modules():
        if isinstance(module, PackedEmbedding):
            found.setdefault(id(module.head[0]), module.head[0])
    return list(found.values())


def weight_count(model: nn.Module) -> int:
    """The model's weights, packed ones included: its parameters, plus a weight per code (packed
    codes are buffers, which `parameters()` leaves out, so a packed model would seem to shrink)."""
    return sum(p.numel() for p in model.parameters()) + sum(m.in_features * m.out_features
                                                             for m in packed_linears(model))


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its first floating parameter's, or, where it has none
    (every matrix packed, and norms without weights, as OLMo's), its packed layers' activation dtype."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    for layer in packed_linears(model):
        return layer.dtype
    raise UnsupportedModel("the model holds no weights: no parameters and no packed layers", "load a model's weights")


def weights_device(model: nn.Module) -> torch.device:
    """Where the model's weights are: its parameters', or its buffers' where every matrix is packed
    (codes are buffers) and nothing else has a parameter."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    raise UnsupportedModel("the model holds no weights: no parameters and no buffers", "load a model's weights")

def weights_precision(model: nn.Module) -> str:
    """What the model's weights are held as: "int4", "int8" (or "int4+int8" for a GGUF file whose
    tensors keep their own widths) where any are packed, else the parameters' dtype ("float32", ...).

    Read from the model itself, so whoever holds only the model (a cost curve's key, a benchmark's
    metadata) tells an int4 model from an int8 one: both compute in the same activation dtype."""
    bits = sorted({m.bits for m in packed_linears(model)})
    if bits:
        return "+".join(f"int{b}" for b in bits)
    return str(activation_dtype(model)).removeprefix("torch.")


# ---------------------------------------------------------------------- packing a model loaded from floats
NOT_PACKED = "not packed"
"""Said in `pack_model`'s report of a weight it kept in floats (so the precision asked for is not all the model holds)."""


def pack_model(model: nn.Module, bits: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """Replace every linear layer (and GPT-2's Conv1D) of `model` whose weight can be packed with
    a `PackedLinear` of `bits`-bit codes, and the input embedding with a `PackedEmbedding` (sharing
    the LM head's codes where the two are tied). Returns what each weight became, by name."""
    tied = tied_embeddings(model)
    kept = f"{str(dtype).removeprefix('torch.')}, {NOT_PACKED}"  # what a weight no packed kernel takes stays as
    report: dict[str, str] = {}
    heads: dict[int, PackedLinear] = {}  # id(weight) -> its packed linear
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            weight = _linear_weight(child)
            full = f"{name}.{child_name}" if name else child_name
            if weight is None:
                continue
            if not packable(tuple(weight.shape)):  # kept, and said: the precision asked for is not all it holds
                report[f"{full}.weight"] = f"{kept}: {weight.shape[1]} inputs, not whole groups of {GROUP}"
                continue
            linear = heads.get(id(_weight_object(child)))
            if linear is None:
                bias = getattr(child, "bias", None)
                linear = linear_of(quantize(weight, bits), bias=None if bias is None else bias.detach(), dtype=dtype)
                heads[id(_weight_object(child))] = linear
            setattr(module, child_name, linear)
            report[f"{full}.weight"] = f"int{bits} codes, groups of {GROUP}"
    embed = model.get_input_embeddings()
    if isinstance(embed, nn.Embedding) and packable(tuple(embed.weight.shape)):
        head = heads.get(id(embed.weight)) if tied else None
        if head is None:
            head = linear_of(quantize(embed.weight.detach(), bits), dtype=dtype)
        model.set_input_embeddings(PackedEmbedding(head, padding_idx=embed.padding_idx,
                                                   embed_scale=getattr(embed, "embed_scale", None)))
        report["embeddings"] = f"int{bits} codes" + (", shared with the LM head" if tied else "")
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
        if param.dim() > 2:  # a mixture of experts' stacked weights: no packed kernel takes them
            report[name] = f"{kept}: stacked weights, which no packed kernel reads"
    return report


def tied_embeddings(model: nn.Module) -> bool:
    """Whether the output head reads the input embeddings' weights (once packed: the embedding's head)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if isinstance(inp, PackedEmbedding):
        return inp.head[0] is out
    return out is not None and inp is not None and getattr(out, "weight", None) is getattr(inp, "weight", None)


def _weight_object(module: nn.Module):
    return getattr(module, "weight", None)


def _linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The [out, in] weight of a linear layer (nn.Linear, or GPT-2's Conv1D, whose weight is [in, out])."""
    if isinstance(module, nn.Linear):
        return module.weight.detach()
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return module.weight.detach().T
    return None


__all__ = ["GROUP", "Codes", "PackedEmbedding", "PackedLinear", "linear_of", "pack_model", "packable",
           "packed_bytes", "packed_linears", "quantize", "step_bytes", "tied_embeddings", "weight_count",
           "weights_precision"]
