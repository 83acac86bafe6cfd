"""Batch-invariant forwards: a node's logits do not depend on what else shares its forward.

A forest feeds many nodes in one forward. For its output to be *exact by construction*, every
kernel must compute a node's result from that node's inputs alone, in an order that does not
depend on the other rows of the forward or on where the node's keys sit in the cache:

- **row-count invariance**: a matrix product's row i must not change with the number of rows M
  or with the row's place among them. Measured on the project's CPU (torch 2.13): bfloat16,
  float16 and the packed int4 kernel are invariant for every M; float32 (MKL) computes rows in
  tiles of four, and the rows of a last, partial tile (and every row of M < 4) take other
  instructions. Padded to a multiple of four rows, every float32 row takes the same path. So a
  forward's rows are padded to a multiple of `row_multiple` (`probe_row_multiple` measures it
  where the code runs: 1 where every count agrees), and so are the products inside the
  attention below.
- **canonical attention**: a query's softmax and its weighted sum of values reduce over the keys
  it sees. A vectorised reduction groups terms by their index, so the same keys at other slots
  (a branch's keys are scattered through a shared cache) or beside masked ones would round
  differently. `exact_attention` therefore reduces over *positions*, never slots: the keys a query
  sees are cut into **position blocks** of `BLOCK` positions (block b holds positions
  b*BLOCK .. b*BLOCK + BLOCK - 1, one ancestor per position). Each block is gathered into its own
  [BLOCK, D] tensor in position order, so its key/value inputs are the same wherever the node was
  fed; a block gives a partial softmax (its max, its sum of exponentials, its weighted values);
  and the partials are merged over blocks in position order (a scan, whose trailing blocks of a
  shorter path add exact zeros). Masked keys contribute exact zeros inside their block.
- **sharing**: queries that read the same keys in a block (every branch reads the shared
  prefix's blocks; a prompt's tokens read their chain's blocks) read one gathered copy: a block
  is identified by its position block and its **representative**, the deepest node whose
  ancestors it holds (`plan_attention`). Rows of one block are one matrix product.

Norms reduce per row, rotary embeddings and activations are elementwise, and embeddings are
lookups: they are invariant as they are. `tests/test_exact.py` checks the whole claim by feeding
random forests and comparing every node's logits, bit for bit, with its path fed alone.

The kernel is registered as the attention implementation `"multidecode_exact"` through
transformers' public `AttentionInterface`; the engine passes each forward's `ExactPlan` as the
keyword argument `forest_plan`, which transformers hands to the attention function. Called
without a plan (transformers' own `generate`, say), it treats the cache as one sequence whose
slots are its positions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

NAME = "multidecode_exact"
BLOCK = 64
"""Positions per block: every block is reduced as a [BLOCK]-long run, whatever the path's length."""
MAX_GROUP_ROWS = 64
"""At most this many query rows read one gathered block in one product (a long prompt's blocks
are read by hundreds of rows: they are cut into groups, which row-count invariance allows)."""


@dataclass(frozen=True)
class ExactPlan:
    """How one forward's attention is cut into position blocks (see the module notes).

    slots: [U, BLOCK] long: the cache slot (in the forward's key axis) of each key of each
        gathered block, in position order; -1 where the block holds no key (masked).
    rows: [U, M] long: the query rows that read each gathered block; -1 pads.
    blocks: [U] long: the position block of each gathered block.
    num_rows: R, the query rows; num_blocks: the position blocks any row reads.
    row_multiple: the row counts the products of this dtype are invariant at (multiples of it).
    """

    slots: torch.Tensor
    rows: torch.Tensor
    blocks: torch.Tensor
    num_rows: int
    num_blocks: int
    row_multiple: int = 1
    prepared: dict = field(default_factory=dict, compare=False, repr=False)

    def layout(self, device) -> _Layout:
        """The index tensors every layer of the forward uses (made once per forward)."""
        key = str(device)
        if key not in self.prepared:
            self.prepared[key] = _Layout.of(self, device)
        return self.prepared[key]


@dataclass
class _Layout:
    """A plan's indices, as every layer of a forward uses them.

    slots: [U, BLOCK] (missing keys read slot 0: masked, and finite); rows: [U, M'] with M' the
    rows padded to a multiple of float32's row multiple (padding reads row 0);
    real: [U, M'] bool, the rows that are not padding; pairs: [P] the flat (u * M' + m) index of
    each real (row, block) partial, ordered by row then block; pair_rows: [P] their rows.
    """

    slots: torch.Tensor
    rows: torch.Tensor
    real: torch.Tensor
    pairs: torch.Tensor
    pair_rows: torch.Tensor
    biases: dict = field(default_factory=dict)

    @classmethod
    def of(cls, plan: ExactPlan, device) -> _Layout:
        width = plan.rows.shape[1]
        multiple = row_multiple(torch.float32, device)  # the products below are float32 whatever the model's dtype
        padded = -(-width // multiple) * multiple
        rows = torch.cat([plan.rows, torch.full((len(plan.rows), padded - width), -1, dtype=torch.long)], 1)
        real = rows >= 0
        flat = torch.arange(rows.numel()).reshape(rows.shape)[real]
        pair_rows = rows[real]
        order = torch.argsort(pair_rows * plan.num_blocks + plan.blocks[:, None].expand_as(rows)[real], stable=True)
        return cls(plan.slots.clamp(min=0).to(device), rows.clamp(min=0).to(device), real.to(device),
                   flat[order].to(device), pair_rows[order].to(device))

    def bias(self, plan: ExactPlan, mask, keys: int, device) -> torch.Tensor:
        """[U, M', BLOCK] float32: 0 where each gathered row may see each key of its block, -inf
        where not (cached per mask: the layers of one type share theirs)."""
        key = id(mask)
        if key not in self.biases:
            allowed = _allowed(mask, plan.num_rows, keys, device)  # [R, S]
            seen = allowed[self.rows[:, :, None], self.slots[:, None, :]]
            seen &= (plan.slots >= 0).to(device)[:, None, :] & self.real[:, :, None]
            self.biases[key] = torch.zeros(seen.shape, device=device).masked_fill_(~seen, float("-inf"))
        return self.biases[key]


def plan_attention(visible: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor,
                   parent_rows: torch.Tensor, *, row_multiple: int = 1) -> ExactPlan:
    """The plan of one forward.

    visible: [R, S] bool, True where query row r may see key slot s (itself and its ancestors;
        windows are the mask's business); key_positions: [S] long; query_positions: [R] long;
    parent_rows: [R] long, the row of each query's parent when its parent is fed in the same
        forward, else -1 (a query's chain of single children is read as one block).
    """
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
    return ExactPlan(slots, rows, blocks, rows_count, num_blocks, row_multiple)


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


def chain_plan(query_count: int, key_count: int, *, row_multiple: int = 1) -> ExactPlan:
    """The plan of one plain sequence whose cache slots are its positions: the last `query_count`
    of `key_count` tokens are fed (transformers' own decoding loop calls the kernel so)."""
    positions = torch.arange(key_count - query_count, key_count)
    visible = torch.arange(key_count)[None, :] <= positions[:, None]
    parents = torch.arange(-1, query_count - 1)
    return plan_attention(visible, torch.arange(key_count), positions, parents, row_multiple=row_multiple)


# ---------------------------------------------------------------------- the kernel
def exact_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                    forest_plan: ExactPlan | None = None, **kwargs):
    """Attention reduced over position blocks (see the module notes).

    query [B, H, R, D]; key/value [B, H_kv, S, D]; attention_mask [B, 1, R, S] additive float
    (blocked: far below zero) or bool (True: allowed) or None (causal). With a plan (the engine's),
    B is 1; without one (transformers' own loops), each row of the batch is one sequence whose
    cache holds its tokens in order, the last R of them the queries (`position_ids` say where).
    Returns ([B, R, H, D], None), as transformers' attention functions do.
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("exact attention does not support attention sinks")
    if forest_plan is not None:
        if query.shape[0] != 1:
            raise ValueError("a forest is one sequence of the batch: batch size must be 1 with a plan")
        return _attend(query, key, value, attention_mask, forest_plan, scaling, kwargs.get("softcap")), None
    outs = []
    positions = kwargs.get("position_ids")
    for b in range(query.shape[0]):
        mask = None if attention_mask is None else attention_mask[b:b + 1]
        where = None if positions is None else positions[min(b, positions.shape[0] - 1)]
        plan = _sequence_plan(mask, where, query.shape[2], key.shape[2], query.device, query.dtype)
        outs.append(_attend(query[b:b + 1], key[b:b + 1], value[b:b + 1], mask, plan, scaling, kwargs.get("softcap")))
    return torch.cat(outs), None


def _sequence_plan(mask, query_positions, rows_count: int, keys: int, device, dtype) -> ExactPlan:
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
    return plan_attention(visible, key_positions, query_positions, parents, row_multiple=row_multiple(dtype, device))


def _attend(query, key, value, attention_mask, plan: ExactPlan, scaling, softcap) -> torch.Tensor:
    """One sequence or forest (batch 1): [1, R, H, D]."""
    heads, rows_count, dim = query.shape[1:]
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    layout = plan.layout(query.device)
    bias = layout.bias(plan, attention_mask, keys, query.device)  # [U, M', BLOCK]: 0 or -inf
    scale = dim ** -0.5 if scaling is None else scaling
    queries = query[0].float()
    if softcap is None:
        queries = queries * scale  # scaling the queries scales every score, at a fraction of the cost
    # [H_kv, G, U, M', D] queries against [H_kv, 1, U, BLOCK, D] keys: one product per (head, block)
    queries = queries.reshape(kv_heads, groups, rows_count, dim)[:, :, layout.rows]
    block_keys = key[0][:, layout.slots].float()[:, None]
    block_values = value[0][:, layout.slots].float()[:, None]
    scores = _product(queries, block_keys.transpose(-1, -2))  # [H_kv, G, U, M', BLOCK]
    if softcap is not None:
        scores = softcap * torch.tanh(scores * scale / softcap)
    scores += bias
    high = scores.amax(-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).min)  # a row that sees nothing: finite
    weights = scores.sub_(high).exp_()  # masked keys: exp(-inf) = 0
    summed = torch.cat([_product(weights, block_values), weights.sum(-1, keepdim=True)], -1)  # [.., D + 1]
    out = _merge(layout, high[..., 0].reshape(heads, -1), summed.reshape(heads, -1, dim + 1), rows_count)
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype)


def _product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """The kernel's matrix products: float32, rows padded to the row multiple by the layout."""
    return torch.matmul(left, right)


def _allowed(mask, rows_count: int, keys: int, device) -> torch.Tensor:
    """Where each query may attend, as bool [R, S]."""
    if mask is None:
        return torch.ones(rows_count, keys, dtype=torch.bool, device=device).tril(keys - rows_count)
    if mask.dtype == torch.bool:
        return mask[0, 0]
    return mask[0, 0] > torch.finfo(mask.dtype).min / 2


def _merge(layout: _Layout, high: torch.Tensor, summed: torch.Tensor, rows_count: int) -> torch.Tensor:
    """Each row's output from its (row, block) partials, added in position order (`layout.pairs`
    lists each row's blocks in order, and `index_add_` adds in list order).

    high: [H, U*M'] each partial's highest score; summed: [H, U*M', D + 1] its weighted values
    and, last, the sum of its weights."""
    heads, dim = high.shape[0], summed.shape[-1]
    high, summed = high[:, layout.pairs], summed[:, layout.pairs]  # [H, P], [H, P, D + 1]
    rows = layout.pair_rows
    top = high.new_full((heads, rows_count), float("-inf")).scatter_reduce(
        1, rows[None].expand(heads, -1), high, "amax")  # [H, R]: the highest of a row's blocks
    summed *= torch.exp(high - top[:, rows])[..., None]
    total = summed.new_zeros(heads, rows_count, dim).index_add_(1, rows, summed)
    return total[..., :-1] / total[..., -1:].clamp(min=torch.finfo(torch.float32).tiny)  # a row that sees nothing: 0


# ---------------------------------------------------------------------- rows and registration
MULTIPLES = (1, 2, 4, 8, 16)


@functools.cache
def _probe(dtype: torch.dtype, device: str) -> int:
    """The smallest row multiple at which products of `dtype` are row-count invariant here."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for inner, outer in ((64, 64), (64, 257), (576, 1536)):
        right = torch.randn(outer, inner, generator=generator).to(device=device, dtype=dtype)
        row = torch.randn(1, inner, generator=generator).to(device=device, dtype=dtype)
        cases.append((right, row, torch.randn(160, inner, generator=generator).to(device=device, dtype=dtype)))
    for multiple in MULTIPLES:
        if all(_invariant(right, row, filler, multiple) for right, row, filler in cases):
            return multiple
    return 0


def _invariant(right, row, filler, multiple: int) -> bool:
    """Whether `row`'s product is the same at every place of every multiple of `multiple` rows (up to 160)."""
    reference = None
    for count in range(multiple, 161, multiple):
        for place in sorted({0, count // 2, count - 1}):
            rows = filler[:count].clone()
            rows[place] = row[0]
            got = (rows @ right.T)[place]
            reference = got if reference is None else reference
            if not torch.equal(got, reference):
                return False
    return True


def probe_row_multiple(dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """The row multiple at which matrix products of `dtype` are row-count invariant here (1: any
    count; 0: none up to 16, so forwards in this dtype are not batch-invariant here)."""
    return _probe(dtype, str(device))


def row_multiple(dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """`probe_row_multiple`, at least 1 (a kernel that is not invariant is used as it is)."""
    return max(1, probe_row_multiple(dtype, device))


def register() -> None:
    """Make `"multidecode_exact"` a known attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, exact_attention)
    AttentionMaskInterface.register(NAME, eager_mask)


def use_exact_attention(model) -> None:
    """Switch `model` to the batch-invariant attention (its weights and modules are untouched)."""
    register()
    model.set_attn_implementation(NAME)


def is_exact(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NAME


__all__ = ["BLOCK", "NAME", "ExactPlan", "chain_plan", "exact_attention", "is_exact", "plan_attention",
           "probe_row_multiple", "register", "row_multiple", "use_exact_attention"]
