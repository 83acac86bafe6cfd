"""Packed weights: linear layers and embeddings whose weights stay 4- or 8-bit in memory.

A step of a small model on a CPU is bound by reading its weights, so it reads as few bytes as
the model's file holds. The products are torch's own int4 CPU kernel
(`aten._weight_int4pack_mm_for_cpu`, bfloat16 activations: measured 3.7x faster than float32
on the embedded model's largest matrix, and row-count invariant):

- a **group** is `GROUP` consecutive weights of one row that share a scale and an offset; a
  weight is `(code - 8) * scale + offset`, its **code** 4 bits (0..15) — the form of GGUF's
  Q4_0, Q4_1 and Q4_K blocks, whose codes are kept as they are;
- a **plane** is one such packed matrix. 8-bit codes (GGUF's Q8_0, and int8) are two planes:
  `code = 16 * high + low` with `high` in -8..7 and `low` in 0..15, so the weight is
  `(high + 8 - 8) * 16 * scale + (low - 8) * scale + 8 * scale`: two 4-bit products, summed;
- scales and offsets are held in the activations' dtype (bfloat16), as the kernel takes them:
  a file's float16 scale can move by one bfloat16 rounding (2^-9 of itself); codes never move.

`PackedLinear` replaces `nn.Linear` (and GPT-2's `Conv1D`), `PackedEmbedding` replaces
`nn.Embedding`: module replacement, as transformers' own quantizers do it; no modeling code is
touched. A tied embedding and LM head share their planes (the embedding reads rows back out of
the packed layout, which `check_layout` verifies against the kernel's packer where the code runs).

`quantize` makes codes from float weights (round to nearest, per group: asymmetric for 4 bits,
symmetric for 8), for `precision="int4"` / `"int8"` on a model loaded from floats.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32
"""Weights per group (a GGUF block: every 4- and 8-bit GGUF format this reads has 32-weight groups)."""
ROWS = 64
"""The kernel packs rows in blocks of 64; packed matrices are padded to whole blocks."""


@dataclass
class Codes:
    """Weights as codes: codes [N, K] int (0..15 for 4 bits, -128..127 for 8), and per group
    scale [N, K / GROUP] and offset [N, K / GROUP] (float32): weight = (code - 8) * scale + offset
    for 4 bits, code * scale for 8 bits (offset zero)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def planes(self, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The packed planes of these codes: (packed [N', K / 2] uint8, scale_and_offset [K / GROUP, N', 2])."""
        if self.bits == 4:
            return [_plane(self.codes, self.scale, self.offset, dtype)]
        high = torch.div(self.codes, 16, rounding_mode="floor")  # -8..7
        low = self.codes - 16 * high  # 0..15
        return [_plane(high + 8, 16 * self.scale, torch.zeros_like(self.scale), dtype),
                _plane(low, self.scale, 8 * self.scale, dtype)]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 weights."""
        scale = self.scale.repeat_interleave(GROUP, 1)
        if self.bits == 4:
            return (self.codes.float() - 8) * scale + self.offset.repeat_interleave(GROUP, 1)
        return self.codes.float() * scale


def _plane(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rows = codes.shape[0]
    pad = -rows % ROWS
    if pad:  # whole blocks of rows: zero codes with zero scales give zero weights
        codes = torch.cat([codes, torch.full((pad, codes.shape[1]), 8, dtype=codes.dtype)])
        scale, offset = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, offset))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scale_and_offset = torch.stack([scale, offset], -1).transpose(0, 1).contiguous().to(dtype)  # [K/G, N', 2]
    return packed, scale_and_offset


def quantize(weight: torch.Tensor, bits: int) -> Codes:
    """Round-to-nearest codes of a float weight [N, K] (K a multiple of GROUP), per group of
    GROUP: 4 bits asymmetric (the group's range in 16 steps), 8 bits symmetric."""
    rows, inner = weight.shape
    groups = weight.float().reshape(rows, inner // GROUP, GROUP)
    if bits == 4:
        low, high = groups.amin(-1), groups.amax(-1)
        scale = (high - low) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = ((groups - low[..., None]) / safe[..., None]).round().clamp(0, 15)
        return Codes(codes.reshape(rows, inner).to(torch.int8), scale, low + 8 * scale, 4)
    scale = groups.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (groups / safe[..., None]).round().clamp(-127, 127)
    return Codes(codes.reshape(rows, inner).to(torch.int8), scale, torch.zeros_like(scale), 8)


def packable(weight_shape: tuple[int, ...]) -> bool:
    """Whether a [N, K] weight can be packed: K in whole groups (and 16-row alignment the padding gives)."""
    return len(weight_shape) == 2 and weight_shape[1] % GROUP == 0


# ---------------------------------------------------------------------- the modules
class PackedLinear(nn.Module):
    """`y = x W^T + b` with W held as packed planes (see the module notes); x of any float dtype
    (computed in `dtype`, returned in x's)."""

    def __init__(self, planes: list[tuple[torch.Tensor, torch.Tensor]], in_features: int, out_features: int, *,
                 bias: torch.Tensor | None = None, bits: int = 4, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features, self.bits, self.dtype = in_features, out_features, bits, dtype
        self.planes = len(planes)
        for i, (packed, scale_and_offset) in enumerate(planes):
            self.register_buffer(f"packed{i}", packed)
            self.register_buffer(f"scale{i}", scale_and_offset)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def plane_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(getattr(self, f"packed{i}"), getattr(self, f"scale{i}")) for i in range(self.planes)]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), in_features] float32: the weights of output rows `ids` ([n] long), read back."""
        out = None
        for packed, scale_and_offset in self.plane_tensors():
            part = _rows(packed, scale_and_offset, ids, self.in_features)  # [n, K] float32
            out = part if out is None else out + part
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype).contiguous()  # [M, K]
        out = None
        for packed, scale_and_offset in self.plane_tensors():
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scale_and_offset)  # [M, N']
            out = part if out is None else out + part
        out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, group={GROUP}"


class PackedEmbedding(nn.Module):
    """An embedding whose table is the packed planes of a `PackedLinear` (a tied LM head's, or its
    own): rows are read back out of the packed layout."""

    def __init__(self, head: PackedLinear, *, padding_idx: int | None = None, embed_scale=None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx = padding_idx
        self.head = [head]  # not a submodule: the planes are counted once, as the head's
        self.embed_scale = embed_scale  # scaled embeddings (Gemma) multiply what they read

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.head[0].dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        out = head.rows(ids.reshape(-1)).to(head.dtype).reshape(*ids.shape, head.in_features)
        return out if self.embed_scale is None else out * self.embed_scale.to(out.dtype)


def _rows(packed: torch.Tensor, scale_and_offset: torch.Tensor, rows: torch.Tensor, inner: int) -> torch.Tensor:
    """Weights of `rows` read out of a packed plane: blocks of 64 rows, each [K, 32] bytes, byte
    (k, j) holding row j's code in its low half and row j + 32's in its high half."""
    blocks = packed.reshape(-1, inner, ROWS // 2)
    within = rows % ROWS
    column = blocks[rows // ROWS, :, within % (ROWS // 2)].to(torch.int32)  # [R, K]
    codes = torch.where((within >= ROWS // 2)[:, None], column >> 4, column & 15)
    scale = scale_and_offset[:, rows, 0].T.float().repeat_interleave(GROUP, 1)  # [R, K]
    offset = scale_and_offset[:, rows, 1].T.float().repeat_interleave(GROUP, 1)
    return (codes.float() - 8) * scale + offset


@functools.cache
def check_layout() -> bool:
    """Whether rows read back out of the kernel's packed layout equal what was packed, here."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (2 * ROWS, 2 * GROUP), generator=generator, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    rows = torch.tensor([0, 1, 31, 32, 63, 64, 100, 127])
    blocks = packed.reshape(-1, 2 * GROUP, ROWS // 2)
    column = blocks[rows // ROWS, :, (rows % ROWS) % (ROWS // 2)].to(torch.int32)
    read = torch.where(((rows % ROWS) >= ROWS // 2)[:, None], column >> 4, column & 15)
    return torch.equal(read, codes[rows])


def linear_of(codes: Codes, *, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> PackedLinear:
    rows, inner = codes.shape
    return PackedLinear(codes.planes(dtype), inner, rows, bias=bias, bits=codes.bits, dtype=dtype)


def packed_bytes(module: nn.Module) -> int:
    """Bytes of a module's tensors, each storage once (shared planes and tied weights count once)."""
    seen, total = set(), 0
    for tensor in [*module.parameters(), *module.buffers()]:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total




# ---------------------------------------------------------------------- packing a model loaded from floats
def pack_model(model: nn.Module, bits: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """Replace every linear layer (and GPT-2's Conv1D) of `model` whose weight can be packed with
    a `PackedLinear` of `bits`-bit codes, and the input embedding with a `PackedEmbedding` (sharing
    the LM head's planes where the two are tied). Returns what each weight became, by name."""
    tied = _tied(model)
    report: dict[str, str] = {}
    heads: dict[int, PackedLinear] = {}  # id(weight) -> its packed linear
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            weight = _linear_weight(child)
            full = f"{name}.{child_name}" if name else child_name
            if weight is None or not packable(tuple(weight.shape)):
                continue
            linear = heads.get(id(_weight_object(child)))
            if linear is None:
                bias = getattr(child, "bias", None)
                linear = linear_of(quantize(weight, bits), bias=None if bias is None else bias.detach(), dtype=dtype)
                heads[id(_weight_object(child))] = linear
            setattr(module, child_name, linear)
            report[f"{full}.weight"] = f"int{bits} codes, groups of {GROUP}"
    embed = model.get_input_embeddings()
    if isinstance(embed, nn.Embedding) and packable(tuple(embed.weight.shape)) and check_layout():
        head = heads.get(id(embed.weight)) if tied else None
        if head is None:
            head = linear_of(quantize(embed.weight.detach(), bits), dtype=dtype)
        model.set_input_embeddings(PackedEmbedding(head, padding_idx=embed.padding_idx,
                                                   embed_scale=getattr(embed, "embed_scale", None)))
        report["embeddings"] = f"int{bits} codes" + (", shared with the LM head" if tied else "")
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return report


def _tied(model: nn.Module) -> bool:
    out = model.get_output_embeddings()
    return out is not None and getattr(out, "weight", None) is model.get_input_embeddings().weight


def _weight_object(module: nn.Module):
    return getattr(module, "weight", None)


def _linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The [out, in] weight of a linear layer (nn.Linear, or GPT-2's Conv1D, whose weight is [in, out])."""
    if isinstance(module, nn.Linear):
        return module.weight.detach()
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return module.weight.detach().T
    return None


__all__ = ["GROUP", "Codes", "PackedEmbedding", "PackedLinear", "check_layout", "linear_of", "pack_model", "packable",
           "packed_bytes", "quantize"]
