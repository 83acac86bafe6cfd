"""The packed weights' layout, and the kernels' definitions in torch: the portable path.

**Layout** (`pack`, `unpack_rows`): a weight of N outputs by K inputs, K in groups of 32, is cut
into panels of 16 outputs. Per panel and group, 64-byte chunks hold 4 bytes per output (lane):
for 4-bit codes (0..15), chunk c's byte 4l + b holds the codes of inputs 32g + 8c + b (low half)
and 32g + 8c + 4 + b (high half), 4 chunks; for 8-bit codes (-127..127, signed bytes), chunk c's
byte 4l + b is input 32g + 4c + b, 8 chunks. Steps (and, for 4 bits, lows) are float16, per panel
and group: 16 steps then 16 lows, held as int16 (their float16 bits: a model's `.to(dtype)`
converts floating-point buffers, and must leave these as they are). A weight is
`step * code + low` (8 bits: `step * code`). 4-bit codes **centred** on 8 (GGUF's Q4_0, whose low
is -8 step) keep no lows: `step * (code - 8)`, the low computed as -8 step (exact), a tenth fewer
bytes; which form a layout holds is told by its scales' size (`halves`). This is the order the
compiled kernel's integer dot products read (4 bytes per lane per instruction).

**Portable kernels**: where no compiler built the compiled ones, the same definitions run here
(`qlinear`, `quantize_rows`, `attention`), each output computed from its own row: integer dot
products as float32 products of integers (exact: every partial sum is an integer below 2^24, so
any order gives it), groups combined by elementwise operations one after the other, attention's
sums as fixed trees of elementwise additions (`tree_sum`). Elementwise operations give each
element the same bits whatever the tensor's shape, on every device: this is also the GPU's
attention.
They are slower, and need not equal the compiled kernels' bits (a fused multiply-add rounds once
where torch's elementwise operations round twice): each path is exact within itself.
"""

from __future__ import annotations

import torch

GROUP = 32
"""Weights per group (a GGUF block: every 4- and 8-bit GGUF format this reads has 32-weight groups)."""
LANES = 16
BLOCK = 64
"""Positions per attention block: every block is reduced as a [BLOCK]-long run, whatever the path's length."""
ROWS_AT_ONCE = 64
"""Rows the portable products take at once (their float32 partials are [groups, rows, N])."""
PARTIALS_AT_ONCE = 1 << 21
"""Float32 values the portable attention holds at once in its largest temporary on a CPU: the
products of the units it takes together ([H, units, rows, 64, D]), and the partials it combines
together ([H, rows, partials, D]). 8 MB stay near the cores (measured: a step of 8 rows over
1,399 tokens, one thread, 6.5 ms, against 41 ms at 64 MB and 12 ms for the merge loop before)."""
PARTIALS_AT_ONCE_GPU = 1 << 24
"""The same on a GPU, larger: there each piece costs kernel launches, and memory is plenty."""


# ---------------------------------------------------------------------------------- the layout
def pack(codes: torch.Tensor, step: torch.Tensor, low: torch.Tensor | None, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] (0..15 for 4 bits, -127..127 for 8) with step and low [N, K/32] (float16 or
    float; low None: none kept, for 8 bits and for 4-bit codes centred on 8) -> (codes in panels,
    uint8 [bytes]; steps and lows in panels, float16)."""
    rows, inner = codes.shape
    groups, panels = inner // GROUP, -(-rows // LANES)
    pad = panels * LANES - rows
    codes = torch.cat([codes.to(torch.int16), codes.new_zeros(pad, inner, dtype=torch.int16)])
    halves = [step] + ([] if bits == 8 or low is None else [low])
    halves = [torch.cat([h.to(torch.float16), h.new_zeros(pad, groups, dtype=torch.float16)]) for h in halves]
    if bits == 4:  # [P, L, G, C, H, B] -> [P, G, C, L, B, H], two codes per byte
        blocks = codes.reshape(panels, LANES, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        packed = (blocks[..., 0] | (blocks[..., 1] << 4)).to(torch.uint8)
    else:  # [P, L, G, C, B] -> [P, G, C, L, B]
        packed = codes.reshape(panels, LANES, groups, 8, 4).permute(0, 2, 3, 1, 4).to(torch.int8).view(torch.uint8)
    scales = torch.stack([h.reshape(panels, LANES, groups).permute(0, 2, 1) for h in halves], 2)  # [P, G, 1|2, L]
    return packed.contiguous().reshape(-1), scales.contiguous().reshape(-1).view(torch.int16)


def halves(packed: torch.Tensor, scales: torch.Tensor, inner: int, bits: int) -> int:
    """Float16 values the layout keeps per output and group: 2 (a step and a low) or 1 (a step:
    8-bit codes, and 4-bit codes centred on 8)."""
    groups = inner // GROUP
    panels = packed.numel() // (groups * (256 if bits == 4 else 512))
    return scales.numel() // (panels * groups * LANES)


def _step_and_low(steps: torch.Tensor, bits: int, kept: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., kept, ...] float32 halves (dimension -2) -> (steps, lows; None for 8 bits)."""
    step = steps[..., 0, :]
    if bits == 8:
        return step, None
    return step, steps[..., 1, :] if kept == 2 else -8 * step  # centred codes: low = -8 step, exact


def unpack_rows(packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, inner: int, bits: int) -> torch.Tensor:
    """[len(ids), inner] float32: the weights of output rows `ids`, read back out of the layout."""
    groups, kept = inner // GROUP, halves(packed, scales, inner, bits)
    panel, lane = ids // LANES, ids % LANES
    if bits == 4:
        chunks = packed.reshape(-1, groups, 4, LANES, 4)[panel, :, :, lane].to(torch.int16)  # [n, G, C, B]
        codes = torch.stack([chunks & 15, chunks >> 4], 3)  # [n, G, C, H, B]
    else:
        codes = packed.view(torch.int8).reshape(-1, groups, 8, LANES, 4)[panel, :, :, lane]  # [n, G, C, B]
    both = scales.view(torch.float16).reshape(-1, groups, kept, LANES)[panel, :, :, lane].float()  # [n, G, kept]
    step, low = _step_and_low(both[..., None], bits, kept)  # [n, G, 1]
    weights = codes.reshape(len(ids), groups, GROUP).float() * step
    if low is not None:
        weights = weights + low
    return weights.reshape(len(ids), inner)


def unpacked(packed: torch.Tensor, scales: torch.Tensor, out_features: int, inner: int,
             bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes [G, 32, N'] float32, steps [G, N'] float32, lows [G, N'] or None), N' the panels' outputs."""
    groups, kept = inner // GROUP, halves(packed, scales, inner, bits)
    panels = -(-out_features // LANES)
    if bits == 4:
        chunks = packed.reshape(panels, groups, 4, LANES, 4).to(torch.int16)
        codes = torch.stack([chunks & 15, chunks >> 4], 3).permute(1, 2, 3, 5, 0, 4)  # [P, G, C, H, L, B] -> [G, C, H, B, P, L]
    else:
        codes = packed.view(torch.int8).reshape(panels, groups, 8, LANES, 4).permute(1, 2, 4, 0, 3)  # [G, C, B, P, L]
    codes = codes.reshape(groups, GROUP, panels * LANES).float()
    both = scales.view(torch.float16).reshape(panels, groups, kept, LANES).permute(1, 2, 0, 3).float()
    step, low = _step_and_low(both.reshape(groups, kept, panels * LANES), bits, kept)
    return codes, step, low


# ---------------------------------------------------------------------------------- kernels
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows as int8 codes in groups of 32 (llama.cpp's Q8_0 rule): (codes [M, K] int8, step
    [M, K/32] float32, sum of codes [M, K/32] float32)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    groups = rows.reshape(rows.shape[0], -1, GROUP)  # [M, G, 32]
    step = groups.abs().amax(-1) / 127  # [M, G]
    inverse = torch.where(step != 0, 1 / step, torch.zeros_like(step))
    codes = torch.round(groups * inverse[..., None]).clamp_(-127, 127)
    return codes.reshape(rows.shape).to(torch.int8), step, codes.sum(-1)


def qlinear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int, bits: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.qlinear` in torch (see the module notes)."""
    inner = x.shape[-1]
    codes, steps, lows = unpacked(packed, scales, out_features, inner, bits)  # [G, 32, N'], [G, N']
    xcodes, xstep, xsum = quantize_rows(x)
    rows = xcodes.shape[0]
    out = torch.empty(rows, out_features)
    for start in range(0, rows, ROWS_AT_ONCE):
        part = slice(start, start + ROWS_AT_ONCE)
        groups = xcodes[part].float().reshape(-1, inner // GROUP, GROUP).transpose(0, 1)  # [G, m, 32]
        totals = torch.bmm(groups, codes)  # [G, m, N']: integers, exact
        acc = torch.zeros(totals.shape[1:])
        for g in range(totals.shape[0]):
            t = steps[g] * totals[g]
            if lows is not None:
                t = t + lows[g] * xsum[part, g, None]
            acc = acc + t * xstep[part, g, None]
        out[part] = acc[:, :out_features]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def attention(query, key, value, unit_slots, unit_rows, unit_bits, row_pairs, pair_index, scale: float,
              softcap: float = 0.0, max_partials: int | None = None) -> torch.Tensor:
    """`kernels.attention` in torch: each (unit, row)'s partial over its block, then each row's
    partials combined (see `exact`). Every sum is a `tree_sum`, so a row's bits depend on its own
    keys alone on any device, whatever torch's reduction kernels would choose for the shapes.

    max_partials: the most partials any row has (`row_pairs`' largest step), where the caller knows
    it; else read from `row_pairs`, which on a GPU waits for the device (once per layer).
    On a GPU every torch operation is a kernel launch, and a decode step's launches, not its
    arithmetic, are its time: the code below keeps their number down (no index conversions, heads
    grouped by broadcasting, the weights' sum carried as one more column of the values)."""
    heads, rows, dim = query.shape[1:]
    starts = row_pairs[:-1]  # [R]: where each row's partials begin in pair_index
    counts = row_pairs[1:] - starts  # [R]: how many
    if max_partials is None:
        max_partials = int(counts.max()) if rows else 0
    if max_partials == 0:  # no row sees any key
        return query.new_zeros(1, rows, heads, dim)
    budget = PARTIALS_AT_ONCE if query.device.type == "cpu" else PARTIALS_AT_ONCE_GPU
    units_at_once = max(1, budget // (heads * unit_rows.shape[1] * BLOCK * dim))
    q = query[0].float()
    weighted = torch.nn.functional.pad(value[0].float(), (0, 1), value=1.0)  # [H_kv, S, D + 1]: a last column of ones
    parts = [_partials(q, key[0], weighted, unit_slots[u:u + units_at_once], unit_rows[u:u + units_at_once],
                       unit_bits[u:u + units_at_once], scale, softcap)
             for u in range(0, len(unit_rows), units_at_once)]
    outs, high = (_joined(p, 1) for p in zip(*parts))  # [H, U * W, D + 1], [H, U * W]
    rows_at_once = max(1, budget // (heads * max_partials * (dim + 1)))
    out = _joined([_combine(outs, high, starts[r:r + rows_at_once], counts[r:r + rows_at_once], pair_index,
                            max_partials) for r in range(0, rows, rows_at_once)], 1)  # [H, R, D]
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype)


def _joined(pieces, dim: int) -> torch.Tensor:
    """`torch.cat`, without its copy when there is one piece."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over its last dimension by halving: padded with -0.0 (which adds exactly, to any
    value) to a power of two, then the upper half added onto the lower until one is left. The
    tree of additions is fixed by the length alone, and padding further changes nothing, so a
    row's sum is the same whatever else is summed beside it, on every device (torch's own `sum`
    picks its order by the number of outputs on a GPU)."""
    width = 1 << max(x.shape[-1] - 1, 0).bit_length()
    if width != x.shape[-1]:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=-0.0)
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def _partials(q, key, weighted, unit_slots, unit_rows, unit_bits, scale: float, softcap: float):
    """Each (unit, row)'s partial over its block: weighted values with the sum of the weights as
    their last column [H, U * W, D + 1] (a weight times the ones column is the weight, exactly, and
    its tree is the one it would have alone), and the max of the scores [H, U * W] (-inf: the row
    sees nothing there). q [H, R, D]; key [H_kv, S, D]; weighted [H_kv, S, D + 1]."""
    heads, kv_heads = q.shape[0], key.shape[0]
    units, width = unit_rows.shape
    slots = unit_slots.clamp(min=0)
    hidden = ((unit_bits[..., None] >> torch.arange(BLOCK, device=unit_bits.device)) & 1 == 0) \
        | (unit_slots < 0)[:, None, :] | (unit_rows < 0)[..., None]  # [U, W, 64]: what a row does not see
    keys = key[:, slots].float()  # [H_kv, U, 64, D]: each query head reads its group's by broadcasting
    queries = q[:, unit_rows.clamp(min=0)].reshape(kv_heads, heads // kv_heads, units, width, 1, -1)
    if softcap <= 0:
        queries = queries * scale
    scores = tree_sum(queries * keys[:, None, :, None]).reshape(heads, units, width, BLOCK)  # [H, U, W, 64]
    if softcap > 0:
        scores = softcap * torch.tanh(scores * scale / softcap)
    scores = scores.masked_fill(hidden, float("-inf"))
    high = scores.amax(-1)  # [H, U, W]
    weights = torch.exp(scores - high.clamp(min=torch.finfo(torch.float32).min)[..., None]).masked_fill(hidden, 0)
    columns = weighted[:, slots].transpose(-1, -2)  # [H_kv, U, D + 1, 64]
    outs = tree_sum(weights.reshape(kv_heads, -1, units, width, 1, BLOCK) * columns[:, None, :, None])
    return outs.reshape(heads, units * width, -1), high.reshape(heads, -1)


def _combine(outs, high, starts, counts, pair_index, max_partials: int) -> torch.Tensor:
    """Some rows' partials (each row's `counts` of them from `starts` in `pair_index`, in position
    order, padded to `max_partials`) combined: each weighted by e^(its max - the row's max), then
    the weighted values and the weights (`outs`' last column) added by `tree_sum` over the row's
    own. -> [H, n, D]."""
    slot = torch.arange(max_partials, device=counts.device)
    padding = slot >= counts[:, None]  # [n, P]
    index = pair_index[(starts[:, None] + slot).clamp(max=len(pair_index) - 1)]  # [n, P]
    part_high = high[:, index].masked_fill(padding, float("-inf"))  # [H, n, P]
    top = part_high.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)  # [H, n, 1]
    weight = torch.exp(part_high - top)  # [H, n, P]: 0 for padding and for blocks the row does not see
    summed = tree_sum((outs[:, index] * weight[..., None]).masked_fill(padding[..., None], -0.0).transpose(-1, -2))
    value, total = summed[..., :-1], summed[..., -1:]  # [H, n, D], [H, n, 1]
    return torch.where(total > 0, value / total.clamp(min=torch.finfo(torch.float32).tiny), 0)


__all__ = ["attention", "pack", "qlinear", "quantize_rows", "unpack_rows", "unpacked"]
