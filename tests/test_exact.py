"""Batch invariance, bit for bit: a node's logits in any forest equal its path's fed alone.

The oracle here is stricter than the rest of the suite's: not the same tokens as sequential
decoding, but the same *logits*, bitwise, as the same engine feeding the node's root-to-node path
as one chain. Random forests (a prompt, branches, draft trees, rejected drafts taken back,
compaction) are fed on tiny random models of every oracle architecture at every CPU precision
(float32, bfloat16, and int8 / int4 packed weights with bfloat16 activations), with the model
loaded eager or sdpa and put on the exact kernels (`multidecode.exact`), at one thread and at
all of the machine's. Mutants that make a kernel's order depend on the number of rows, or on the
threads that share it, must fail the same check.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import transformers as tf
from forests import PRECISIONS, THREADS, differing, exact_model, threads
from tiny_models import ARCHITECTURES, COMMON, MAIN_ARCHITECTURES, NO_EOS, ROPE, reference_generate, tiny_model

from multidecode import exact, kernels
from multidecode.api import decode
from multidecode.engine import Engine
from multidecode.errors import NotBitExact
from multidecode.exact import BLOCK, plan_attention
from multidecode.models.vetting import cache_argument
from multidecode.scheduler import Feed


@pytest.mark.parametrize("arch", MAIN_ARCHITECTURES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("count", THREADS)
def test_every_node_of_a_random_forest_equals_its_path_alone_bit_for_bit(arch, attn, precision, count):
    model = exact_model(arch, attn, precision)
    with threads(count):
        for seed in range(3):
            bad, fed = differing(model, seed=seed)
            assert fed and not bad, f"seed {seed}: {len(bad)} of {fed} nodes differ from their paths alone"


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_chains_fed_apart_equal_their_paths_alone(precision):
    model = exact_model("qwen2", "sdpa", precision)
    engine = Engine(model, apart=True)
    prompt = engine.feed_chain(list(range(3, 40)), logits=False).nodes
    chains = [[5 + i] * 70 for i in range(3)]  # three long chains under the prompt: run apart
    tokens = [t for chain in chains for t in chain]
    parents = [p for c, chain in enumerate(chains) for p in
               [prompt[-1]] + [Feed.ref(sum(map(len, chains[:c])) + j) for j in range(len(chain) - 1)]]
    fed = engine.feed(tokens, parents, logits_for=list(range(len(tokens))))
    nodes, rows = fed.nodes, fed.logits
    assert engine.stats.forward_passes > 2  # the chains did run apart
    for node in nodes[::23]:
        assert torch.equal(Engine(model).feed_chain(engine.forest.path_tokens(node)).logits[0], rows[nodes.index(node)])


def test_greedy_decoding_equals_transformers_generate_through_the_same_kernels():
    """transformers' own loop calls the exact kernel without a plan (one sequence): the same
    kernels, so the same tokens as a forest's branches, bit for bit."""
    model = exact_model("mistral", "sdpa", "bfloat16")
    prefix, branches = [1, 17, 29, 44, 5] * 3, [[7, 8], [9], [11, 12, 13]]
    got = decode(model, prefix, branches, max_new_tokens=20, eos_token_id=[])
    for branch, ids in zip(branches, got):
        assert ids == reference_generate(model, prefix + branch, max_new_tokens=20, eos_token_id=None)[:len(ids)]


def split_k_linear(real, parts):
    """A float product that reduces each output in `parts(rows)` pieces of K (split-K, as a tuned
    GEMM does when rows are few), added after: an order that depends on the call, not the row."""

    def linear(x, weight, bias=None, **options):
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        pieces = max(1, parts(rows))
        cuts = [x.shape[-1] * i // pieces for i in range(pieces + 1)]
        out = None
        for a, b in itertools.pairwise(cuts):
            part = real(x[..., a:b].contiguous(), weight[:, a:b].contiguous(), None, **options)
            out = part if out is None else out + part
        return out if bias is None else out + bias.to(out.dtype)

    return linear


MUTANTS = {
    "split-K when rows are many": lambda real: split_k_linear(real, lambda rows: 1 if rows == 1 else 2),
    "split-K over the threads": lambda real: split_k_linear(real, lambda rows: min(rows, torch.get_num_threads())),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_linear_kernel_whose_order_depends_on_the_call_fails_the_check(monkeypatch, mutant):
    """A product reduced in pieces that depend on its row count, or on how many threads share it:
    the forest (many rows) no longer equals its paths alone (one row a step), at two threads."""
    monkeypatch.setattr(kernels, "linear", MUTANTS[mutant](kernels.linear))
    model = exact_model("llama", "sdpa", "float32")
    with threads(2):
        assert any(differing(model, seed=seed)[0] for seed in range(3))


def test_a_packed_product_that_depends_on_its_row_count_fails_the_check(monkeypatch):
    """Packed products that move (by about a bfloat16 step) when a forward has more than one row."""
    real = kernels.qlinear

    def qlinear(x, codes, scales, out_features, bits, bias=None, **options):
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        out = real(x, codes, scales, out_features, bits, bias, **options)
        return out if rows == 1 else (out.float() * (1 + 2 ** -7)).to(out.dtype)

    monkeypatch.setattr(kernels, "qlinear", qlinear)
    model = exact_model("qwen2", "sdpa", "int4")
    assert any(differing(model, seed=seed)[0] for seed in range(3))


def test_an_attention_kernel_that_depends_on_its_row_count_fails_the_check(monkeypatch):
    """An attention kernel whose every output moves with the number of query rows it is given
    (one nudge per row): the forest's forwards have other row counts than the paths' alone."""
    real = kernels.attention

    def attention(query, *args, **options):
        out = real(query, *args, **options)
        return (out.float() * (1 + 1e-6 * query.shape[2])).to(out.dtype)

    monkeypatch.setattr(kernels, "attention", attention)
    model = exact_model("qwen2", "sdpa", "float32")
    assert any(differing(model, seed=seed)[0] for seed in range(3))


def test_a_norm_kernel_that_depends_on_its_row_count_fails_the_check(monkeypatch):
    """A norm whose every output moves (by about a bfloat16 step) when a forward has more than one row."""
    real = kernels.rms_norm

    def rms_norm(x, weight, eps, offset=False, **options):
        out = real(x, weight, eps, offset, **options)
        return out if x.reshape(-1, x.shape[-1]).shape[0] == 1 else (out.float() * (1 + 2 ** -7)).to(out.dtype)

    monkeypatch.setattr(kernels, "rms_norm", rms_norm)
    model = exact_model("llama", "sdpa", "bfloat16")
    assert any(isinstance(m, exact.ExactRMSNorm) for m in model.modules())
    assert any(differing(model, seed=seed)[0] for seed in range(3))


def wide_or_odd_mlp(arch: str, intermediate: int, dtype: torch.dtype = torch.float32):
    """A tiny model of `arch` whose MLP is `intermediate` wide, on the exact kernels."""
    config, cls = ARCHITECTURES[arch]()
    config.intermediate_size, config._attn_implementation = intermediate, "sdpa"
    torch.manual_seed(1234)
    model = cls(config).to(dtype).eval()
    exact.use_exact_kernels(model)
    assert any(isinstance(m, exact.ExactActivation) for m in model.modules())
    return model


@pytest.mark.parametrize(("arch", "intermediate", "count"), [("llama", 72, 1), ("gemma3", 80, 1), ("llama", 1100, 3)])
def test_activations_are_exact_at_any_width_and_thread_count(arch, intermediate, count):
    """torch computes the last elements of an elementwise run that fall short of a vector step with
    scalar code that rounds otherwise: an MLP 80 (or 72) wide ended a forward's SiLU on the scalar
    code at one thread (the last row's last elements, with AVX-512's step of 32), and one 1,100 wide at 3 threads wherever the
    threads' shares ended; those rows' logits were not their paths' alone (float32: in bfloat16
    the two codes' results round to the same bits on these shapes)."""
    model = wide_or_odd_mlp(arch, intermediate, torch.float32)
    with threads(count):
        for seed in range(2):
            bad, fed = differing(model, seed=seed)
            assert fed and not bad, f"seed {seed}: {len(bad)} of {fed} nodes differ from their paths alone"


def test_an_activation_run_on_torchs_loops_as_they_are_fails_the_check(monkeypatch):
    """The mutant: activations handed to torch whole (as before `in_flat_tiles`)."""
    monkeypatch.setattr(kernels, "in_flat_tiles", lambda layer, x: layer(x))
    model = wide_or_odd_mlp("llama", 72, torch.float32)  # a row of 72: no whole vector steps of 16 or 32 lanes
    with threads(1):
        assert any(differing(model, seed=seed)[0] for seed in range(2))


class DoubledRMSNorm(torch.nn.Module):
    """An RMSNorm whose arithmetic is neither Llama's nor Gemma's (twice Llama's)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(width)), 1e-6

    def forward(self, x):
        return 2 * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight


@pytest.mark.parametrize("arch, offset", [("llama", False), ("gemma3", True)])
def test_norms_the_kernel_computes_are_swapped_and_others_kept(arch, offset):
    """Each RMSNorm is run beside the kernel's two arithmetics and swapped for the one that
    agrees (Llama's; Gemma's `1 + weight`); a norm that computes something else keeps its code."""
    model = exact_model(arch, "sdpa", "bfloat16")
    norms = [m for m in model.modules() if isinstance(m, exact.ExactRMSNorm)]
    assert norms and {norm.offset for norm in norms} == {offset}
    assert exact.ExactRMSNorm.of(DoubledRMSNorm(64)) is None
    assert exact.ExactRMSNorm.of(torch.nn.LayerNorm(64)) is None


@pytest.mark.parametrize("precision", ["bfloat16", "int4"])
def test_a_left_padded_batch_gives_each_row_the_logits_of_the_row_alone(precision):
    """transformers' batched forward (left padding, rows that see nothing) through the exact
    kernel: each row's last logits equal the row's alone, bit for bit, and are finite."""
    model = exact_model("llama", "sdpa", precision)
    rows = [[5, 6, 7, 8], list(range(9, 16)), [20, 21]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # as generate() makes them
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1]
        for row, got in zip(rows, batched):
            alone = model(input_ids=torch.tensor([row])).logits[0, -1]
            assert torch.isfinite(got).all() and torch.equal(got, alone)


@pytest.mark.parametrize("precision", ["bfloat16", "int4"])
def test_padding_inside_a_batch_after_a_cached_prefix_gives_each_row_its_own_logits(precision):
    """A shared prefix cached once, then tails padded on their left (padding inside each row, as a
    benchmark baseline feeds transformers' `generate`): each row's last logits equal the row's
    alone, bit for bit. Keys past the padding keep the positions transformers counts for them."""
    from transformers import DynamicCache

    model = exact_model("llama", "sdpa", precision)
    prefix, tails = [5, 6, 7, 8, 9, 10], [[11, 12, 13, 14], [15, 16]]
    width = max(map(len, tails))
    ids = torch.tensor([[0] * (width - len(t)) + t for t in tails])
    attention = torch.tensor([[1] * len(prefix) + [0] * (width - len(t)) + [1] * len(t) for t in tails])
    positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 0)[:, len(prefix):]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prefix]), use_cache=True, **{cache_argument(model): cache})
        cache.batch_repeat_interleave(len(tails))
        batched = model(input_ids=ids, attention_mask=attention, position_ids=positions,
                        **{cache_argument(model): cache}).logits[:, -1]
        for tail, got in zip(tails, batched):
            alone = model(input_ids=torch.tensor([prefix + tail])).logits[0, -1]
            assert torch.equal(got, alone)


# ---------------------------------------------------------------------- the plan, without a model
def test_each_row_reads_each_of_its_position_blocks_once_and_chains_share_theirs():
    # a chain of 150 nodes (slots 0-149), then two branches of 20 under node 99 (slots 150-189)
    parents = list(range(-1, 149)) + [99] + list(range(150, 169)) + [99] + list(range(170, 189))
    positions = [0] * 190
    for node, parent in enumerate(parents):
        positions[node] = 0 if parent < 0 else positions[parent] + 1
    visible = torch.zeros(190, 190, dtype=torch.bool)
    for node in range(190):
        at = node
        while at >= 0:
            visible[node, at] = True
            at = parents[at]
    parent_rows = torch.tensor(parents)
    plan = plan_attention(visible, torch.tensor(positions), torch.tensor(positions), parent_rows)
    reads = {}
    for entry, rows in enumerate(plan.rows.tolist()):
        for row in rows:
            if row >= 0:
                reads.setdefault(row, []).append(int(plan.blocks[entry]))
                slots = plan.slots[entry]
                seen = [s for s in slots.tolist() if s >= 0 and visible[row, s]]
                assert [positions[s] for s in seen] == sorted(positions[s] for s in seen)  # in position order
    for row in range(190):
        assert sorted(reads[row]) == list(range(positions[row] // BLOCK + 1))  # every block once
    # the chain's 150 rows share 3 gathered blocks (cut into groups of rows), not one block each
    chain_blocks = {tuple(plan.slots[e].tolist()) for e, rows in enumerate(plan.rows.tolist())
                    if any(0 <= r < 150 for r in rows)}
    assert len(chain_blocks) <= 3 + 2  # the chain's 3, and the branches' own blocks are not the chain's rows


def test_a_one_row_plan_is_the_forest_plan_of_that_row():
    """The one-row shortcut gives the general plan's tensors, for rows at every depth of a forest
    (paths that cross blocks, branches under cached nodes, slots out of position order)."""
    generator = torch.Generator().manual_seed(3)
    parents = [-1]
    for node in range(1, 300):
        parents.append(node - 1 if torch.rand(1, generator=generator) < 0.97 else
                       int(torch.randint(0, node, (1,), generator=generator)))
    positions = [0] * 300
    for node, parent in enumerate(parents):
        positions[node] = 0 if parent < 0 else positions[parent] + 1
    order = torch.randperm(300, generator=generator)  # slot -> node: the cache holds nodes in any order
    slot_positions = torch.tensor([positions[n] for n in order.tolist()])
    slot_of = {n: s for s, n in enumerate(order.tolist())}
    assert max(positions) >= 2 * BLOCK
    for node in range(0, 300, 7):
        visible = torch.zeros(1, 300, dtype=torch.bool)
        at = node
        while at >= 0:
            visible[0, slot_of[at]] = True
            at = parents[at]
        query = torch.tensor([positions[node]])
        short = exact.one_row_plan(visible, slot_positions, query)
        general = exact.forest_plan(visible, slot_positions, query, torch.tensor([-1]))
        assert (short.num_rows, short.num_blocks) == (general.num_rows, general.num_blocks)
        for name in ("slots", "rows", "blocks"):
            assert torch.equal(getattr(short, name), getattr(general, name)), (node, name)


def test_decode_puts_a_users_model_on_the_exact_kernels_and_back():
    """`decode` on a model the user holds runs on the exact kernels (each branch gets the bits of
    its path alone) and leaves the model as it found it: its own linear layers and attention."""
    model = copy.deepcopy(tiny_model("qwen2", "sdpa")).to(torch.bfloat16)
    layers = [type(m) for m in model.modules()]
    prefix, branches = [1, 17, 29, 44, 5] * 3, [[7, 8], [9], [11, 12, 13]]
    together = decode(model, prefix, branches, max_new_tokens=12, eos_token_id=[])
    assert [type(m) for m in model.modules()] == layers and not exact.is_exact(model)
    assert model.config._attn_implementation == "sdpa"
    for branch, ids in zip(branches, together):
        assert decode(model, prefix + branch, [[]], max_new_tokens=12, eos_token_id=[])[0] == ids


def test_a_multidecoder_holds_a_users_model_on_the_exact_kernels_while_it_lives():
    """`MultiDecoder(model, tokenizer)` on a model the user holds ran it on torch's own kernels: in
    bfloat16 an answer of `ask` changed with the questions beside it, and beam scores differed
    from `generate(num_beams=...)`. It now holds the exact kernels until `close()` (or its
    collection), refuses a model they cannot run, and keeps the model's own with exact=False."""
    import gc

    from byte_tokenizer import ByteTokenizer

    import multidecode

    model = copy.deepcopy(tiny_model("llama", "sdpa")).to(torch.bfloat16)
    layers = [type(m) for m in model.modules()]
    document, questions = "The quick brown fox jumps over the lazy dog. " * 3, ["Who?", "Over what, and why?", "When?"]
    with multidecode.MultiDecoder(model, ByteTokenizer()) as decoder:
        assert exact.is_exact(model)
        together = decoder.ask(document, questions, max_new_tokens=10)
        for answer in together:
            assert decoder.ask(document, [answer.question], max_new_tokens=10)[0].token_ids == answer.token_ids
        prompt = together[0].prompt_ids
        beams = decoder.beam_search(prompt, num_beams=3, max_new_tokens=6, num_return_sequences=3)
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 num_beams=3, do_sample=False, max_new_tokens=6, num_return_sequences=3,
                                 eos_token_id=[2], pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        assert [b.score for b in beams] == out.sequences_scores.tolist()
    assert [type(m) for m in model.modules()] == layers and model.config._attn_implementation == "sdpa"
    with pytest.raises(multidecode.InvalidArgument, match="closed"):
        decoder.ask(document, questions, max_new_tokens=2)
    multidecode.MultiDecoder(model, ByteTokenizer())
    gc.collect()  # a decoder collected without close() puts the model back too
    assert not exact.is_exact(model)
    events = iter(multidecode.MultiDecoder(model, ByteTokenizer()).stream(document, questions, max_new_tokens=6))
    next(events)
    gc.collect()  # the decoder is gone, its stream is not: the model stays on the exact kernels for it
    assert exact.is_exact(model)
    assert len(list(events)) >= 1
    del events
    gc.collect()
    assert not exact.is_exact(model)
    half = copy.deepcopy(tiny_model("llama", "sdpa")).to(torch.float16)
    with pytest.raises(NotBitExact, match="float16") as refused:
        multidecode.MultiDecoder(half, ByteTokenizer())
    assert "exact=False" in refused.value.hint
    multidecode.MultiDecoder(half, ByteTokenizer(), exact=False).generate([1, 40, 41], max_new_tokens=2)
    assert not exact.is_exact(half)


def test_overlapping_streams_keep_the_exact_kernels_until_the_last_one_ends():
    """A stream closed while another still decodes on the same model put the model back under
    it: the second finished on the model's own sdpa, silently off the exact kernels."""
    from multidecode.api import stream_decode

    model = copy.deepcopy(tiny_model("llama", "sdpa"))
    prefix, branches = [1, 50, 60, 70, 80], [[90, 91], [100]]
    first = stream_decode(model, prefix, branches, max_new_tokens=8, eos_token_id=[])
    second = stream_decode(model, prefix, branches, max_new_tokens=8, eos_token_id=[])
    next(first), next(second)
    first.close()
    assert exact.is_exact(model) and model.config._attn_implementation == exact.NAME
    assert len(list(second)) == 2 * 8 - 1
    assert not exact.is_exact(model) and model.config._attn_implementation == "sdpa"  # the last one out


def test_a_stream_closed_or_dropped_before_its_first_event_puts_the_model_back():
    """A generator never started runs no `finally`: a stream closed or dropped before its first
    event kept the model on the exact kernels for good."""
    import gc

    from multidecode.api import stream_decode

    model = copy.deepcopy(tiny_model("llama", "sdpa"))
    stream = stream_decode(model, [1, 50, 60], [[70], [80]], max_new_tokens=4, eos_token_id=[])
    assert exact.is_exact(model)
    stream.close()
    assert not exact.is_exact(model) and model.config._attn_implementation == "sdpa"
    stream = stream_decode(model, [1, 50, 60], [[70], [80]], max_new_tokens=4, eos_token_id=[])
    del stream
    gc.collect()
    assert not exact.is_exact(model) and model.config._attn_implementation == "sdpa"


def test_threads_decoding_with_one_model_get_its_answers():
    """Threads calling `decode` on one model swapped its kernels in and out under each other: most
    calls failed ('cannot take a tree-shaped 4D mask', 'do not go through transformers' attention
    interface') and a few returned other tokens."""
    import threading

    model = copy.deepcopy(tiny_model("llama", "sdpa"))
    prefix, branches = [1, 50, 60, 70, 80], [[90, 91], [100], [110, 120, 130]]
    expected = decode(model, prefix, branches, max_new_tokens=12, eos_token_id=[])
    results: list = []

    def work() -> None:
        for _ in range(4):
            try:
                results.append(decode(model, prefix, branches, max_new_tokens=12, eos_token_id=[]))
            except Exception as err:  # noqa: BLE001 (what a thread raised is the finding)
                results.append(err)

    workers = [threading.Thread(target=work) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert results == [expected] * 16
    assert not exact.is_exact(model) and model.config._attn_implementation == "sdpa"


def test_stream_decode_takes_decodes_sampling_settings():
    """`stream_decode` without `sampling=` raised a TypeError from inside ('admit() missing ...
    sampling'), and with do_sample= another."""
    from multidecode.api import stream_decode

    model = tiny_model("llama", "sdpa")
    prefix, branches = [1, 50, 60], [[70], [80, 90]]
    for settings in ({}, {"do_sample": True, "seed": 3, "top_k": 5}):
        events = list(stream_decode(model, prefix, branches, max_new_tokens=4, eos_token_id=[], **settings))
        streamed = [[e.token_id for e in events if e.branch == b] for b in range(2)]
        assert streamed == decode(model, prefix, branches, max_new_tokens=4, eos_token_id=[],
                                  **{"do_sample": False} | settings)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_the_portable_kernels_are_exact_too(monkeypatch, precision):
    """Where no compiler built the kernels, packed models run on the same definitions in torch:
    every node still equals its path alone."""
    monkeypatch.setattr(kernels, "native", lambda: False)
    model = exact_model("llama", "sdpa", precision)
    for seed in range(2):
        bad, fed = differing(model, seed=seed)
        assert fed and not bad, f"seed {seed}: {len(bad)} of {fed} nodes differ from their paths alone"


def test_float_weights_without_the_compiled_kernels_are_refused(monkeypatch):
    monkeypatch.setattr(kernels, "native", lambda: False)
    model = copy.deepcopy(tiny_model("llama", "sdpa"))
    with pytest.raises(NotBitExact, match="compiled kernels") as refused:
        exact.use_exact_kernels(model)
    assert "exact=False" in refused.value.hint
    assert not exact.is_exact(model) and isinstance(model.lm_head, torch.nn.Linear)  # nothing changed


@pytest.mark.parametrize("arch", ["stablelm", "nemotron"])
def test_a_model_whose_layers_drop_the_forwards_keywords_is_refused_and_exact_without_the_kernels(arch):
    """StableLM's and Nemotron's decoder layers (transformers 5.24) call attention without the
    keywords given to the forward, so the forest's plan never reached `exact_attention`, which then
    attended as one plain sequence: every branch wrong, silently. The probe now refuses them, and
    exact=False (the forest as a mask) gives each branch its tokens alone."""
    config_class, model_class = {"stablelm": (tf.StableLmConfig, tf.StableLmForCausalLM),
                                 "nemotron": (tf.NemotronConfig, tf.NemotronForCausalLM)}[arch]
    config = config_class(**COMMON, **ROPE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    _refused_then_exact_without_the_kernels(model_class(config).eval(), "keyword arguments", max_new_tokens=6)


def _refused_then_exact_without_the_kernels(model, reason: str, *, max_new_tokens: int) -> None:
    """`model` is refused on the exact kernels (`NotBitExact` matching `reason`, its hint
    exact=False), put back as it was, and with exact=False each branch equals `generate` alone."""
    with pytest.raises(NotBitExact, match=reason) as refused:
        decode(model, [1, 5, 6, 7], [[], [10, 11]], max_new_tokens=4, eos_token_id=[])
    assert "decode(..., exact=False)" in refused.value.hint  # the call's own argument: decode loads nothing
    assert not exact.is_exact(model)  # put back as it was
    prefix, branches = [1, 5, 6, 7, 8, 9], [[], [10, 11], [12]]
    together = decode(model, prefix, branches, max_new_tokens=max_new_tokens, eos_token_id=[], exact=False)
    for branch, got in zip(branches, together):
        assert got == reference_generate(model, prefix + branch, max_new_tokens=max_new_tokens, eos_token_id=[NO_EOS])


def test_a_model_whose_attention_bypasses_the_interface_is_refused_in_silence(capfd):
    """Falcon's layers compute attention themselves: the probe that finds them changed the model's
    attention implementation, and transformers logged a line to stderr on each change (the library
    prints nothing); the refusal alone says why, and exact=False gives each branch its tokens."""
    config = tf.FalconConfig(**COMMON, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             new_decoder_architecture=False, multi_query=True, alibi=False)
    torch.manual_seed(1234)
    _refused_then_exact_without_the_kernels(tf.FalconForCausalLM(config).eval(), "attention interface",
                                            max_new_tokens=6)
    assert capfd.readouterr() == ("", "")


def test_a_model_with_attention_sinks_is_refused_as_not_bit_exact_and_exact_without_the_kernels():
    """Attention sinks (GraniteSWA, gpt-oss: a learned logit per head beside the keys) are not in
    the exact kernel: the probe stopped in a bare NotImplementedError, which neither the API's
    callers nor the command line's fallback to exact=False could tell from a bug. It is a
    `NotBitExact` now, and exact=False gives each branch its tokens alone."""
    config = tf.GraniteSWAConfig(**COMMON, **ROPE, head_dim=16, sliding_window=6)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    _refused_then_exact_without_the_kernels(tf.GraniteSWAForCausalLM(config).eval(), "sinks", max_new_tokens=10)


LATENT_ATTENTION = {  # dense multi-head latent attention: values of 8 columns beside keys of 16
    "minicpm3": lambda: (tf.MiniCPM3Config(**COMMON, **{**ROPE, "num_key_value_heads": 4}, q_lora_rank=16,
                                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
                         tf.MiniCPM3ForCausalLM),
    "deepseek_v3": lambda: (tf.DeepseekV3Config(**COMMON, **{**ROPE, "num_key_value_heads": 4}, first_k_dense_replace=3,
                                                q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                                qk_rope_head_dim=8, v_head_dim=8),
                            tf.DeepseekV3ForCausalLM),
}


@pytest.mark.parametrize("arch", LATENT_ATTENTION)
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_latent_attention_whose_values_are_narrower_than_its_keys_runs_exactly(arch, precision):
    """MiniCPM3's and DeepSeek-V3's attention (multi-head latent attention) gives values narrower
    than keys; the attention kernel takes one head dim, and the default (exact) path stopped in a
    bare RuntimeError from it. Values are widened with zeros for the kernel and its output cut back:
    every node of a random forest equals its path alone bit for bit, and greedy branches equal
    transformers' `generate` through the same kernels."""
    config, model_class = LATENT_ATTENTION[arch]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    model = model_class(config).eval().to(PRECISIONS[precision])
    exact.use_exact_kernels(model)
    bad, fed = differing(model, seed=0)
    assert fed and not bad, f"{len(bad)} of {fed} nodes differ from their paths alone"
    prefix, branches = [1, 17, 29, 44, 5], [[7, 8], [9]]
    got = decode(model, prefix, branches, max_new_tokens=8, eos_token_id=[])
    for branch, ids in zip(branches, got):
        assert ids == reference_generate(model, prefix + branch, max_new_tokens=8, eos_token_id=[NO_EOS])


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_a_packed_model_left_with_no_parameters_decodes_exactly(precision):
    """OLMo's norms have no weights: packed, the model holds only buffers, and every read of its
    dtype or device from its first parameter stopped with a bare StopIteration."""
    from multidecode.models.packed import pack_model

    torch.manual_seed(0)
    model = tf.OlmoForCausalLM(tf.OlmoConfig(**COMMON, **ROPE)).eval()
    pack_model(model, PRECISIONS[precision], torch.bfloat16)
    model.to(torch.bfloat16)
    assert not list(model.parameters())  # the case being tested
    from multidecode.memory import Footprint

    config = model.config  # the memory budget counts its KV at the dtype it computes in (float32 was said)
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    assert Footprint.of(model).kv_per_slot == 2 * config.num_hidden_layers * kv_heads * head_dim * 2
    exact.use_exact_kernels(model)
    for seed in range(2):
        bad, fed = differing(model, seed=seed)
        assert fed and not bad, f"seed {seed}: {len(bad)} of {fed} nodes differ from their paths alone"
    prefix, branches = [5, 6, 7], [[8], [9, 10], [11, 12, 13]]
    together = decode(model, prefix, branches, max_new_tokens=6, eos_token_id=[])
    assert together == [decode(model, prefix + b, [[]], max_new_tokens=6, eos_token_id=[])[0] for b in branches]
