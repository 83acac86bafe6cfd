"""Medusa heads are exact: random heads change nothing on every architecture (greedy equals
`generate`, with eos inside the run and compaction at every step), heads that agree with the
target (on the hash LM) have every draft accepted in the predicted number of steps, stop strings
and eos land inside accepted drafts, sampled output follows the target's softmax under the
speculative-sampling rule (a rule that trusts the draft fails), and heads in Medusa's published
layout and in ours load, while heads for another model are refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hash_lm import VOCAB as HASH_VOCAB
from hash_lm import HashLM, feature, logits_of
from learned_heads import random_heads
from speculation_cases import (
    BRANCHES,
    HASH_BRANCHES,
    HASH_PREFIX,
    NO_EOS,
    PREFIX,
    SAMPLE_PREFIX,
    STEPS,
    check_exact_with_eos_and_compaction,
    check_stops_and_eos_inside_drafts,
    frequencies_pass,
    hash_expected,
    outputs,
    run,
    sample_three_tokens,
    tiny_references,
    tiny_softmax,
    trusting_rule,
)
from tiny_models import combos, tiny_model

import multidecode
from multidecode.errors import InvalidArgument
from multidecode.proposers.heads import fingerprint
from multidecode.proposers.medusa import Medusa, MedusaHeads
from multidecode.speculation import Speculation, SpeculationSettings, load_heads


class HashOracle(torch.nn.Module):
    """Heads that know the hash LM: from its "hidden state" (the visible sum and the position at
    the node that chose the newest token) they compute its greedy continuation, head k the token
    k + 1 after the newest one."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.num_heads, self.vocab_size, self.token_ids = heads, HASH_VOCAB, None

    def bind(self, model):
        return self

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        out = []
        for total, position in features.double().tolist():
            total = total + float(feature(int(logits_of(torch.tensor(total, dtype=torch.float64)).argmax()), int(position) + 1))
            rows = []
            for k in range(self.num_heads):
                row = logits_of(torch.tensor(total, dtype=torch.float64))
                rows.append(50 * torch.nn.functional.one_hot(row.argmax(), HASH_VOCAB))  # sure: the tree is a chain
                total = total + float(feature(int(row.argmax()), int(position) + 2 + k))
            out.append(torch.stack(rows))
        return torch.stack(out).float()  # [B, K, V]


@pytest.mark.parametrize("arch, attn", combos())
def test_random_medusa_heads_are_exact_with_eos_and_compaction(arch, attn):
    """Greedy with random heads (a draft vocabulary of half the tokens) equals generate, also with
    eos inside the run and finished branches compacted out at every step."""
    model = tiny_model(arch, attn)
    full = tiny_references(arch, attn)
    heads = random_heads(model, draft_vocab=model.config.vocab_size // 2)
    check_exact_with_eos_and_compaction(model, full, lambda: Speculation(Medusa(heads, min_chance=0.0), budget=6))


@pytest.mark.parametrize("heads", [1, 3, 5])
def test_heads_that_agree_with_the_target_are_accepted_in_full(heads):
    """On the hash LM, heads that know it have every draft accepted: after the prompt's step each
    step emits heads + 1 tokens, so the run takes 1 + ceil((n - 1) / (heads + 1)) steps."""
    steps = 30
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=Speculation(Medusa(HashOracle(heads)), budget=heads),
                 max_new_tokens=steps)
    assert outputs(forest) == hash_expected(HASH_PREFIX, HASH_BRANCHES, steps)
    assert forest.stats.steps == 1 + math.ceil((steps - 1) / (heads + 1))
    assert forest.stats.accepted == forest.stats.drafted


def test_stop_strings_and_eos_inside_accepted_medusa_drafts():
    """Stop strings and eos land inside accepted drafts; the text is cut where sequential decoding cuts."""
    check_stops_and_eos_inside_drafts(lambda: Speculation(Medusa(HashOracle(4)), budget=4))


def _perturbed_heads(model) -> MedusaHeads:
    """Heads whose head 0 is close to the target's next-token guess: right often, not always."""
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, 2, target=fingerprint(model)).bind(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        heads.shared += 0.5 * heads.shared.std() * torch.randn(heads.shared.shape, generator=generator)
    return heads


@pytest.mark.slow
@pytest.mark.xdist_group("sampling")
def test_sampled_medusa_speculation_follows_the_softmax_and_a_trusting_rule_fails(monkeypatch):
    """3000 seeded samples with Medusa heads drafting three candidates drawn from their softmax:
    the second tokens after the likeliest first one follow softmax(logits / T). Control: a rule that
    takes the first candidate where p gives it 5% fails."""
    first = int(tiny_softmax(SAMPLE_PREFIX).argmax())
    probs = tiny_softmax(SAMPLE_PREFIX + [first])

    def spec_of(model):
        return Speculation(Medusa(_perturbed_heads(model), width=3, min_chance=0.0), budget=3, against_q=True)

    seconds, _, stats = sample_three_tokens(3000, spec_of)
    assert stats.accepted > 300 and stats.accepted < stats.drafted / 2
    assert len(seconds) > 200 and frequencies_pass(seconds, probs)
    monkeypatch.setattr("multidecode.verify.speculative_sample", trusting_rule)
    seconds, _, _ = sample_three_tokens(3000, spec_of)
    assert not frequencies_pass(seconds, probs)


# ---------------------------------------------------------------------- files
def test_heads_round_trip_and_load_in_medusas_published_layout(tmp_path):
    """Heads written by `save` load back with the same output; a folder in Medusa's own layout
    (a .pt state dict with each head's projection) loads and drafts exactly."""
    model = tiny_model("llama", "sdpa")
    heads = random_heads(model, draft_vocab=40)
    heads.save(tmp_path / "ours")
    loaded = MedusaHeads.load(tmp_path / "ours").bind(model)
    features = torch.randn(2, model.config.hidden_size)
    assert torch.equal(loaded(features), heads(features))

    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                       "base_model_name_or_path": "tiny"}))
    state = {}
    for k in range(2):
        state[f"{k}.0.linear.weight"] = torch.randn(hidden, hidden)
        state[f"{k}.0.linear.bias"] = torch.randn(hidden)
        state[f"{k}.1.weight"] = torch.randn(vocab, hidden)
    torch.save(state, published / "medusa_lm_head.pt")
    module = load_heads(SpeculationSettings.parse(head=str(published)), model)
    assert module.projections is not None and module.num_heads == 2
    x = torch.randn(1, hidden)
    r = x + torch.nn.functional.silu(x @ state["1.0.linear.weight"].T + state["1.0.linear.bias"])
    assert torch.allclose(module(x)[0, 1], r[0] @ state["1.1.weight"].T, atol=1e-4)
    assert outputs(run(model, PREFIX, BRANCHES, speculate=Speculation(Medusa(module), budget=4),
                       max_new_tokens=STEPS, eos=[NO_EOS])) == tiny_references("llama", "sdpa")


def test_heads_for_another_model_or_a_broken_folder_are_refused(tmp_path):
    model = tiny_model("llama", "sdpa")
    random_heads(tiny_model("qwen2", "sdpa")).save(tmp_path / "qwen")
    with pytest.raises(InvalidArgument, match="another model|hidden size"):
        MedusaHeads.load(tmp_path / "qwen").bind(model)
    other = tiny_model("llama", "eager")
    changed = MedusaHeads(model.config.hidden_size, model.config.vocab_size, 2, target=fingerprint(model))
    changed.target = dict(changed.target, probe=[-v for v in changed.target["probe"]])
    with pytest.raises(InvalidArgument, match="other weights"):
        changed.bind(other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgument, match="config.json"):
        MedusaHeads.load(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("[]")  # was "missing list indices must be integers"
    with pytest.raises(InvalidArgument, match="holds a JSON list, not an object of settings"):
        MedusaHeads.load(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(InvalidArgument, match="medusa_lm_head"):
        MedusaHeads.load(tmp_path / "empty")
    # a config that disagrees with the weights, a draft vocabulary past the model's: were torch tracebacks
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    MedusaHeads(hidden, vocab, 2, target=fingerprint(model)).save(tmp_path / "edited")
    config = json.loads((tmp_path / "edited" / "config.json").read_text())
    (tmp_path / "edited" / "config.json").write_text(json.dumps({**config, "hidden_size": hidden + 32}))
    with pytest.raises(InvalidArgument, match="file of the Medusa heads in .* does not match its config"):
        MedusaHeads.load(tmp_path / "edited")
    past = MedusaHeads(hidden, vocab, 2, token_ids=torch.tensor([0, 5, vocab + 7]), target=fingerprint(model))
    with pytest.raises(InvalidArgument, match=f"draft vocabulary names token id {vocab + 7}, outside the model's"):
        past.bind(model)


def test_speculate_medusa_finds_the_heads_trained_for_the_model(tmp_path, monkeypatch):
    """The decoder's speculate="medusa" reads the heads from the user cache, keyed by the model;
    with none there, it names the command that trains them."""
    from multidecode.proposers.heads import head_dir

    monkeypatch.setenv("MULTIDECODE_CACHE", str(tmp_path))
    model = tiny_model("llama", "sdpa")
    decoder = multidecode.MultiDecoder(model, tokenizer=None)
    with pytest.raises(InvalidArgument, match="train-drafter"):
        decoder.speculation("medusa")
    random_heads(model).save(head_dir(model, "medusa"))
    spec = decoder.speculation("medusa")
    assert isinstance(spec.proposer, Medusa) and spec.proposer.heads.num_heads == 3
    assert outputs(run(model, PREFIX, BRANCHES, speculate=spec, max_new_tokens=STEPS,
                       eos=[NO_EOS])) == tiny_references("llama", "sdpa")


def test_decode_refuses_medusa_without_heads_with_a_hint_it_can_follow(tmp_path):
    """`decode` finds no heads of its own: its refusal names the spelling it takes (the proposer on
    heads loaded from a folder, and where they live), and that spelling gives plain greedy's tokens."""
    model = tiny_model("llama", "sdpa")
    with pytest.raises(InvalidArgument, match="needs a medusa head") as refused:
        multidecode.decode(model, PREFIX, BRANCHES, max_new_tokens=2, speculate="medusa")
    assert "speculate=Medusa(MedusaHeads.load(folder)), both from multidecode.proposers.medusa" in refused.value.hint
    random_heads(model).save(tmp_path / "heads")
    assert outputs(run(model, PREFIX, BRANCHES, speculate=Medusa(MedusaHeads.load(tmp_path / "heads")),
                       max_new_tokens=STEPS, eos=[NO_EOS])) == tiny_references("llama", "sdpa")
