"""The kernels one by one: each instruction set gives the portable C kernels' bits, a row's output
does not depend on the other rows or on the threads, and the results are what the products mean.

The kernels are defined lane by lane (`kernels/csrc/kernels_impl.h`), so AVX2, AVX-512 and
AVX-512 VNNI must give exactly the bits of the portable C code: a CPU of another class runs one of
these same paths, and this machine tests each one it can run. The torch path (`kernels.portable`,
for machines without a compiler) follows the same definitions and is checked against them to
rounding, and for its own invariance.
"""

from __future__ import annotations

import pytest
import torch

from multidecode import exact, kernels
from multidecode.exact import plan_attention
from multidecode.kernels import portable

pytestmark = pytest.mark.skipif(not kernels.native(), reason=f"no compiled kernels here: {kernels.status().reason}")

LEVELS = list(range(kernels.level() + 1))
"""The instruction sets this machine runs (under ATEN_CPU_CAPABILITY, the ones it allows)."""


def same_at_every_level(run) -> torch.Tensor:
    """run(isa) at each level this machine has; all must equal the portable C kernels' bits."""
    reference = run(kernels.PORTABLE)
    for isa in LEVELS[1:]:
        got = run(isa)
        assert torch.equal(got, reference), f"{kernels.LEVELS[isa]} differs from the portable kernels"
    return reference


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(0)


# ---------------------------------------------------------------------------------- linear
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inner, outputs", [(1, 64, 40), (5, 100, 33), (9, 17, 8), (70, 160, 96)])
def test_linear_is_the_same_at_every_level_and_right(generator, x_dtype, w_dtype, rows, inner, outputs):
    x = torch.randn(rows, inner, generator=generator).to(x_dtype)
    weight = torch.randn(outputs, inner, generator=generator).to(w_dtype)
    bias = torch.randn(outputs, generator=generator)
    out = same_at_every_level(lambda isa: kernels.linear(x, weight, bias, isa=isa))
    assert out.dtype == x_dtype and out.shape == (rows, outputs)
    expected = x.double() @ weight.double().T + bias.double()
    tolerance = 1e-5 if x_dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * inner ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_row_is_the_same_alone_anywhere_and_at_any_thread_count(generator, dtype):
    x = torch.randn(37, 576, generator=generator).to(dtype)
    weight = torch.randn(200, 576, generator=generator).to(dtype)
    together = kernels.linear(x, weight)
    for row in (0, 5, 36):
        assert torch.equal(kernels.linear(x[row:row + 1], weight)[0], together[row])
    shuffled = torch.randperm(37, generator=generator)
    assert torch.equal(kernels.linear(x[shuffled], weight), together[shuffled])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.linear(x, weight), together)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------- rms_norm
def reference_norm(x, weight, eps, offset):
    """The norm in float64: x / rms(x), weighted (by 1 + weight with `offset`)."""
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    return normed * (1 + weight.double() if offset else weight.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("rows, width", [(1, 64), (5, 100), (9, 17), (70, 2048)])  # the last: split over threads
def test_rms_norm_is_the_same_at_every_level_and_right(generator, dtype, offset, rows, width):
    x = torch.randn(rows, width, generator=generator).mul(3).to(dtype)
    weight = torch.randn(width, generator=generator).to(dtype)
    out = same_at_every_level(lambda isa: kernels.rms_norm(x, weight, 1e-5, offset, isa=isa))
    assert out.dtype == dtype and out.shape == x.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.double(), reference_norm(x, weight, 1e-5, offset), rtol=tolerance, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
def test_the_norms_torch_form_computes_the_kernels_arithmetic(generator, dtype, offset):
    """What a swapped norm runs on another device: the kernel's arithmetic in torch's operations,
    equal to it but for the order of the mean's additions (a bfloat16 step at most)."""
    x = torch.randn(9, 576, generator=generator).mul(3).to(dtype)
    weight = torch.randn(576, generator=generator).to(dtype)
    got, expected = exact.torch_rms_norm(x, weight, 1e-5, offset), kernels.rms_norm(x, weight, 1e-5, offset)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_normed_row_is_the_same_alone_anywhere_and_at_any_thread_count(generator, dtype):
    x = torch.randn(300, 576, generator=generator).to(dtype)
    weight = torch.randn(576, generator=generator).to(dtype)
    together = kernels.rms_norm(x, weight, 1e-6)
    for row in (0, 5, 299):
        assert torch.equal(kernels.rms_norm(x[row:row + 1], weight, 1e-6)[0], together[row])
    shuffled = torch.randperm(300, generator=generator)
    assert torch.equal(kernels.rms_norm(x[shuffled], weight, 1e-6), together[shuffled])
    assert torch.equal(kernels.rms_norm(x.view(3, 100, 576), weight, 1e-6).view(300, 576), together)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.rms_norm(x, weight, 1e-6), together)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------- packed
def random_codes(generator, outputs: int, inner: int, bits: int | str):
    """(packed, scales, float32 weights) of random codes: bits 4, 8, or "4c" (4-bit codes centred
    on 8, GGUF's Q4_0: no low kept)."""
    groups = inner // 32
    if bits == "4c":
        codes = torch.randint(0, 16, (outputs, inner), generator=generator)
        step = torch.rand(outputs, groups, generator=generator) * 0.01
        packed, scales = portable.pack(codes, step, None, 4)
        return packed, scales, (codes.float() - 8) * step.half().float().repeat_interleave(32, 1)
    if bits == 4:
        codes = torch.randint(0, 16, (outputs, inner), generator=generator)
        step = torch.rand(outputs, groups, generator=generator) * 0.01
        low = -torch.rand(outputs, groups, generator=generator) * 0.08
    else:
        codes = torch.randint(-127, 128, (outputs, inner), generator=generator)
        step, low = torch.rand(outputs, groups, generator=generator) * 0.002, None
    packed, scales = portable.pack(codes, step, low, bits)
    weights = codes.float() * step.half().float().repeat_interleave(32, 1)
    if low is not None:
        weights = weights + low.half().float().repeat_interleave(32, 1)
    return packed, scales, weights


@pytest.mark.parametrize("form", [4, "4c", 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inner, outputs", [(1, 64, 40), (6, 128, 33), (70, 576, 96)])
def test_packed_products_are_the_same_at_every_level_and_right(generator, form, dtype, rows, inner, outputs):
    packed, scales, weights = random_codes(generator, outputs, inner, form)
    bits = 8 if form == 8 else 4
    x = torch.randn(rows, inner, generator=generator).to(dtype)
    bias = torch.randn(outputs, generator=generator)
    out = same_at_every_level(lambda isa: kernels.qlinear(x, packed, scales, outputs, bits, bias, isa=isa))
    assert out.dtype == dtype and out.shape == (rows, outputs)
    expected = x.double() @ weights.double().T + bias.double()
    error = (out.double() - expected).norm() / expected.norm()
    assert error < 0.01  # int8 activations, as llama.cpp's Q8_0
    assert torch.equal(kernels.qlinear(x[-1:], packed, scales, outputs, bits, bias)[0], out[-1])
    torch.testing.assert_close(portable.qlinear(x, packed, scales, outputs, bits, bias).double(), out.double(),
                               rtol=0.01, atol=0.01)


def test_rows_are_quantized_alike_at_every_level_and_by_the_torch_path(generator):
    x = torch.randn(9, 96, generator=generator) * torch.tensor([0.01, 1.0, 100.0]).repeat_interleave(32)
    x[3] = 0  # a row of zeros: step 0, codes 0
    codes, step, sums = (same_at_every_level(lambda isa, i=i: kernels.quantize_rows(x, isa=isa)[i]) for i in range(3))
    expected = portable.quantize_rows(x)
    assert torch.equal(codes, expected[0]) and torch.equal(step, expected[1]) and torch.equal(sums, expected[2])
    assert codes.abs().max() == 127 and not codes[3].any()


@pytest.mark.parametrize("form", [4, "4c", 8])
def test_the_layout_reads_back_the_weights_it_packed(generator, form):
    packed, scales, weights = random_codes(generator, 45, 96, form)
    ids = torch.tensor([0, 15, 16, 31, 44])
    assert torch.equal(portable.unpack_rows(packed, scales, ids, 96, 8 if form == 8 else 4), weights[ids])


@pytest.mark.parametrize("rows", [1, 7, 70])
def test_centred_codes_give_the_bits_of_the_same_codes_with_their_lows_kept(generator, rows):
    """Q4_0's codes packed without lows (low = -8 step, computed) give every product the bits of
    the same codes packed with their lows, in 10% fewer bytes; the portable path too."""
    codes = torch.randint(0, 16, (50, 192), generator=generator)
    step = (torch.rand(50, 6, generator=generator) * 0.01).half().float()
    centred, kept = portable.pack(codes, step, None, 4), portable.pack(codes, step, -8 * step, 4)
    assert torch.equal(centred[0], kept[0]) and centred[1].numel() * 2 == kept[1].numel()
    assert sum(t.numel() * t.element_size() for t in centred) * 10 == sum(
        t.numel() * t.element_size() for t in kept) * 9
    x = torch.randn(rows, 192, generator=generator).to(torch.bfloat16)
    for isa in LEVELS:
        assert torch.equal(kernels.qlinear(x, *centred, 50, 4, isa=isa), kernels.qlinear(x, *kept, 50, 4, isa=isa))
    assert torch.equal(portable.qlinear(x, *centred, 50, 4), portable.qlinear(x, *kept, 50, 4))
    ids = torch.arange(50)
    assert torch.equal(portable.unpack_rows(*centred, ids, 192, 4), portable.unpack_rows(*kept, ids, 192, 4))


# ---------------------------------------------------------------------------------- attention
def random_forest_plan(generator, rows: int, cached: int, chain: int = 40):
    """A forest of `cached` cached slots and `rows` new nodes: a chain of `chain` nodes, then nodes
    under random earlier ones. Returns (visible [R, S], key positions [S], query positions [R],
    parent rows [R])."""
    total = cached + rows
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) if i > chain else i - 1
                      for i in range(1, total)]
    positions, visible = [0] * total, torch.zeros(total, total, dtype=torch.bool)
    for node, parent in enumerate(parents):
        positions[node] = 0 if parent < 0 else positions[parent] + 1
        at = node
        while at >= 0:
            visible[node, at] = True
            at = parents[at]
    parent_rows = torch.tensor([p - cached if p >= cached else -1 for p in parents[cached:]])
    return visible[cached:], torch.tensor(positions), torch.tensor(positions[cached:]), parent_rows


def attend_all_levels(generator, *, heads=4, kv_heads=2, dim=64, rows=20, cached=150, dtype=torch.float32,
                      softcap=0.0, window=None, chain=40):
    ancestors, key_positions, query_positions, parent_rows = random_forest_plan(generator, rows, cached, chain)
    plan = plan_attention(ancestors, key_positions, query_positions, parent_rows)  # windows are the mask's
    visible = ancestors.clone()
    if window is not None:
        visible &= (query_positions[:, None] - key_positions[None, :]) < window
    layout = plan.layout("cpu")
    bits = layout.visible_bits(plan, visible[None, None], visible.shape[1], "cpu")
    query = torch.randn(1, rows, heads, dim, generator=generator).transpose(1, 2).to(dtype)  # strided, as models make it
    key = torch.randn(1, kv_heads, cached + rows, dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, cached + rows, dim, generator=generator).to(dtype)
    args = (query, key, value, layout.unit_slots, layout.unit_rows, bits, layout.row_pairs, layout.pair_index, 0.3,
            softcap)
    out = same_at_every_level(lambda isa: kernels.attention(*args, isa=isa))
    return out, args, visible


def reference_attention(query, key, value, visible, scale, softcap):
    """Plain softmax attention in float64 over each row's visible keys: [1, R, H, D]."""
    group = query.shape[1] // key.shape[1]
    k = key[0].double().repeat_interleave(group, 0)
    v = value[0].double().repeat_interleave(group, 0)
    scores = query[0].double() @ k.transpose(-1, -2) * scale  # [H, R, S]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1)[None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("window", [None, 7])
def test_attention_is_the_same_at_every_level_and_right(generator, dtype, softcap, window):
    out, args, visible = attend_all_levels(generator, dtype=dtype, softcap=softcap, window=window)
    expected = reference_attention(*args[:3], visible, 0.3, softcap)
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(portable.attention(*args).double(), out.double(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("heads, kv_heads, dim", [(3, 1, 64), (4, 4, 16), (2, 1, 80), (8, 2, 128)])
def test_attention_takes_any_grouping_and_head_size(generator, heads, kv_heads, dim):
    out, args, visible = attend_all_levels(generator, heads=heads, kv_heads=kv_heads, dim=dim)
    torch.testing.assert_close(out.double(), reference_attention(*args[:3], visible, 0.3, 0.0), rtol=1e-5, atol=1e-5)


def test_a_row_that_sees_nothing_gets_zeros(generator):
    out, _, _ = attend_all_levels(generator, window=0)  # a window of 0: nothing is visible
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_merged_in_groups_give_the_bits_of_merged_partials(generator, dtype):
    """Long prompts' rows are worked in groups and merged as they go (no partials kept): the same
    partials merged in the same order, so the same bits, at every level."""
    for rows, cached, chain in ((300, 0, 10**6), (150, 40, 40), (20, 150, 40)):  # a prompt, forests
        out, args, _ = attend_all_levels(generator, rows=rows, cached=cached, dtype=dtype, chain=chain)
        for isa in LEVELS:
            grouped = kernels.attention(*args, merge=kernels.MERGE_GROUPS, isa=isa)
            assert torch.equal(grouped, out), f"{kernels.LEVELS[isa]}, {rows} rows"


def test_a_cache_folder_that_cannot_be_written_means_no_build_and_says_why(tmp_path):
    """MULTIDECODE_CACHE naming a file (or a read-only place): the kernels are not built there,
    with the reason and the fix, instead of an OSError from the middle of the build."""
    from multidecode.kernels import build

    afile = tmp_path / "afile"
    afile.write_text("")
    built = build._build(afile / "kernels" / "key" / "lib.so", None)
    assert built.library is None and "cannot be built in" in built.reason and "MULTIDECODE_CACHE" in built.reason


def test_a_build_folder_without_its_finished_mark_is_not_trusted(tmp_path, monkeypatch):
    """A build that stopped half-way (no `built` mark beside the library) is built again, never
    loaded; the mark is written last, naming the library's digest, so a library cut short or
    overwritten after it was marked (a power cut, a disk error: loading a truncated library killed
    the process with SIGBUS) is built again too, as is one marked before marks named digests."""
    from multidecode.kernels import build

    monkeypatch.setenv("MULTIDECODE_CACHE", str(tmp_path))
    build.build_folder().mkdir(parents=True)
    build.library_path().write_bytes(b"a whole library")
    assert not build.built()
    (build.build_folder() / build.DONE).write_text(build.key())  # an older mark: no digest
    assert not build.built()
    build._mark_built(build.library_path())
    assert build.built()
    build.library_path().write_bytes(b"a whole libr")  # cut short since
    assert not build.built()


# ---------------------------------------------------------------------- row tiles (the GPU's exact path)
@pytest.mark.parametrize("rows", [0, 1, 5, kernels.ROW_TILE, kernels.ROW_TILE + 3, 3 * kernels.ROW_TILE])
def test_row_tiles_call_the_layer_on_full_tiles_only_and_give_its_rows(rows):
    """`in_row_tiles` (what a GPU runs its products and norms through): every call but an empty
    input's sees exactly ROW_TILE rows, and the rows that come back are the layer's own."""
    seen = []
    layer = torch.nn.Linear(8, 3)

    def counting(x):
        seen.append(x.shape[0])
        return layer(x)

    x = torch.randn(2, rows, 8) if rows else torch.randn(0, 8)
    with torch.no_grad():
        out = kernels.in_row_tiles(counting, x)
        expected = torch.stack([layer(row[None])[0] for row in x.reshape(-1, 8)]) if rows else layer(x)
    assert out.shape == (*x.shape[:-1], 3)
    assert torch.allclose(out.reshape(-1, 3), expected.reshape(-1, 3), atol=1e-6)
    assert all(n == kernels.ROW_TILE for n in seen) if rows else seen == [0]


def test_a_mask_on_another_device_gives_its_visibility_on_the_device_asked_for():
    """The exact attention's plan reads visibility on the CPU from a mask on the model's device
    (a GPU's): `_allowed` must return it where it is asked for (a crash on CUDA, found there)."""
    from multidecode.exact import _allowed

    hidden = torch.tensor([[False, True, True], [False, False, True]])  # [R, S]: a causal mask's
    additive = torch.zeros(1, 1, 2, 3).masked_fill(hidden, torch.finfo(torch.float32).min)
    for mask in (additive, ~hidden[None, None]):  # additive, and boolean (True: may attend)
        assert torch.equal(_allowed(mask, 2, 3, "cpu"), ~hidden)
        assert _allowed(mask, 2, 3, "meta").device.type == "meta"


@pytest.mark.parametrize("length", [1, 5, 16, 64, 80])
def test_a_tree_sum_is_the_same_whatever_is_summed_beside_it(generator, length):
    """The portable attention's sums (`portable.tree_sum`): a row's bits do not change with the
    other rows summed in the same call or with padding out to a longer power of two, and -0.0
    stays -0.0 (the padding adds exactly)."""
    rows = torch.randn(7, length, generator=generator)
    alone = portable.tree_sum(rows[3:4])
    assert torch.equal(portable.tree_sum(rows)[3:4], alone)
    padded = torch.nn.functional.pad(rows[3:4], (0, 3 * length), value=-0.0)
    assert torch.equal(portable.tree_sum(padded), alone)
    torch.testing.assert_close(alone.double(), rows[3:4].double().sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.signbit(portable.tree_sum(torch.tensor([[-0.0, -0.0, -0.0]]))).all()


def test_attention_of_rows_that_see_no_key_is_zero():
    """A forward whose rows read no block (an edge the planner does not make, kept safe): zeros."""
    query, key = torch.randn(1, 2, 3, 16), torch.randn(1, 1, 5, 16)
    empty = torch.zeros(0, 1, dtype=torch.int32)
    out = portable.attention(query, key, key, torch.zeros(0, 64, dtype=torch.int32), empty, empty.long(),
                             torch.zeros(4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0.25)
    assert out.shape == (1, 3, 2, 16) and not out.any()


def test_the_portable_attention_gives_the_same_bits_in_any_number_of_pieces(generator, monkeypatch):
    """Its units and rows are taken in pieces of a memory budget (`PARTIALS_AT_ONCE`): one unit
    and one row at a time gives the bits of all at once."""
    _, args, _ = attend_all_levels(generator)
    whole = portable.attention(*args)
    monkeypatch.setattr(portable, "PARTIALS_AT_ONCE", 1)
    assert torch.equal(portable.attention(*args), whole)


def test_the_exact_path_tells_the_portable_attention_its_longest_row_from_the_host(generator, monkeypatch):
    """A GPU waits for the device whenever a value is read off it: the most partials a row has is
    known on the host when the plan is made (`_Layout.max_partials`), and handed to the portable
    attention (what a GPU runs), which then reads nothing off the device, with the bits it gets
    when it reads the value itself."""
    ancestors, key_positions, query_positions, parent_rows = random_forest_plan(generator, 20, 150, 40)
    plan = plan_attention(ancestors, key_positions, query_positions, parent_rows)
    query, key = torch.randn(1, 4, 20, 64, generator=generator), torch.randn(1, 2, 170, 64, generator=generator)
    given, attention = [], portable.attention

    def recording(*args):
        given.append(args[-1])
        return attention(*args)

    monkeypatch.setattr(kernels, "native", lambda: False)
    monkeypatch.setattr(portable, "attention", recording)
    out = exact._attend(query, key, key, ancestors[None, None], plan, None, None)
    layout = plan.layout("cpu")
    longest = int((layout.row_pairs[1:] - layout.row_pairs[:-1]).max())
    assert given == [longest] and layout.max_partials == longest
    bits = layout.visible_bits(plan, ancestors[None, None], 170, "cpu")
    read = portable.attention(query, key, key, layout.unit_slots, layout.unit_rows, bits, layout.row_pairs,
                              layout.pair_index, 64 ** -0.5, 0.0, None)
    assert torch.equal(out, read)


def test_every_norm_layer_of_a_gpu_model_is_tiled_with_or_without_a_weight():
    """`RowTiledNorm.of` decides by the model's device and the layer's kind, not by a weight:
    a weightless RMSNorm of a GPU model is tiled too; on the CPU no norm is."""
    from multidecode.exact import RowTiledNorm

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    for layer in (torch.nn.RMSNorm(8, elementwise_affine=False), torch.nn.LayerNorm(8), torch.nn.RMSNorm(8)):
        assert isinstance(RowTiledNorm.of(layer, gpu), RowTiledNorm)
        assert RowTiledNorm.of(layer, cpu) is None
    assert RowTiledNorm.of(torch.nn.Linear(8, 8), gpu) is None
    x = torch.randn(3, 70, 8)
    torch.testing.assert_close(RowTiledNorm(torch.nn.RMSNorm(8, elementwise_affine=False))(x),
                               torch.nn.RMSNorm(8, elementwise_affine=False)(x))
