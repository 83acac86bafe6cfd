"""The forward's kernels, owned here: every output reduced in one fixed order, whatever shares it.

A forest is exact when each node's logits are a function of that node's path alone. That holds
*by construction* when every kernel on the forward's path computes an output from its own row's
inputs, in an order that neither the number of rows, nor the other rows, nor the thread count can
change. torch's matrix products (MKL, oneDNN) choose tiles and reduction splits by shape and
threads, so they are not used on the forward's path; these kernels are:

- `linear`: float32 / bfloat16 weights (a model's `nn.Linear` layers, the LM head);
- `qlinear`: 4- and 8-bit weight codes in groups of 32 (GGUF's Q4_0 / Q4_1 / Q4_K / Q8_0, and
  `int4` / `int8`) times activations quantized per row to int8 (llama.cpp's Q8_0 rule): integer
  dot products summed in int32 (exact in any order), the groups' scaled sums added in group order;
- `rms_norm`: each row's root mean square summed in one fixed order (a model's RMSNorm layers,
  where their arithmetic is one of the two the kernel knows: checked on each layer when swapped);
- `attention`: each query row over the keys it sees, reduced by position blocks in position
  order (see `exact`), never reading another row's keys.

Their definitions are in `csrc/kernels_impl.h`. Each is written once over 16 "lanes" and compiled
for every instruction set (portable C, AVX2, AVX-512, AVX-512 VNNI); a lane does what one scalar
IEEE operation does, so every set gives the same bits, and the tests check each set against the
portable one. The set used is the best this CPU has, or lower where torch is told to stay lower
(`ATEN_CPU_CAPABILITY=avx2`, torch's own switch, read once).

Everything else on the forward's path is torch's own and per row: other norms reduce one row's
hidden vector (torch reduces each output in one thread below 32,768 elements, and never splits a
reduction shared by several outputs), rotary embeddings, activations and residuals are
elementwise, embeddings are lookups.

Without a compiler the kernels run on `portable`: the same definitions in torch, each output
still a function of its own row (integer products as exact float32 sums, groups added one after
the other), slower, and float-weight `linear` refused there (no torch kernel fixes its order).

On a GPU the products and norms are torch's own, run in **row tiles** (`in_row_tiles`): every
call sees exactly `ROW_TILE` rows (the last tile padded), so cuBLAS picks one kernel and torch's
reductions one thread layout whatever the forward's row count. A row's result is then the same
in a tile of one real row as in a full one if such a kernel computes each row the same way
wherever it sits in the tile (a product's or a norm's row never reads another row; an
assumption about cuBLAS and torch, which the GPU tests check). Called with their true row counts,
both change with it: cuBLAS by its heuristics, torch's reductions by giving fewer rows more
threads each (on an H100 the model's own kernels gave float32 forest logits that differed from
their paths alone in every node). Attention there is `portable.attention`, whose sums are fixed
trees of elementwise additions (`portable.tree_sum`): with torch's `sum` in their place, one
node in 75 still differed on an H100; with the trees, none (7 architectures, float32 and
bfloat16, docs/benchmarks.md). There a step's time is its kernel launches, not its arithmetic,
so the portable attention keeps their number down.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from . import portable
from .build import Built, load_library

PORTABLE, AVX2, AVX512, AVX512_VNNI = 0, 1, 2, 3
LEVELS = {PORTABLE: "portable C", AVX2: "AVX2", AVX512: "AVX-512", AVX512_VNNI: "AVX-512 VNNI"}
CAPABILITY_CAPS = {"default": PORTABLE, "avx2": AVX2, "avx512": AVX512_VNNI}
"""`ATEN_CPU_CAPABILITY` (torch's instruction-set switch) -> the highest set used under it."""


class KernelsUnavailable(RuntimeError):
    """The compiled kernels are not there, for a computation that has no portable form."""


_loaded: Built | None = None


def status(*, build: bool = True, progress: Callable[[str], None] | None = None) -> Built:
    """Whether the compiled kernels are loaded (building them first where `build`), or why not.
    progress: told what is happening when a build starts (the CLI shows it)."""
    global _loaded
    if _loaded is None or (_loaded.library is None and build and not _loaded.reason.startswith("compiling")):
        outcome = load_library(build=build, progress=progress)
        if outcome.library is not None:
            _register_fakes()
        if outcome.library is not None or build:
            _loaded = outcome
        return outcome
    return _loaded


def native() -> bool:
    """Whether the compiled kernels run here (built or loaded on first call)."""
    return status().library is not None


_level: int | None = None


def level() -> int:
    """The instruction set the kernels use: the best this CPU has, capped by ATEN_CPU_CAPABILITY.
    Read once, then a plain number (a compiled forward reads it as a constant, not as an operator)."""
    global _level
    if _level is None:
        best = int(torch.ops.multidecode.best_isa()) if native() else PORTABLE
        cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
        _level = next((min(best, highest) for name, highest in CAPABILITY_CAPS.items() if cap.startswith(name)), best)
    return _level


def describe() -> str:
    """What runs the forward's products here, in words."""
    built = status(build=False)
    if built.library is None:
        return f"portable torch kernels ({built.reason})"
    return f"compiled kernels, {LEVELS[level()]}"


# ---------------------------------------------------------------------------------- the operators
ROW_TILE = 64
"""Rows per call of a product or norm on a GPU (see the module notes): one decode step's rows fit
one tile; a long prompt's take one call per 64 rows."""


def in_row_tiles(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`layer` (row by row: each output row a function of its own input row) applied to x [..., K]
    in calls of exactly `ROW_TILE` rows, zero rows padding the last; -> [..., N]. The rows are
    copied into a fresh buffer first, so every tile starts at the same alignment (a kernel's
    choice of vector loads can depend on it)."""
    count = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if count == 0:
        return layer(x)
    rows = x.new_zeros(-(-count // ROW_TILE) * ROW_TILE, x.shape[-1])  # [M padded, K]
    rows[:count] = x.reshape(count, x.shape[-1])
    outs = [layer(tile) for tile in rows.split(ROW_TILE)]
    out = (outs[0] if len(outs) == 1 else torch.cat(outs))[:count]  # [M, N]: a decode step's one tile not copied again
    return out.reshape(*x.shape[:-1], out.shape[-1])


FLAT_TILE = 16384
"""Elements per call of an elementwise layer on the CPU (`in_flat_tiles`): below torch's grain
size (32768), so one thread computes a call, and a multiple of `VECTOR_STEP`."""
VECTOR_STEP = 256
"""A multiple of every vector loop's step in torch's CPU elementwise kernels (two vectors of 32
bfloat16 lanes at most, with AVX-512)."""


def in_flat_tiles(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise `layer` (an activation: each output element a function of its own input
    element) applied to x on the CPU so that every element is computed by the same code, whatever
    the forward's row count and thread count. Why: torch's elementwise kernels run a vector loop
    and finish a run whose length is not a multiple of its step with scalar code, whose
    functions can round differently from the vector ones (float32 sigmoid, and so SiLU); where a run
    ends depends on the tensor's size and on how the threads split it, so a row's activation
    changed with the rows beside it (float32 SiLU at 3 threads and up, or a width that is no
    multiple of 32). Here x, flattened and zero-padded to a multiple of `VECTOR_STEP`, goes in
    calls of at most `FLAT_TILE` elements, each a multiple of the vector step and one thread's:
    every element takes the vector path, in which lanes do not interact."""
    count = x.numel()
    if count == 0:
        return layer(x)
    padded = -(-count // VECTOR_STEP) * VECTOR_STEP
    if padded == count and x.is_contiguous():
        flat = x.reshape(count)  # a view: a decode step's activations are not copied
    else:
        flat = x.new_zeros(padded)  # [padded]
        flat[:count] = x.reshape(count)
    outs = [layer(tile) for tile in flat.split(FLAT_TILE)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [padded]
    return out[:count].reshape(x.shape)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           isa: int | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype (see the module notes).
    Raises `KernelsUnavailable` without the compiled kernels: float products have no portable
    form with a fixed order."""
    if x.device.type != "cpu" or not native():
        if x.device.type == "cpu":
            raise KernelsUnavailable(f"exact float products need the compiled kernels: {status().reason}")
        weight, bias = weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
        return in_row_tiles(lambda tile: torch.nn.functional.linear(tile, weight, bias), x)
    return torch.ops.multidecode.linear(x, weight, bias, level() if isa is None else isa)


def qlinear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int, bits: int,
            bias: torch.Tensor | None = None, *, isa: int | None = None) -> torch.Tensor:
    """x [..., K] times packed weight codes (see `portable.pack`) -> [..., out_features] in x's dtype."""
    if native():
        return torch.ops.multidecode.qlinear(x, codes, scales, out_features, bits, bias,
                                             level() if isa is None else isa)
    return portable.qlinear(x, codes, scales, out_features, bits, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False, *,
             isa: int | None = None) -> torch.Tensor:
    """Each row of x [..., K] divided by its root mean square and weighted (see rms_norm in
    csrc/kernels_impl.h: Llama's order, or with `offset` Gemma's `1 + weight` in float32), in x's
    dtype. Only with the compiled kernels (a model keeps its own norms without them)."""
    if not native():
        raise KernelsUnavailable(f"the norm kernel needs the compiled kernels: {status().reason}")
    return torch.ops.multidecode.rms_norm(x, weight, float(eps), bool(offset), level() if isa is None else isa)


MERGE_AUTO, MERGE_PARTIALS, MERGE_GROUPS = -1, 0, 1
"""How `attention` merges a row's blocks (the same bits either way): keeping every (row, block)
partial and merging them after, or working rows that read the same blocks together and merging
as they go (no partials kept: a long prompt's); auto picks by the partials' size."""


def attention(query, key, value, unit_slots, unit_rows, unit_bits, row_pairs, pair_index, scale: float,
              softcap: float = 0.0, *, merge: int = MERGE_AUTO, isa: int | None = None,
              max_partials: int | None = None) -> torch.Tensor:
    """Exact attention of one forest's rows (see `exact` for the plan's tensors): query
    [1, H, R, D], key and value [1, H_kv, S, D] -> [1, R, H, D] in query's dtype. max_partials:
    the most partials a row has, where the caller knows it (the portable path then need not read it
    off the device)."""
    if query.device.type == "cpu" and native():
        return torch.ops.multidecode.attention(query, key, value, unit_slots, unit_rows, unit_bits, row_pairs,
                                               pair_index, float(scale), float(softcap), merge,
                                               level() if isa is None else isa)
    return portable.attention(query, key, value, unit_slots, unit_rows, unit_bits, row_pairs, pair_index, scale,
                              softcap, max_partials)


def quantize_rows(x: torch.Tensor, *, isa: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows quantized as `qlinear` quantizes them: (codes [M, K] int8, steps [M, K/32], sums [M, K/32])."""
    if native():
        return torch.ops.multidecode.quantize_rows(x, level() if isa is None else isa)
    return portable.quantize_rows(x)


def _register_fakes() -> None:
    """Shapes of the operators' outputs, for `torch.compile` and meta tensors."""
    if not hasattr(torch.ops.multidecode, "qlinear"):
        return

    @torch.library.register_fake("multidecode::linear")
    def _(x, weight, bias, isa):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("multidecode::qlinear")
    def _(x, codes, scales, out_features, bits, bias, isa):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("multidecode::attention")
    def _(query, key, value, unit_slots, unit_rows, unit_bits, row_pairs, pair_index, scale, softcap, merge, isa):
        return query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))

    @torch.library.register_fake("multidecode::rms_norm")
    def _(x, weight, eps, offset, isa):
        return x.new_empty(x.shape)

    @torch.library.register_fake("multidecode::quantize_rows")
    def _(x, isa):
        rows = x.reshape(-1, x.shape[-1])
        groups = (rows.shape[0], rows.shape[1] // 32)
        return rows.new_empty(rows.shape, dtype=torch.int8), rows.new_empty(groups, dtype=torch.float32), \
            rows.new_empty(groups, dtype=torch.float32)


__all__ = ["AVX2", "AVX512", "AVX512_VNNI", "LEVELS", "PORTABLE", "KernelsUnavailable", "attention", "describe",
           "in_flat_tiles", "level", "linear", "native", "qlinear", "quantize_rows", "rms_norm", "status"]
