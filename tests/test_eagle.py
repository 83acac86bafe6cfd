"""The EAGLE-style head is exact: a random head changes nothing on every architecture (greedy
equals `generate`, with eos inside the run and compaction at every step), a head that knows the
target (on the hash LM) has every draft accepted in the predicted number of steps, stop strings
and eos land inside accepted drafts, sampled output follows the target's softmax (a rule that
trusts the draft fails), and a head written to disk loads back to the same drafts."""

from __future__ import annotations

import math

import pytest
import torch
from hash_lm import VOCAB as HASH_VOCAB
from hash_lm import HashLM, feature, logits_of
from learned_heads import random_head
from speculation_cases import (
    HASH_BRANCHES,
    HASH_PREFIX,
    check_exact_with_eos_and_compaction,
    check_stops_and_eos_inside_drafts,
    hash_expected,
    outputs,
    run,
    sample_three_tokens,
    tiny_references,
)
from tiny_models import combos, tiny_model

from multidecode.errors import InvalidArgument
from multidecode.proposers.eagle import Eagle, EagleHead
from multidecode.speculation import Speculation


class _OracleModel(torch.nn.Module):
    """The hash LM run one pair ahead: a pair's input is (visible sum, position, token); its output
    "feature" is the sum after the token, and its logits pick the hash LM's greedy token there."""

    def __init__(self) -> None:
        super().__init__()
        self.config = HashLM().config
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def get_input_embeddings(self):
        return torch.nn.Embedding(HASH_VOCAB, 1)

    def forward(self, inputs_embeds=None, position_ids=None, past_key_values=None, logits_to_keep=None, **kwargs):
        rows = inputs_embeds[0].double()  # [q, 3]
        past_key_values.update(rows[None, None, :, :1], rows[None, None, :, :1], 0)
        totals = rows[:, 0] + torch.tensor([float(feature(int(t), int(p) + 1)) for _, p, t in rows.tolist()],
                                           dtype=torch.float64)
        hidden = torch.stack([totals, rows[:, 1] + 1], -1)[None]  # [1, q, 2]
        logits = 50 * torch.nn.functional.one_hot(logits_of(totals).argmax(-1), HASH_VOCAB).double()[None]
        if logits_to_keep is not None and not isinstance(logits_to_keep, int):
            logits = logits[:, logits_to_keep]
        return _Out(logits, (hidden,))


class _Out:
    def __init__(self, logits, hidden_states) -> None:
        self.logits, self.hidden_states = logits, hidden_states


class HashOracleHead(EagleHead):
    """An EAGLE head that knows the hash LM: its pairs are (sum, position, token), exactly."""

    def __init__(self, reads_prompt: bool = False) -> None:
        torch.nn.Module.__init__(self)
        self.hidden_size, self.vocab_size, self.target, self.reads_prompt = 2, HASH_VOCAB, None, reads_prompt
        self.model = _OracleModel()
        self.register_buffer("token_ids", torch.arange(HASH_VOCAB))
        self.embed = [None]  # bound: it reads no embeddings

    def bind(self, model):
        return self

    def inputs(self, features, tokens, *, own=False):
        return torch.cat([features.double(), tokens.double()[:, None]], -1)  # [n, 3]


@pytest.mark.parametrize("arch, attn", combos())
def test_a_random_eagle_head_is_exact_with_eos_and_compaction(arch, attn):
    model = tiny_model(arch, attn)
    full = tiny_references(arch, attn)
    head = random_head(model, draft_vocab=model.config.vocab_size // 2)
    check_exact_with_eos_and_compaction(model, full, lambda: Speculation(Eagle(head, confidence=0.0), budget=6))


@pytest.mark.parametrize("reads_prompt", [False, True])
@pytest.mark.parametrize("depth", [1, 3, 6])
def test_a_head_that_knows_the_target_is_accepted_in_full(depth, reads_prompt):
    """On the hash LM, a head that knows it has every draft accepted: after the prompt's step
    each step emits depth + 1 tokens, so the run takes 1 + ceil((n - 1) / (depth + 1)) steps.
    A head that reads the prompt gets its pairs first (the branches' common prompt fed once)."""
    steps = 30
    spec = Speculation(Eagle(HashOracleHead(reads_prompt), width=1, max_depth=depth), budget=depth)
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=spec, max_new_tokens=steps)
    assert outputs(forest) == hash_expected(HASH_PREFIX, HASH_BRANCHES, steps)
    assert forest.stats.steps == 1 + math.ceil((steps - 1) / (depth + 1))
    assert forest.stats.accepted == forest.stats.drafted


def test_stop_strings_and_eos_inside_accepted_eagle_drafts():
    check_stops_and_eos_inside_drafts(lambda: Speculation(Eagle(HashOracleHead(), width=1, max_depth=4), budget=4))


@pytest.mark.slow
@pytest.mark.xdist_group("sampling")
def test_sampled_eagle_speculation_follows_the_softmax_and_a_trusting_rule_fails(monkeypatch):
    """3000 seeded samples with a random head drawing three candidates from its softmax: the
    second tokens after the likeliest first one follow softmax(logits / T); a rule that takes the
    first candidate wherever p gives it any chance fails (the head's guesses are rarely the
    target's likeliest, so a 5% threshold would seldom trust them)."""
    from speculation_cases import SAMPLE_PREFIX, frequencies_pass, tiny_softmax

    def _trusting(p, q, candidates, generator):
        return int(candidates[0]) if p[candidates[0]] > 0 else int(torch.multinomial(p, 1, generator=generator))

    first = int(tiny_softmax(SAMPLE_PREFIX).argmax())
    probs = tiny_softmax(SAMPLE_PREFIX + [first])

    def spec_of(model):
        return Speculation(Eagle(random_head(model, seed=4), width=3, confidence=0.0, max_depth=1), budget=3,
                           against_q=True)

    seconds, _, stats = sample_three_tokens(3000, spec_of)
    assert stats.accepted > 100
    assert len(seconds) > 200 and frequencies_pass(seconds, probs)
    monkeypatch.setattr("multidecode.verify.speculative_sample", _trusting)
    seconds, _, _ = sample_three_tokens(3000, spec_of)
    assert not frequencies_pass(seconds, probs)


def test_a_head_round_trips_and_one_for_another_model_is_refused(tmp_path):
    model = tiny_model("llama", "sdpa")
    head = random_head(model, draft_vocab=64)
    head.save(tmp_path / "head")
    loaded = EagleHead.load(tmp_path / "head").bind(model)
    pairs = head.inputs(torch.randn(3, model.config.hidden_size), torch.tensor([5, 6, 7]))
    assert torch.equal(loaded.inputs(torch.zeros(1, model.config.hidden_size), torch.tensor([5])),
                       head.inputs(torch.zeros(1, model.config.hidden_size), torch.tensor([5])))
    with torch.no_grad():
        assert torch.equal(loaded.model(inputs_embeds=pairs[None]).logits, head.model(inputs_embeds=pairs[None]).logits)
    with pytest.raises(InvalidArgument, match="another model|hidden size"):
        EagleHead.load(tmp_path / "head").bind(tiny_model("qwen2", "sdpa"))
    (tmp_path / "medusa").mkdir()
    (tmp_path / "medusa" / "config.json").write_text('{"medusa_num_heads": 2}')
    (tmp_path / "medusa" / "eagle_head.pt").write_bytes(b"")
    with pytest.raises(InvalidArgument):
        EagleHead.load(tmp_path / "medusa")


def test_a_head_that_reads_the_prompt_gets_its_pairs_in_order_and_the_common_prompt_once():
    """Every pair the head is fed is (the state at t, the token at t + 1) of its branch; the
    branches' common prompt reaches it once, as a shared trunk."""
    rows = []

    class Recording(_OracleModel):
        def forward(self, inputs_embeds=None, position_ids=None, past_key_values=None, logits_to_keep=None, **kwargs):
            rows.extend(inputs_embeds[0].tolist())
            return super().forward(inputs_embeds, position_ids, past_key_values, logits_to_keep, **kwargs)

    head = HashOracleHead(reads_prompt=True)
    head.model = Recording()
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=Speculation(Eagle(head, width=1, max_depth=3),
                                                                             budget=3), max_new_tokens=12)
    sequences = [HASH_PREFIX + b + out for b, out in zip(HASH_BRANCHES, outputs(forest))]
    for _, position, token in rows:
        assert any(len(s) > position + 1 and s[int(position) + 1] == token for s in sequences)
    assert sum(position + 1 < len(HASH_PREFIX) for _, position, _ in rows) == len(HASH_PREFIX) - 1
