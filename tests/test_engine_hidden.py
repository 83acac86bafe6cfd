"""A feed returns the hidden states of the layers it is asked for, at its logits nodes, equal to
what the model's own `hidden_states` give for each node's path run alone: in a plain chain, in a
forest forward and in chains run apart, for any set of layers (an EAGLE-3 head reads three)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import MAIN_ARCHITECTURES, tiny_model

from multidecode.engine import Engine
from multidecode.forest import ROOT

LAYERS = [0, 2, -1]
PROMPT = [5, 9, 14, 3, 77, 21, 8]
BRANCHES = [[40, 41, 42], [50], [60, 61, 62, 63, 64]]


def alone(model, path: list[int]) -> torch.Tensor:
    """[len(LAYERS), hidden]: the model's states at the path's last token, the path run alone."""
    with torch.inference_mode():
        states = model(torch.tensor([path]), output_hidden_states=True).hidden_states
    return torch.stack([states[layer][0, -1] for layer in LAYERS])


@pytest.mark.parametrize("arch", MAIN_ARCHITECTURES)
@pytest.mark.parametrize("apart", [False, True])
def test_a_feed_returns_each_asked_layer_at_its_logits_nodes(arch, apart):
    model = tiny_model(arch, "sdpa")
    engine = Engine(model, apart=apart)
    with torch.inference_mode():
        prompt = engine.feed(PROMPT, [ROOT] + [-(i + 2) for i in range(len(PROMPT) - 1)],
                             logits_for=[len(PROMPT) - 1], hidden_layers=LAYERS)
        assert prompt.hidden.shape == (1, len(LAYERS), model.config.hidden_size)
        assert torch.allclose(prompt.hidden[0].float(), alone(model, PROMPT), atol=1e-4)
        chains = engine.feed_chains(BRANCHES, [prompt.nodes[-1]] * len(BRANCHES), hidden_layers=LAYERS)
        for i, branch in enumerate(BRANCHES):
            assert torch.allclose(chains.hidden[i].float(), alone(model, PROMPT + branch), atol=1e-4)
        # a feed that asks for none keeps none
        assert engine.feed([7], [chains.nodes[0][-1]]).hidden is None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_feed_can_keep_the_states_of_every_node(arch):
    """`hidden_for`: the states of other nodes than those with logits (a drafter that reads the
    whole prompt), each equal to its path run alone."""
    model = tiny_model(arch, "sdpa")
    engine = Engine(model)
    with torch.inference_mode():
        fed = engine.feed(PROMPT, [ROOT] + [-(i + 2) for i in range(len(PROMPT) - 1)], logits_for=[len(PROMPT) - 1],
                          hidden_layers=LAYERS, hidden_for=range(len(PROMPT)))
    assert fed.hidden.shape[0] == len(PROMPT)
    for i in range(len(PROMPT)):
        assert torch.allclose(fed.hidden[i].float(), alone(model, PROMPT[: i + 1]), atol=1e-4)
