"""Precision: what a model's weights are kept as, and what its activations are computed in.

A user picks one of `PRECISIONS` (`load(precision=...)`, `--precision`):

- `float32`, `bfloat16`, `float16`: weights and activations in that dtype (float16 on CUDA only:
  on this project's CPUs it has no fast kernels);
- `int8`, `int4`: weight-only codes (`packed`: groups of 32 weights with a step and a low),
  multiplied by int8 activations (`kernels.qlinear`), the rest of the network in bfloat16; CPU
  only (the packed kernels are CPU kernels);
- `auto` (the default): what the model's file holds. A GGUF file keeps its quantization: its 4-bit
  formats (Q4_0, Q4_1, Q4_K) as 4-bit codes, Q8_0 as 8-bit codes, any other tensor type at the
  nearest precision kept (the model's report says which, tensor by tensor). A Hugging Face folder
  keeps its own dtype (`torch_dtype` in its config; float32 where it names none, and float16
  read as bfloat16 on a CPU). On CUDA, `auto` is bfloat16.

`parse` and `check` refuse an unknown name or one the device cannot run, before anything loads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ..errors import InvalidArgument

PRECISIONS = ("auto", "float32", "bfloat16", "float16", "int8", "int4")
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "q8": "int8", "q4": "int4"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class Precision:
    """A resolved precision (never `auto`): its name and, from it, the compute dtype and bits."""

    name: str
    reason: str = ""  # why `auto` chose it, when it did

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and of every weight that is not packed."""
        return DTYPES.get(self.name, torch.bfloat16)

    @property
    def identity(self) -> str:
        """The precision as a batch job's settings name it: "auto (int4)" where `auto` kept a GGUF
        file's own codes, which an explicit int4 or int8 re-codes (other numbers, so a job started
        at one does not resume at the other); else the name (a float precision computes the same
        chosen by `auto` or named)."""
        return f"auto ({self.name})" if self.reason and self.bits else self.name

    @property
    def bits(self) -> int | None:
        """The packed codes' width, None for a float precision."""
        return BITS.get(self.name)


def parse(name: str | torch.dtype | None) -> str:
    """A precision's canonical name (`auto` for None), or `InvalidArgument` naming the choices."""
    if name is None:
        return "auto"
    if isinstance(name, torch.dtype):
        found = next((key for key, dtype in DTYPES.items() if dtype == name), None)
        if found is None:
            raise InvalidArgument(f"unknown precision {name}", f"use one of {', '.join(PRECISIONS)}")
        return found
    text = str(name).strip().lower()
    text = ALIASES.get(text, text)
    if text not in PRECISIONS:
        raise InvalidArgument(f"unknown precision {name!r}", f"use one of {', '.join(PRECISIONS)}")
    return text


def check(name: str, device: torch.device) -> None:
    """Refuse a precision the device cannot run (before the model loads)."""
    if name == "float16" and device.type == "cpu":
        raise InvalidArgument("float16 has no fast kernels on a CPU here",
                              "use bfloat16 (or int4/int8) on a CPU (--precision, or precision= in Python); "
                              "float16 is for CUDA")
    if name in BITS and device.type != "cpu":
        raise InvalidArgument(f"{name} weights use multidecode's packed CPU kernels, and this model runs on {device}",
                              "use bfloat16 on CUDA, or the CPU for packed weights (--precision and --device, or "
                              "precision= and device= in Python)")


def parse_all(names, device: torch.device) -> list[str]:
    """The precisions named, each once, canonical, auto first; any `device` cannot run refused."""
    chosen = []
    for name in names:
        canonical = parse(name)
        check(canonical, device)
        if canonical not in chosen:
            chosen.append(canonical)
    return sorted(chosen, key=lambda p: p != "auto")


def resolve(name: str, device: torch.device, *, gguf_types: Counter | None = None,
            folder_dtype: torch.dtype | None = None) -> Precision:
    """The precision to load with: `name` itself, or what `auto` means for this model and device
    (gguf_types: the GGUF file's matrix types; folder_dtype: a Hugging Face folder's own dtype)."""
    if name != "auto":
        return Precision(name)
    if device.type != "cpu":
        return Precision("bfloat16", f"auto on {device.type}: bfloat16")
    if gguf_types:
        from .gguf import PACKED_TYPES, RECODED

        widths = {**RECODED, **PACKED_TYPES}  # each quantized type's codes as kept: its own, or the nearest width
        four = sum(n for kind, n in gguf_types.items() if widths.get(kind) == 4)
        eight = sum(n for kind, n in gguf_types.items() if widths.get(kind) == 8)
        floats = sum(n for kind, n in gguf_types.items() if kind in ("F32", "F16", "BF16"))
        if four or eight:
            bits = 4 if four >= eight else 8
            kept = all(kind in PACKED_TYPES for kind in gguf_types if widths.get(kind) == bits)
            return Precision(f"int{bits}", f"auto: the GGUF file's {bits}-bit codes, kept" if kept else
                             f"auto: the GGUF file's quantized weights as {bits}-bit codes (the nearest width kept)")
        if floats and gguf_types.get("F32", 0) == floats:
            return Precision("float32", "auto: the GGUF file's float32 weights")
        return Precision("bfloat16", "auto: the GGUF file's weights at the nearest precision kept")
    if folder_dtype in (torch.bfloat16, torch.float16):
        return Precision("bfloat16", f"auto: the folder's {str(folder_dtype).removeprefix('torch.')} (bfloat16 on a CPU)")
    return Precision("float32", "auto: the folder's float32 weights")


__all__ = ["PRECISIONS", "Precision", "check", "parse", "parse_all", "resolve"]
