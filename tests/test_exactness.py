"""The oracle: decoding a forest over one shared cache equals running each branch alone.

Every tiny architecture (rotary, partial rotary, learned absolute positions, sliding window 6,
hybrid sliding/full layers) in float32 with eager and sdpa attention: greedy `decode` must give,
token for token, what transformers' own `generate` gives for `prefix + branch`. Sequences are
longer than the sliding window. The mutant tests at the end show that these comparisons do fail
when positions or masks are wrong.
"""

import dataclasses
import functools
import random

import pytest
import torch
from eos_cases import pick_eos, truncate
from tiny_models import ATTENTION, MAIN_ARCHITECTURES, NO_EOS, VOCAB, reference_generate, tiny_model

import multidecode
import multidecode.engine
from multidecode import CompactionPolicy, SamplingParams
from multidecode.api import stream_decode
from multidecode.engine import Engine
from multidecode.forest import Forest, chain_parents
from multidecode.masks import build_attention_mask
from multidecode.scheduler import Feed

ARCHS = [*MAIN_ARCHITECTURES, "qwen2-hybrid"]
WINDOW = 6  # the tiny sliding-window models' window
STEPS = 14

_rng = random.Random(2024)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, VOCAB) for _ in range(n)]


PREFIX = _tokens(8)
BRANCHES = [[], _tokens(1), _tokens(3), _tokens(6), _tokens(2), _tokens(9)]
MANY_BRANCHES = [[], []] + [_tokens(_rng.randrange(0, 8)) for _ in range(27)] + [BRANCHES[3]] * 3
assert len(MANY_BRANCHES) == 32
assert len(PREFIX) + STEPS > 2 * WINDOW


def combos():
    """(arch, attn) pairs, each arch kept on one xdist worker so its model and references are built once."""
    return [
        pytest.param(arch, attn, id=f"{arch}-{attn}", marks=pytest.mark.xdist_group(arch))
        for arch in ARCHS
        for attn in ATTENTION
    ]


@functools.cache
def reference(arch: str, attn: str, prompt: tuple[int, ...], steps: int = STEPS) -> tuple[int, ...]:
    """Sequential greedy decoding of `prompt` alone with transformers' generate, never stopping early."""
    return tuple(reference_generate(tiny_model(arch, attn), list(prompt), max_new_tokens=steps, eos_token_id=NO_EOS))


def references(arch, attn, prefix, branches, steps=STEPS) -> list[list[int]]:
    return [list(reference(arch, attn, tuple(prefix + b), steps)) for b in branches]


def eos_case(arch, attn):
    """(eos ids, expected outputs with them) for the main prefix and branches: some branches stop
    on eos mid-run (at different steps where the model's outputs allow) while others go on."""
    full = references(arch, attn, PREFIX, BRANCHES)
    eos = pick_eos(full, STEPS)
    expected = truncate(full, set(eos))
    lengths = [len(e) for e in expected]
    assert min(lengths) < STEPS and STEPS in lengths and len(set(lengths)) >= 2
    return eos, expected


# ---------------------------------------------------------------------- greedy decode vs generate
@pytest.mark.parametrize("arch, attn", combos())
def test_branches_match_reference(arch, attn):
    """Shared prefix, 6 branches of lengths 0 to 9 (one empty): every branch equals generate on
    prefix + branch, for 14 new tokens (past the sliding window)."""
    model = tiny_model(arch, attn)
    out = multidecode.decode(model, PREFIX, BRANCHES, max_new_tokens=STEPS, eos_token_id=NO_EOS)
    assert out == references(arch, attn, PREFIX, BRANCHES)


@pytest.mark.parametrize("arch, attn", combos())
def test_branches_finishing_on_eos_at_different_steps(arch, attn):
    """With an eos that branches reach at different steps, finished branches leave the forest
    mid-run and the others stay exact; each branch ends with its eos, as generate's does."""
    model = tiny_model(arch, attn)
    eos, expected = eos_case(arch, attn)
    assert multidecode.decode(model, PREFIX, BRANCHES, max_new_tokens=STEPS, eos_token_id=eos) == expected


@pytest.mark.parametrize("every", [1, 2, None])
@pytest.mark.parametrize("arch, attn", combos())
def test_compaction_mid_run(arch, attn, every):
    """Compacting finished branches out of the cache in the middle of a run (every step, every
    other step, or by the dead-slot threshold) keeps every live branch exact; finish reasons say
    stop (eos) or length."""
    model = tiny_model(arch, attn)
    eos, expected = eos_case(arch, attn)
    policy = CompactionPolicy(every=every) if every else CompactionPolicy(min_fraction=0.05, min_slots=1)
    engine = Engine(model)
    out = [[] for _ in BRANCHES]
    reasons = {}
    for event in stream_decode(
        model, PREFIX, BRANCHES, max_new_tokens=STEPS, sampling=[SamplingParams()] * len(BRANCHES),
        eos_token_id=eos, compaction=policy, engine=engine,
    ):
        out[event.branch].append(event.token_id)
        if event.finish_reason is not None:
            reasons[event.branch] = event.finish_reason
    assert out == expected
    assert engine.stats.compactions > 0
    assert engine.stats.slots_dropped > 0 and engine.forest.num_slots < engine.stats.tokens_fed
    assert reasons == {i: "stop" if e[-1] in eos else "length" for i, e in enumerate(expected)}


@pytest.mark.parametrize("arch, attn", combos())
def test_empty_prefix_independent_roots(arch, attn):
    """With no prefix each branch is its own root (all at position 0) in one shared cache."""
    model = tiny_model(arch, attn)
    roots = [PREFIX + b for b in BRANCHES]
    out = multidecode.decode(model, [], roots, max_new_tokens=STEPS, eos_token_id=NO_EOS)
    assert out == references(arch, attn, PREFIX, BRANCHES)


@pytest.mark.parametrize("arch, attn", combos())
def test_one_branch(arch, attn):
    """K = 1, with a suffix and with none: the plain causal path all the way."""
    model = tiny_model(arch, attn)
    full = references(arch, attn, PREFIX, BRANCHES)
    assert multidecode.decode(model, PREFIX, [BRANCHES[5]], max_new_tokens=STEPS, eos_token_id=NO_EOS) == [full[5]]
    assert multidecode.decode(model, PREFIX, [[]], max_new_tokens=STEPS, eos_token_id=NO_EOS) == [full[0]]


@pytest.mark.parametrize("arch, attn", combos())
def test_32_branches(arch, attn):
    """K = 32 branches (two empty, three identical) of lengths 0 to 7 in one forest."""
    model = tiny_model(arch, attn)
    steps = 8
    out = multidecode.decode(model, PREFIX, MANY_BRANCHES, max_new_tokens=steps, eos_token_id=NO_EOS)
    assert out == references(arch, attn, PREFIX, MANY_BRANCHES, steps)


@pytest.mark.parametrize("arch, attn", combos())
def test_engine_reused_for_a_second_decode(arch, attn):
    """A second decode on the same engine starts a new tree beside the first one's cached slots
    and is exact too."""
    model = tiny_model(arch, attn)
    engine = Engine(model)
    full = references(arch, attn, PREFIX, BRANCHES)
    for part in (slice(0, 3), slice(3, 6)):
        out = [[] for _ in BRANCHES[part]]
        for event in stream_decode(model, PREFIX, BRANCHES[part], max_new_tokens=STEPS,
                                   sampling=[SamplingParams()] * 3, eos_token_id=NO_EOS, engine=engine):
            out[event.branch].append(event.token_id)
        assert out == full[part]


# ---------------------------------------------------------------------- engine logits vs plain forwards
def path_logits(model, forest: Forest, node: int) -> torch.Tensor:
    """Next-token logits at `node` from one plain forward of its path alone, at its own positions."""
    path = forest.path(node)
    ids = torch.tensor([[forest.tokens[n] for n in path]])
    positions = torch.tensor([[forest.positions[n] for n in path]])
    with torch.inference_mode():
        return model(input_ids=ids, position_ids=positions).logits[0, -1].float()


def assert_close_to_paths(model, engine, nodes, logits, atol=1e-4):
    for node, row in zip(nodes, logits):
        torch.testing.assert_close(row, path_logits(model, engine.forest, node), atol=atol, rtol=0)


def build_forest(model) -> tuple[Engine, list[int]]:
    """A hand-built forest: a prefix, three branches fed in one pass (two under the prefix's end,
    one under its 3rd node), a second tree at root offset 20, then one step of five nodes, one of
    them off an inner node of a branch and one the child of another new node. Checks the logits of
    every feed and returns the engine and the last step's nodes."""
    engine = Engine(model)
    prefix = engine.feed_chain(PREFIX).nodes
    fed = engine.feed_chains([_fixed(7, 1), _fixed(2, 2), _fixed(9, 3)], [prefix[-1], prefix[-1], prefix[2]])
    chains, logits = fed.nodes, fed.logits
    assert_close_to_paths(model, engine, [c[-1] for c in chains], logits)
    fed = engine.feed_chain(_fixed(5, 4), root_position=20)
    second, logits = fed.nodes, fed.logits
    assert_close_to_paths(model, engine, second[-1:], logits)
    leaves = [chains[0][-1], chains[2][-1], second[-1], chains[0][3]]
    fed = engine.feed([11, 12, 13, 14, 15], [*leaves, -2], logits_for=range(5))
    nodes, logits = fed.nodes, fed.logits
    assert_close_to_paths(model, engine, nodes, logits)
    return engine, nodes


@pytest.mark.parametrize("arch, attn", combos())
def test_engine_logits_match_each_path_alone(arch, attn):
    """In a hand-built forest (see build_forest) the logits at every asked node equal those of a
    plain forward of its path alone at its own positions, to float32 noise."""
    build_forest(tiny_model(arch, attn))


@pytest.mark.parametrize("arch, attn", combos())
def test_engine_logits_after_compaction(arch, attn):
    """After compacting the forest down to three live nodes, feeding more nodes under them still
    gives the logits of each path alone."""
    model = tiny_model(arch, attn)
    engine, nodes = build_forest(model)
    live = [nodes[1], nodes[4], nodes[3]]
    assert engine.compact(live) > 0
    fed = engine.feed([16, 17, 18], [live[0], live[1], -3], logits_for=range(3))
    more, logits = fed.nodes, fed.logits
    assert_close_to_paths(model, engine, more, logits)


def _fixed(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, VOCAB) for _ in range(n)]


# ---------------------------------------------------------------------- known bugs
@pytest.mark.parametrize("arch, attn", [("llama", "sdpa"), ("gpt2", "eager"), ("mistral", "eager")])
def test_chain_fed_after_a_sibling_branch_sees_only_its_ancestors(arch, attn):
    """BUG (Forest.is_plain_continuation): after branch A is fed under the prefix, feeding branch B
    under the same prefix end takes the plain causal path and B attends to A's keys."""
    model = tiny_model(arch, attn)
    engine = Engine(model)
    prefix = engine.feed_chain(PREFIX).nodes
    engine.feed_chain(_fixed(4, 5), parent=prefix[-1])
    fed = engine.feed_chain(_fixed(3, 6), parent=prefix[-1])
    nodes, logits = fed.nodes, fed.logits
    assert_close_to_paths(model, engine, nodes[-1:], logits)


@pytest.mark.parametrize("arch, attn", [("llama", "sdpa"), ("gpt2", "eager"), ("mistral", "eager")])
def test_chain_under_an_inner_prefix_node_sees_only_its_ancestors(arch, attn):
    """BUG (same cause): a chain under the prefix's 3rd node must not see the prefix's later tokens."""
    model = tiny_model(arch, attn)
    engine = Engine(model)
    prefix = engine.feed_chain(PREFIX).nodes
    fed = engine.feed_chain(_fixed(3, 7), parent=prefix[2])
    nodes, logits = fed.nodes, fed.logits
    assert_close_to_paths(model, engine, nodes[-1:], logits)


@pytest.mark.parametrize("arch, attn", combos())
@pytest.mark.parametrize("with_prefix", [True, False], ids=["prefix", "roots"])
def test_branches_prefilled_apart_match_reference(arch, attn, with_prefix):
    """Suffixes prefilled each in its own pass (a scratch cache holding only their path, then
    spliced into the shared cache) decode exactly like one forest pass and like generate."""
    from multidecode.api import start_forest

    prefix = PREFIX if with_prefix else []
    suffixes = [_tokens_fixed(n, seed) for seed, n in enumerate((17, 9, 23, 1))]
    run = start_forest(tiny_model(arch, attn), prefix, suffixes, max_new_tokens=10, sampling=[SamplingParams()] * 4,
                       eos_token_id=NO_EOS, apart=True).finish()
    for suffix, branch in zip(suffixes, run.branches):
        assert tuple(branch.output.token_ids) == reference(arch, attn, tuple(prefix + suffix), 10)
    assert run.engine.stats.forward_passes >= 4 + 9  # one pass per suffix, then the steps


def _tokens_fixed(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def test_the_engine_chooses_apart_only_for_long_chains_under_a_short_path():
    engine = Engine(tiny_model("llama"))
    doc = engine.feed_chain(_tokens_fixed(300, 1)).nodes
    assert not engine.prefers_apart([20] * 8, doc[-1])  # questions under a long document: one pass
    head = engine.feed_chain(_tokens_fixed(10, 2)).nodes
    assert engine.prefers_apart([300] * 8, head[-1])  # long chunks under a short instruction: apart
    assert not engine.prefers_apart([40] * 8, head[-1])  # short notes: the extra passes cost more
    assert not engine.prefers_apart([300], head[-1])  # a single chain: nothing to gain

@pytest.mark.parametrize("arch, attn", combos())
def test_a_long_chain_fed_beside_other_rows_runs_apart_and_stays_exact(arch, attn):
    """A merged forest's step: a token under each of two cached documents, a new 100-token
    document under their short shared opening, and two questions under it, in one feed. The new
    document moves to the front and runs apart (over its 6-slot path, not the 270 slots of the
    others); every node's logits are still those of its path run alone."""
    model = tiny_model(arch, attn)
    engine = Engine(model)
    head = engine.feed_chain(_tokens_fixed(6, 1)).nodes
    first = engine.feed_chain(_tokens_fixed(150, 2), parent=head[-1]).nodes
    second = engine.feed_chain(_tokens_fixed(120, 3), parent=head[-1]).nodes
    document = _tokens_fixed(100, 4)
    tokens = [5, 6, *document, 7, 8, 9]
    parents = [first[-1], second[-1], *chain_parents(100, head[-1], 2), Feed.ref(101), Feed.ref(102), Feed.ref(101)]
    forwards = engine.stats.forward_passes
    fed = engine.feed(tokens, parents, logits_for=[0, 1, 101, 102, 103, 104])
    nodes, logits = fed.nodes, fed.logits
    assert engine.stats.forward_passes - forwards == 2  # the document apart, then the rest as a forest
    assert_close_to_paths(model, engine, [nodes[i] for i in (0, 1, 101, 102, 103, 104)], logits)
    assert engine.forest.path_tokens(nodes[103])[-3:] == [document[-1], 7, 8]


def test_empty_branch_going_on_alone_after_its_sibling_finished():
    """BUG (same cause, through decode): branch 0 is empty, branch 1 finishes on its first token;
    branch 0 then goes on alone under the prefix and must not see branch 1's suffix."""
    arch, attn = "llama", "sdpa"
    model = tiny_model(arch, attn)
    for seed in range(50):
        branches = [[], _fixed(4, 100 + seed)]
        full = references(arch, attn, PREFIX, branches, 8)
        eos = full[1][0]
        if eos not in full[0][:3]:
            break
    expected = truncate(full, {eos})
    assert len(expected[0]) > 2 and len(expected[1]) == 1
    assert multidecode.decode(model, PREFIX, branches, max_new_tokens=8, eos_token_id=eos) == expected


# ---------------------------------------------------------------------- the oracle can fail
def _see_everything(rows, query_positions, key_positions, layout, dtype, device="cpu"):
    """Mutant: every node sees every cached slot (the window still applies)."""
    return build_attention_mask(torch.ones_like(rows), query_positions, key_positions, layout, dtype, device)


def _no_window(rows, query_positions, key_positions, layout, dtype, device="cpu"):
    """Mutant: the sliding window is dropped from the 4D mask."""
    return build_attention_mask(rows, query_positions, key_positions,
                                dataclasses.replace(layout, sliding_window=None), dtype, device)


def _window_by_slot(rows, query_positions, key_positions, layout, dtype, device="cpu"):
    """Mutant: the window measured in slots (cache order) instead of positions."""
    q, k = rows.shape
    return build_attention_mask(rows, torch.arange(k - q, k), torch.arange(k), layout, dtype, device)


def _flat_positions(monkeypatch):
    """Mutant: position ids in cache order (slot numbers), as for one straight sequence."""
    def positions_of(self, nodes):
        return torch.arange(self.num_slots, self.num_slots + len(nodes))

    monkeypatch.setattr(Forest, "positions_of", positions_of)
    monkeypatch.setattr(Forest, "slot_positions", lambda self: torch.arange(self.num_slots))


MUTANTS = {
    "see-everything": lambda mp: mp.setattr(multidecode.engine, "build_attention_mask", _see_everything),
    "flat-positions": _flat_positions,
    "no-window": lambda mp: mp.setattr(multidecode.engine, "build_attention_mask", _no_window),
    "window-by-slot": lambda mp: mp.setattr(multidecode.engine, "build_attention_mask", _window_by_slot),
}
SLIDING_ARCHS = ["mistral", "gemma3", "qwen2-hybrid"]


def mutant_cases():
    cases = []
    for arch in ARCHS:
        for attn in ATTENTION:
            names = ["see-everything", "flat-positions"]
            if arch in SLIDING_ARCHS:
                names += ["no-window", "window-by-slot"]
            cases += [pytest.param(arch, attn, name, id=f"{arch}-{attn}-{name}", marks=pytest.mark.xdist_group(arch))
                      for name in names]
    return cases


@pytest.mark.parametrize("arch, attn, mutant", mutant_cases())
def test_mutant_engine_disagrees_with_reference(arch, attn, mutant, monkeypatch):
    """A wrong mask or wrong positions (patched in this test only) makes decode differ from
    generate, so the exactness tests above can fail."""
    model = tiny_model(arch, attn)
    expected = references(arch, attn, PREFIX, BRANCHES)
    MUTANTS[mutant](monkeypatch)
    out = multidecode.decode(model, PREFIX, BRANCHES, max_new_tokens=STEPS, eos_token_id=NO_EOS)
    assert out != expected


def _longrope_phi3(switch: int):
    """A tiny Phi-3 whose "longrope" rotary embedding switches to its long factors at `switch`."""
    import transformers as tf
    from tiny_models import COMMON, ROPE

    config = tf.Phi3Config(**COMMON, **{**ROPE, "max_position_embeddings": 4 * switch},
                           original_max_position_embeddings=switch,
                           rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                                                long_factor=[4.0] * 8, original_max_position_embeddings=switch))
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    return tf.Phi3ForCausalLM(config).eval()


def test_a_longrope_forest_stays_below_the_switch_and_is_exact_there():
    """transformers turns a whole forward by longrope's long factors once its highest position id
    reaches the switch: a long branch (or a branch's own drafts) would turn its neighbours too.
    A forest keeps below the switch, where each branch equals its run alone, with drafts too,
    and a run that would cross it is refused before any forward, saying why."""
    model = _longrope_phi3(switch=24)
    prefix, branches = _tokens(10), [[], _tokens(1), _tokens(8)]
    for speculate in (None, "lookup"):
        together = multidecode.decode(model, prefix, branches, max_new_tokens=6, eos_token_id=[], speculate=speculate)
        for branch, got in zip(branches, together):
            assert got == reference_generate(model, prefix + branch, max_new_tokens=6, eos_token_id=[NO_EOS])
    with pytest.raises(multidecode.PromptTooLong, match="longrope") as refused:
        multidecode.decode(model, prefix, branches, max_new_tokens=8, eos_token_id=[])  # 18 + 8 - 1 = 25 positions
    assert "max_new_tokens to 7" in refused.value.hint
