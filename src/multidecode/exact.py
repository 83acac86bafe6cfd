"""Batch-invariant forwards: a node's logits do not depend on what else shares its forward.

A forest feeds many nodes in one forward. For its output to be *exact by construction*, every
kernel must compute a node's result from that node's inputs alone, in an order that does not
depend on the other rows of the forward or on where the node's keys sit in the cache:

- **products**: every linear layer and the LM head run on `kernels` (`kernels.linear`,
  `kernels.qlinear`), whose outputs are each reduced in one fixed order by one thread: a row's
  result does not depend on the number of rows, the other rows or the thread count, by the
  kernel's definition rather than by a measurement of someone else's kernel.
- **canonical attention**: a query's softmax and its weighted sum of values reduce over the keys
  it sees. A vectorised reduction groups terms by their index, so the same keys at other slots
  (a branch's keys are scattered through a shared cache) or beside masked ones would round
  differently. `exact_attention` therefore reduces over *positions*, never slots: the keys a query
  sees are cut into **position blocks** of `BLOCK` positions (block b holds positions
  b*BLOCK .. b*BLOCK + BLOCK - 1, one ancestor per position). A block gives a partial softmax (its
  max, its sum of exponentials, its weighted values, each summed in position order over the keys
  the row sees), and the partials are merged in position order; keys a row does not see are
  skipped, not added as zeros. The kernel is `kernels.attention` (its definition is in
  `kernels/csrc/kernels_impl.h`): one pass, no dense mask, no copy of K and V per query head.
- **sharing**: queries that read the same keys in a block (every branch reads the shared
  prefix's blocks; a prompt's tokens read their chain's blocks) read one gathered copy: a block
  is identified by its position block and its **representative**, the deepest node whose
  ancestors it holds (`plan_attention`); a **unit** is such a block and the rows that read it.
  Sharing changes which keys are loaded together, never a row's arithmetic.

- **activations**: elementwise, but torch's CPU loops compute a run's last few elements (those
  short of a whole vector step) with scalar code, whose sigmoid rounds differently from the
  vector code, and where a run ends depends on the forward's size and thread count: a row's SiLU
  changed with the rows beside it. Each activation layer runs in `kernels.in_flat_tiles`, which
  hands torch only runs of whole vector steps, one thread each (`ExactActivation`).

Norms reduce per row, rotary embeddings are elementwise (torch's scalar and vector cos and sin
agree), and embeddings are lookups: they are invariant as they are (see `kernels`).
`tests/test_exact.py` checks the whole claim by feeding random forests and comparing every node's
logits, bit for bit, with its path fed alone, at one thread and at two (and at three, where an
MLP is wide enough for torch to split its activation among threads).

The kernel is registered as the attention implementation `"multidecode_exact"` through
transformers' public `AttentionInterface`; the engine passes each forward's `ExactPlan` as the
keyword argument `forest_plan`, which transformers hands to the attention function. Called
without a plan (transformers' own `generate`, say), it treats the cache as one sequence whose
slots are its positions.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from . import kernels
from .errors import NotBitExact
from .kernels.portable import BLOCK
from .models.packed import activation_dtype, weights_device
from .models.reading import quiet_transformers
from .models.vetting import check_is_model, check_supported

NAME = "multidecode_exact"
PROBE = "multidecode_exact_probe"
"""The attention name of the one forward `use_exact_kernels` counts attention calls in."""
MAX_GROUP_ROWS = 64
"""At most this many query rows share one unit (a long prompt's blocks are read by hundreds of
rows: they are cut into groups; a row's arithmetic does not depend on the others in its unit)."""


@dataclass(frozen=True)
class ExactPlan:
    """How one forward's attention is cut into position blocks (see the module notes).

    slots: [U, BLOCK] long: the cache slot (in the forward's key axis) of each key of each
        gathered block, in position order; -1 where the block holds no key (masked).
    rows: [U, M] long: the query rows that read each gathered block; -1 pads.
    blocks: [U] long: the position block of each gathered block.
    num_rows: R, the query rows; num_blocks: the position blocks any row reads.
    """

    slots: torch.Tensor
    rows: torch.Tensor
    blocks: torch.Tensor
    num_rows: int
    num_blocks: int
    prepared: dict = field(default_factory=dict, compare=False, repr=False)

    def layout(self, device) -> _Layout:
        """The index tensors every layer of the forward uses (made once per forward)."""
        key = str(device)
        if key not in self.prepared:
            self.prepared[key] = _Layout.of(self, device)
        return self.prepared[key]


@dataclass
class _Layout:
    """A plan's indices as `kernels.attention` takes them (int32), made once per forward.

    unit_slots: [U, BLOCK]; unit_rows: [U, W]; row_pairs: [R + 1] and pair_index: [P], each
    row's (unit, place) partials as u * W + w, in position order (`row_pairs[r]` to
    `row_pairs[r + 1]`); max_partials: the most partials a row has (kept on the host: a GPU's
    attention would otherwise wait for the device to read it, once per layer); bits: per mask,
    [U, W] int64, bit j set where the row sees the unit's position j (the layers of one type share
    theirs).
    """

    unit_slots: torch.Tensor
    unit_rows: torch.Tensor
    row_pairs: torch.Tensor
    pair_index: torch.Tensor
    max_partials: int
    bits: dict = field(default_factory=dict)

    @classmethod
    def of(cls, plan: ExactPlan, device) -> _Layout:
        width = plan.rows.shape[1]
        real = plan.rows >= 0
        pair_rows = plan.rows[real]  # [P]
        flat = torch.arange(plan.rows.numel()).reshape(plan.rows.shape)[real]
        order = torch.argsort(pair_rows * plan.num_blocks + plan.blocks[:, None].expand(-1, width)[real], stable=True)
        counts = torch.bincount(pair_rows, minlength=plan.num_rows)
        row_pairs = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        return cls(plan.slots.to(device, torch.int32), plan.rows.to(device, torch.int32),
                   row_pairs.to(device, torch.int32), flat[order].to(device, torch.int32),
                   int(counts.max()) if len(counts) else 0)

    def visible_bits(self, plan: ExactPlan, mask, keys: int, device) -> torch.Tensor:
        """[U, W] int64: which of each unit's positions each of its rows may see under `mask`."""
        key = id(mask)
        if key not in self.bits:
            allowed = _allowed(mask, plan.num_rows, keys, device)  # [R, S]
            rows, slots = plan.rows.to(device), plan.slots.to(device)
            seen = allowed[rows.clamp(min=0)[:, :, None], slots.clamp(min=0)[:, None, :]]  # [U, W, BLOCK]
            seen &= (slots >= 0)[:, None, :] & (rows >= 0)[:, :, None]
            self.bits[key] = (seen.long() << torch.arange(BLOCK, device=device)).sum(-1)
        return self.bits[key]


def plan_attention(visible: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor,
                   parent_rows: torch.Tensor, **_unused) -> ExactPlan:
    """The plan of one forward.

    visible: [R, S] bool, True where query row r may see key slot s (itself and its ancestors;
        windows are the mask's business); key_positions: [S] long; query_positions: [R] long;
    parent_rows: [R] long, the row of each query's parent when its parent is fed in the same
        forward, else -1 (a query's chain of single children is read as one block).
    """
    rows_count = visible.shape[0]
    if rows_count == 1:
        return one_row_plan(visible, key_positions, query_positions)
    return forest_plan(visible, key_positions, query_positions, parent_rows)


def one_row_plan(visible: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor) -> ExactPlan:
    """`forest_plan` of a forward of one row (a stream's decode step), in a few operations instead
    of some forty: the row reads each of its blocks alone, so every block is its own unit, in
    block order, its slots the row's ancestors at the block's positions."""
    num_blocks = int(query_positions[0]) // BLOCK + 1
    ancestors = torch.full((num_blocks * BLOCK,), -1, dtype=torch.long)
    (slot_index,) = visible[0].nonzero(as_tuple=True)
    ancestors[key_positions[slot_index]] = slot_index
    return ExactPlan(ancestors.view(num_blocks, BLOCK), torch.zeros((num_blocks, 1), dtype=torch.long),
                     torch.arange(num_blocks), 1, num_blocks)


def forest_plan(visible: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor,
                parent_rows: torch.Tensor) -> ExactPlan:
    """`plan_attention` of any forward (see its arguments)."""
    rows_count = visible.shape[0]
    num_blocks = int(query_positions.max()) // BLOCK + 1
    width = num_blocks * BLOCK
    # ancestors[r, p]: the slot of row r's ancestor at position p (-1: none, past its position)
    ancestors = torch.full((rows_count, width), -1, dtype=torch.long)
    row_index, slot_index = visible.nonzero(as_tuple=True)
    ancestors[row_index, key_positions[slot_index]] = slot_index
    row_slots = ancestors[torch.arange(rows_count), query_positions]
    end = _chain_ends(parent_rows, query_positions)
    own = query_positions // BLOCK  # [R]

    # one pair (row, block) per block a row reads: its complete blocks, then its own
    counts = own + 1
    pair_row = torch.repeat_interleave(torch.arange(rows_count), counts)  # [pairs]
    pair_block = torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    last = pair_block == own[pair_row]
    source = torch.where(last, end[pair_row], pair_row)  # the row whose ancestors fill the block
    block_end = (pair_block + 1) * BLOCK - 1
    rep = torch.where(last, row_slots[end[pair_row]], ancestors[pair_row, block_end.clamp(max=width - 1)])
    key = pair_block * (visible.shape[1] + 1) + rep
    unique, inverse = torch.unique(key, return_inverse=True)
    first = torch.full((len(unique),), len(key), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(key)), reduce="amin")
    blocks = pair_block[first]
    offsets = blocks[:, None] * BLOCK + torch.arange(BLOCK)  # [U, BLOCK] positions
    slots = ancestors[source[first][:, None], offsets]
    slots, rows, blocks = _groups(slots, blocks, inverse, pair_row, len(unique))
    return ExactPlan(slots, rows, blocks, rows_count, num_blocks)


def _chain_ends(parent_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """For each row, the deepest row reached by following single children within its position
    block: the representative of the row's own block (a prompt's rows share their chain's)."""
    rows_count = len(parent_rows)
    has_parent = parent_rows >= 0
    children = torch.bincount(parent_rows[has_parent], minlength=rows_count)
    child = torch.arange(rows_count)
    child[parent_rows[has_parent]] = torch.arange(rows_count)[has_parent]
    same_block = (positions[child] // BLOCK) == (positions // BLOCK)
    step = torch.where((children == 1) & same_block, child, torch.arange(rows_count))
    for _ in range(BLOCK.bit_length()):  # pointer jumping: 2^k single steps after k rounds
        step = step[step]
    return step


def _groups(slots: torch.Tensor, blocks: torch.Tensor, inverse: torch.Tensor, pair_row: torch.Tensor,
            unique: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of each gathered block as a padded [U', M] table, a block read by more than
    `MAX_GROUP_ROWS` rows cut into several entries (its slots repeated)."""
    order = torch.argsort(inverse, stable=True)
    group = inverse[order]
    sizes = torch.bincount(group, minlength=unique)
    rank = torch.arange(len(group)) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)
    parts = (sizes + MAX_GROUP_ROWS - 1) // MAX_GROUP_ROWS
    part_start = parts.cumsum(0) - parts
    entry = part_start[group] + rank // MAX_GROUP_ROWS
    width = int(min(int(sizes.max()), MAX_GROUP_ROWS))
    table = torch.full((int(parts.sum()), width), -1, dtype=torch.long)
    table[entry, rank % MAX_GROUP_ROWS] = pair_row[order]
    owner = torch.repeat_interleave(torch.arange(unique), parts)
    return slots[owner], table, blocks[owner]


def chain_plan(query_count: int, key_count: int) -> ExactPlan:
    """The plan of one plain sequence whose cache slots are its positions: the last `query_count`
    of `key_count` tokens are fed (transformers' own decoding loop calls the kernel so)."""
    positions = torch.arange(key_count - query_count, key_count)
    visible = torch.arange(key_count)[None, :] <= positions[:, None]
    parents = torch.arange(-1, query_count - 1)
    return plan_attention(visible, torch.arange(key_count), positions, parents)


# ---------------------------------------------------------------------- the kernel
def plan_tensors(plan: ExactPlan, masks: list, keys: int, device, offset: int = 0) -> dict:
    """A plan as the tensors a compiled forward takes (`forest_units`, see `exact_attention`): the
    layout's indices and each layer's visible bits (`masks`: each layer's mask, those of one type
    the same object), the slots moved up by `offset` (the forward reads the cache's whole buffers,
    not a window from `offset` on). Nothing in it is a Python object the graph would have to guard."""
    layout = plan.layout(device)
    slots = layout.unit_slots if not offset else torch.where(layout.unit_slots >= 0, layout.unit_slots + offset,
                                                            layout.unit_slots)
    bits = [layout.visible_bits(plan, mask, keys, device) for mask in masks]
    return {"slots": slots, "rows": layout.unit_rows, "row_pairs": layout.row_pairs, "pair_index": layout.pair_index,
            "bits": bits}


def exact_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                    forest_plan: ExactPlan | None = None, forest_units: dict | None = None, **kwargs):
    """Attention reduced over position blocks (see the module notes).

    forest_units: the plan as tensors (`plan_tensors`), given by a compiled forward in place of
    `forest_plan`; the mask is then not read (each layer's visible bits are in it).

    query [B, H, R, D]; key/value [B, H_kv, S, D]; attention_mask [B, 1, R, S] additive float
    (blocked: far below zero) or bool (True: allowed) or None (causal). With a plan (the engine's),
    B is 1; without one (transformers' own loops), each row of the batch is one sequence whose
    cache holds its tokens in order, the last R of them the queries (`position_ids` say where).
    Returns ([B, R, H, D], None), as transformers' attention functions do.
    """
    if kwargs.get("s_aux") is not None:
        raise NotBitExact("the model's attention has sinks (a learned logit per head beside the keys), which the "
                          "exact attention kernel does not take", own_kernels_hint(query.dtype))
    width = value.shape[-1]
    if width != key.shape[-1]:  # multi-head latent attention: values narrower than keys
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        query, key, value = _one_head_dim(query, key, value)
        out, _ = exact_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                 forest_plan, forest_units, **kwargs)
        return out[..., :width], None
    if forest_units is not None:
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return kernels.attention(query, key, value, forest_units["slots"], forest_units["rows"],
                                 forest_units["bits"][module.layer_idx], forest_units["row_pairs"],
                                 forest_units["pair_index"], scale, kwargs.get("softcap") or 0.0), None
    if forest_plan is not None:
        if query.shape[0] != 1:
            raise ValueError("a forest is one sequence of the batch: batch size must be 1 with a plan")
        return _attend(query, key, value, attention_mask, forest_plan, scaling, kwargs.get("softcap")), None
    outs = []
    positions = kwargs.get("position_ids")
    for b in range(query.shape[0]):
        mask = None if attention_mask is None else attention_mask[b:b + 1]
        where = None if positions is None else positions[min(b, positions.shape[0] - 1)]
        plan = _sequence_plan(mask, where, query.shape[2], key.shape[2])
        outs.append(_attend(query[b:b + 1], key[b:b + 1], value[b:b + 1], mask, plan, scaling, kwargs.get("softcap")))
    return torch.cat(outs), None


def _one_head_dim(query, key, value):
    """query, key and value widened to one head dim, as the attention kernel takes them. Models
    with multi-head latent attention (DeepSeek-V3, MiniCPM3) give values narrower than keys: the
    narrower side gets columns of zeros, which add exactly nothing to a dot product or to a weighted
    sum, and each output column is a sum of its own, so the caller cuts the output back to the
    values' width and every row and branch is computed as it would be alone."""
    wide = max(key.shape[-1], value.shape[-1])
    return tuple(torch.nn.functional.pad(x, (0, wide - x.shape[-1])) for x in (query, key, value))


def _sequence_plan(mask, query_positions, rows_count: int, keys: int) -> ExactPlan:
    """The plan of one plain sequence: keys are its tokens in order (the last `rows_count` the
    queries). A key no query may see (padding, on the left or inside the sequence after a cached
    prefix) is no one's ancestor and takes no position: the others count their positions past it,
    as transformers counts position ids from the attention mask. Without a mask, key j sits
    `keys - 1 - j` positions before the last query."""
    if query_positions is None:
        query_positions = torch.arange(keys - rows_count, keys)
    query_positions = query_positions.to("cpu", torch.long)
    seen = _allowed(mask, rows_count, keys, "cpu").any(0)  # [S]: keys some query sees
    if mask is None:
        key_positions = (query_positions[-1] - (keys - 1 - torch.arange(keys))).clamp(min=0)
    else:  # [S]: the real keys' positions, padding skipped
        key_positions = (seen.long().cumsum(0) - 1 + (query_positions[-1] - (int(seen.sum()) - 1))).clamp(min=0)
    visible = (key_positions[None, :] <= query_positions[:, None]) & seen[None, :]
    parents = torch.arange(-1, rows_count - 1)
    return plan_attention(visible, key_positions, query_positions, parents)


def _attend(query, key, value, attention_mask, plan: ExactPlan, scaling, softcap) -> torch.Tensor:
    """One sequence or forest (batch 1): [1, R, H, D]."""
    layout = plan.layout(query.device)
    bits = layout.visible_bits(plan, attention_mask, key.shape[2], query.device)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return kernels.attention(query, key, value, layout.unit_slots, layout.unit_rows, bits, layout.row_pairs,
                             layout.pair_index, scale, softcap or 0.0, max_partials=layout.max_partials)


def _allowed(mask, rows_count: int, keys: int, device) -> torch.Tensor:
    """Where each query may attend, as bool [R, S]."""
    if mask is None:
        return torch.ones(rows_count, keys, dtype=torch.bool, device=device).tril(keys - rows_count)
    if mask.dtype == torch.bool:
        return mask[0, 0].to(device)
    return (mask[0, 0] > torch.finfo(mask.dtype).min / 2).to(device)


# ---------------------------------------------------------------------- a model on the exact kernels
class ExactLinear(nn.Module):
    """A linear layer computed by `kernels.linear` (each output reduced in one fixed order), over
    the parameters of the `nn.Linear` it stands for (shared, not copied; GPT-2's `Conv1D`, whose
    weight is [in, out], gets its weight transposed once)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    @classmethod
    def of(cls, layer: nn.Module) -> ExactLinear | None:
        """The exact stand-in of a linear layer, or None for any other module."""
        if isinstance(layer, nn.Linear):
            weight = layer.weight if layer.weight.is_contiguous() else nn.Parameter(layer.weight.detach().contiguous(),
                                                                                      requires_grad=False)
            return cls(weight, layer.bias)
        if type(layer).__name__ == "Conv1D" and getattr(layer, "weight", None) is not None:
            return cls(nn.Parameter(layer.weight.detach().T.contiguous(), requires_grad=False), layer.bias)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ExactRMSNorm(nn.Module):
    """An RMSNorm layer computed by `kernels.rms_norm` (one fused kernel, its mean of squares
    summed in one fixed order) over the weight of the layer it stands for (shared). Swapped in
    only where the compiled kernels run and where it computes what the layer computes: each
    candidate arithmetic (Llama's, Gemma's `1 + weight`) is run beside the layer on a few random
    rows, and one that agrees to rounding is kept (`of`); any other layer keeps its own code, whose
    reduction is per row too (see `kernels`). Why: a norm is 8 small torch operations, 16 a layer;
    one call instead saves about a tenth of a one-row step."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: bool) -> None:
        super().__init__()
        self.weight, self.eps, self.offset = weight, float(eps), offset

    @classmethod
    def of(cls, layer: nn.Module) -> ExactRMSNorm | None:
        """The kernel's stand-in of an RMSNorm layer, or None (another module, or arithmetic the kernel lacks)."""
        weight = getattr(layer, "weight", None)
        eps = getattr(layer, "variance_epsilon", getattr(layer, "eps", None))
        if not (type(layer).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
                and isinstance(eps, float) and weight.dtype in (torch.float32, torch.bfloat16)
                and weight.device.type == "cpu" and weight.is_contiguous() and kernels.native()):
            return None
        generator = torch.Generator().manual_seed(0)
        rows = torch.randn(4, weight.shape[0], generator=generator).mul(3).to(weight.dtype)
        probe = copy.deepcopy(layer)  # random weights: a layer's own (ones, zeros) could make two arithmetics agree
        with torch.no_grad():
            probe.weight.copy_(torch.randn(weight.shape, generator=generator))
            expected = probe(rows)
            for offset in (False, True):
                got = cls(probe.weight, eps, offset)(rows)
                if got.dtype == expected.dtype and torch.allclose(got.float(), expected.float(), rtol=2 ** -6,
                                                                  atol=1e-6):
                    return cls(weight, eps, offset)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # a model moved to another device after its swap: torch's kernels there
            return kernels.in_row_tiles(lambda rows: torch_rms_norm(rows, self.weight, self.eps, self.offset), x)
        return kernels.rms_norm(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}"


class ExactActivation(nn.Module):
    """An activation layer (SiLU, GELU, ...: elementwise) computed in `kernels.in_flat_tiles`, so
    that every element takes torch's vector code whatever the forward's row count and thread
    count (the layer is kept whole, under `layer.`, and put back by `Swapped.restore`). Swapped in
    on the CPU for the activation classes of transformers and torch, whose outputs are each a
    function of one input element; a model that calls an activation as a function keeps torch's
    loops there. Compiled (`multidecode.compiled`), the layer runs as it is: inductor generates
    its own loops."""

    ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.Sigmoid, nn.Tanh, nn.SiLU, nn.GELU, nn.Hardswish, nn.LeakyReLU, nn.Mish,
                   nn.ELU, nn.Softplus)
    """torch's activation layers that are elementwise (not PReLU, whose weight is per channel)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    @classmethod
    def of(cls, layer: nn.Module, device: torch.device) -> ExactActivation | None:
        """The stand-in of an elementwise activation layer of a model on the CPU, or None."""
        ours = type(layer).__module__ == "transformers.activations" or isinstance(layer, cls.ELEMENTWISE)
        return cls(layer) if ours and device.type == "cpu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or torch.compiler.is_compiling():
            return self.layer(x)
        return kernels.in_flat_tiles(self.layer, x)

    def extra_repr(self) -> str:
        return f"in flat tiles of at most {kernels.FLAT_TILE} elements"


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """`kernels.rms_norm`'s arithmetic in torch's own operations (its mean of squares in torch's
    order): where the kernel does not run (another device)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return normed.to(x.dtype) * weight.to(x.dtype)


class RowTiledNorm(nn.Module):
    """A norm layer of a model on a GPU (a module whose class is named ...RMSNorm or ...LayerNorm,
    with or without a weight), its own code run in row tiles (`kernels.in_row_tiles`): torch's
    reductions there give fewer rows more threads each, so a row's mean of squares would change
    with the forward's row count; in tiles of one size every call has one thread layout. The
    layer is kept whole (its arithmetic, its parameters, now under `layer.`) and put back by
    `Swapped.restore`."""

    NAMES = ("RMSNorm", "LayerNorm")

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    @classmethod
    def of(cls, layer: nn.Module, device: torch.device) -> RowTiledNorm | None:
        """The tiled stand-in of a norm layer of a model on `device`, or None (on the CPU, whose
        reductions keep one order per row, or for another module)."""
        if device.type != "cpu" and type(layer).__name__.endswith(cls.NAMES):
            return cls(layer)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.in_row_tiles(self.layer, x)

    def extra_repr(self) -> str:
        return f"rows in tiles of {kernels.ROW_TILE}"


@dataclass
class Swapped:
    """What `use_exact_kernels` changed in a model, to put back (`restore`)."""

    layers: list[tuple[nn.Module, str, nn.Module]]
    attention: str

    def restore(self, model) -> None:
        for parent, name, layer in self.layers:
            setattr(parent, name, layer)
        _set_attention(model, self.attention)


def use_exact_kernels(model) -> Swapped:
    """Put `model` on the exact kernels: every linear layer becomes an `ExactLinear` (sharing its
    parameters; packed layers compute on `kernels` already), every RMSNorm the kernel can compute
    an `ExactRMSNorm` (on a GPU every norm layer a `RowTiledNorm`), every activation layer on the
    CPU an `ExactActivation`, and attention becomes
    `exact_attention`. Refuses (`UnsupportedModel`, nothing changed) a model that would still
    compute somewhere on torch's own products: weights of other shapes (a mixture of experts'
    stacked experts, say), or attention layers that do not go through transformers' attention
    interface (`NotBitExact`). Returns what changed (`Swapped.restore` puts it back)."""
    check_supported(model)
    dtype, device = activation_dtype(model), weights_device(model)
    if dtype not in (torch.float32, torch.bfloat16):
        raise NotBitExact(f"the exact kernels compute in float32 and bfloat16, and this model is in "
                          f"{str(dtype).removeprefix('torch.')}",
                          "load it in bfloat16 or float32, or with exact=False")
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for _, parent in list(model.named_modules()):
        if isinstance(parent, (RowTiledNorm, ExactActivation)):  # already swapped: its layer stays inside
            continue
        for name, layer in list(parent.named_children()):
            exact = (ExactLinear.of(layer) or ExactRMSNorm.of(layer) or RowTiledNorm.of(layer, device)
                     or ExactActivation.of(layer, device))
            if exact is not None:
                setattr(parent, name, exact)
                swapped.append((parent, name, layer))
    change = Swapped(swapped, getattr(model.config, "_attn_implementation", None) or "eager")
    try:
        float_products = any(isinstance(getattr(parent, name), ExactLinear) for parent, name, _ in swapped)
        if float_products and device.type == "cpu" and not kernels.native():
            raise NotBitExact(f"exact float products need multidecode's compiled kernels: {kernels.status().reason}",
                                   "install a C++ compiler (g++) and run `python -m multidecode.kernels`, or load the "
                                   f"model at precision int8 or int4; or {own_kernels_hint(dtype)}")
        _check_every_product_is_exact(model)
        register()
        _set_attention(model, NAME)
    except BaseException:
        change.restore(model)
        raise
    return change


@contextmanager
def exact_kernels(model):
    """`model` on the exact kernels for the length of a `with` block, as it was afterwards (a model
    already on them stays as it is; see `hold_exact_kernels` for several users at once)."""
    release = hold_exact_kernels(model)
    try:
        yield model
    finally:
        release()


@dataclass
class _Hold:
    change: Swapped | None  # None: the model was on the exact kernels before its first user came
    users: int = 0


_HOLDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Hold, while it has users
_HOLDS_LOCK = threading.RLock()
"""Re-entrant: a release may come from a finalizer (a `MultiDecoder` collected), which the garbage
collector can run on a thread that holds the lock already, in the middle of a swap."""


def hold_exact_kernels(model) -> Callable[[], None]:
    """Put `model` on the exact kernels for one user, and return that user's release. Users may
    overlap (streams on one model, threads decoding with one model): the first swaps the kernels
    in, the last release puts the model back as the first found it, and none sees it half
    swapped or put back while it decodes."""
    check_is_model(model)
    with _HOLDS_LOCK:
        hold = _HOLDS.get(model)
        if hold is None:
            hold = _Hold(None if is_exact(model) else use_exact_kernels(model))
            _HOLDS[model] = hold
        hold.users += 1
    released = False

    def release() -> None:
        nonlocal released
        with _HOLDS_LOCK:
            if released:  # a user's release counts once (a stream closed, then collected)
                return
            released = True
            hold.users -= 1
            if hold.users == 0:
                del _HOLDS[model]
                if hold.change is not None:
                    hold.change.restore(model)

    return release


def _check_every_product_is_exact(model) -> None:
    """Refuse a model with matrices that no exact kernel multiplies, or attention layers that
    bypass the attention interface (counted in one probe forward of two tokens)."""
    dtype = activation_dtype(model)
    covered = {id(m.weight) for m in model.modules() if isinstance(m, (ExactLinear, nn.Embedding))}
    stray = [name for name, p in model.named_parameters() if p.dim() >= 2 and id(p) not in covered]
    if stray:
        raise NotBitExact(f"{', '.join(stray[:3])} {'is' if len(stray) == 1 else 'are'} multiplied by torch's own "
                               "kernels (not a linear layer), whose reduction order multidecode does not fix",
                               own_kernels_hint(dtype))
    calls, told = _attention_calls(model)
    layers = getattr(model.config.get_text_config(), "num_hidden_layers", calls)
    if calls < layers:
        raise NotBitExact(f"{layers - calls} of the model's {layers} attention layers do not go through "
                               "transformers' attention interface, so they cannot take the exact kernel",
                               own_kernels_hint(dtype))
    if told < calls:
        raise NotBitExact(f"{calls - told} of the model's {calls} attention calls do not receive the keyword "
                          "arguments given to its forward (its decoder layers do not pass them on), so a forest's "
                          "attention plan cannot reach them", own_kernels_hint(dtype) + "; the forest then reaches attention as a mask")


_PROBE_KWARG = "multidecode_probe"
"""A keyword the probe forward is given, as the engine gives `forest_plan`: each attention call
that receives it is reached by the engine's keywords (StableLM's and Nemotron's decoder layers
in transformers 5.24 do not pass their keywords on; without this check their forests would
attend as one plain sequence, silently wrong)."""


def _attention_calls(model) -> tuple[int, int]:
    """How many attention calls one forward of `model` makes through the attention interface, and
    how many of them receive the keyword arguments given to the model's forward."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    calls, told = [], []
    marker = object()

    def counting(module, query, key, value, attention_mask, **kwargs):
        calls.append(module)
        if kwargs.pop(_PROBE_KWARG, None) is marker:
            told.append(module)
        return exact_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(PROBE, counting)
    AttentionMaskInterface.register(PROBE, eager_mask)
    before = getattr(model.config, "_attn_implementation", None) or "eager"
    _set_attention(model, PROBE)
    try:
        device = weights_device(model)
        with torch.inference_mode():
            model(input_ids=torch.tensor([[1, 2]], device=device), use_cache=False, **{_PROBE_KWARG: marker})
    finally:
        _set_attention(model, before)
    return len(calls), len(told)


def _set_attention(model, name: str) -> None:
    """`model`'s attention implementation set to `name`, transformers silent (a model whose layers
    bypass the attention interface, Falcon's, logs a warning on every change; the probe that finds
    such layers refuses them in words of its own)."""
    with quiet_transformers(loading=False):
        model.set_attn_implementation(name)


def register() -> None:
    """Make `"multidecode_exact"` a known attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, exact_attention)
    AttentionMaskInterface.register(NAME, eager_mask)


def own_kernels_exactness(dtype: torch.dtype) -> str:
    """What a forest on the model's own kernels (`exact=False`) promises at `dtype`, in words:
    exact to the token in float32; in a half precision its masked forward rounds otherwise than a
    branch alone, and a near-tie can break the other way (docs/design.md)."""
    if dtype == torch.float32:
        return "exact to the token, not the bit"
    name = str(dtype).removeprefix("torch.")
    return f"in {name} a near-tie can break otherwise than for a branch alone; in float32 it is exact to the token"


def own_kernels_hint(dtype: torch.dtype) -> str:
    """The remedy a refusal of the exact kernels names: the model's own kernels, in float32 where
    only there they keep a branch's tokens; named as each entry point takes it (a model the user
    holds is not loaded again)."""
    where = "" if dtype == torch.float32 else " in float32"
    return (f"run it{where} with exact=False, on the model's own kernels ({own_kernels_exactness(dtype)}): "
            "load(..., exact=False), MultiDecoder(model, tokenizer, exact=False) or decode(..., exact=False)")


def is_exact(model) -> bool:
    """Whether `model` runs on the exact kernels (its attention, and no linear layer left on torch's)."""
    if getattr(model.config, "_attn_implementation", None) != NAME:
        return False
    return not any(isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" for m in model.modules())


__all__ = ["BLOCK", "NAME", "ExactActivation", "ExactLinear", "ExactPlan", "ExactRMSNorm", "RowTiledNorm", "Swapped",
           "chain_plan", "exact_attention", "exact_kernels", "forest_plan", "is_exact", "one_row_plan", "own_kernels_exactness",
           "own_kernels_hint", "plan_attention", "plan_tensors",
           "register", "torch_rms_norm", "use_exact_kernels"]
