"""A checkpoint's multi-token-prediction layer drafts exactly: on three families that ship one
(Mellum: hybrid sliding layers and MoE; GLM-4.5: partial rotary, MoE; DeepSeek-V3: latent
attention, MoE) a random MTP layer changes nothing (greedy equals `generate`, with eos inside the
run and compaction at every step); run on a forest it computes what transformers' own MTP module
computes; it is read from the files the model was loaded from, by name (`speculate="mtp"`, the
CLI's `--speculate mtp`, and `auto`), and a model without one is refused with a clear message."""

from __future__ import annotations

import json

import pytest
import torch
from local_models import tiny_model_folder, tiny_mtp_folder
from speculation_cases import BRANCHES, NO_EOS, PREFIX, STEPS, check_exact_with_eos_and_compaction, outputs, run
from tiny_models import random_mtp, reference_generate, tiny_mtp_model

import multidecode
from multidecode.engine import Engine
from multidecode.errors import InvalidArgument
from multidecode.forest import ROOT, chain_parents
from multidecode.proposers.mtp import Mtp, MtpHead
from multidecode.speculation import Speculation, SpeculationSettings

try:
    from transformers.modeling_layers import MtpModel  # noqa: F401
except ImportError:
    pytest.skip("MTP layers need transformers 5.24+", allow_module_level=True)

MTP_ARCHS = ["mellum", "glm4_moe", "deepseek_v3"]


def references(model, branches=BRANCHES, steps=STEPS):
    return [reference_generate(model, PREFIX + b, max_new_tokens=steps, eos_token_id=NO_EOS) for b in branches]


@pytest.mark.parametrize("arch, attn", [pytest.param(a, t, id=f"{a}-{t}", marks=pytest.mark.xdist_group(f"mtp-{a}"))
                                        for a in MTP_ARCHS for t in ("eager", "sdpa")])
def test_a_random_mtp_layer_is_exact_with_eos_and_compaction(arch, attn):
    model = tiny_mtp_model(arch, attn)
    full = references(model)
    head = MtpHead(random_mtp(model)).bind(model)
    check_exact_with_eos_and_compaction(model, full, lambda: Speculation(Mtp(head, width=2, confidence=0.0), budget=6))


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_the_mtp_layer_on_a_forest_computes_what_transformers_mtp_module_does(arch):
    """A chain of pairs (the target's feature at each position, the token after it) fed through
    the head's engine gives, at every pair, the hidden state and logits of transformers'
    `MtpModel.forward_layer` over the same chain (its own causal mask, cache and positions)."""
    from transformers import DynamicCache

    model = tiny_mtp_model(arch, "eager")
    mtp = random_mtp(model)
    head = MtpHead(mtp).bind(model)
    ids = torch.tensor([PREFIX])
    with torch.inference_mode():
        features = model(ids, output_hidden_states=True).hidden_states[-1][0, :-1]  # [n - 1, hidden]
        tokens = ids[0, 1:]  # the token after each feature
        theirs = mtp.forward_layer(0, features[None], torch.arange(len(tokens))[None],
                                   DynamicCache(config=mtp.config), input_ids=tokens[None])[0]  # [n - 1, hidden]
        engine = Engine(head.model)
        fed = engine.feed(tokens.tolist(), chain_parents(len(tokens)), logits_for=range(len(tokens)),
                          hidden_layers=[-1], embeds=head.inputs(features, tokens))
        ours = fed.hidden[:, 0]
        assert torch.allclose(ours, theirs, atol=1e-5)
        assert torch.allclose(fed.logits, mtp.shared_head(theirs).float(), atol=1e-4)
        # one pair at a time (plain continuations, no mask given): Mellum's MTP layer keeps its
        # sliding window (6) past the window's length
        engine, node, states = Engine(head.model), ROOT, []
        for i, token in enumerate(tokens.tolist()):
            fed = engine.feed([token], [node], logits_for=[0], hidden_layers=[-1],
                              embeds=head.inputs(features[i:i + 1], tokens[i:i + 1]))
            (node,) = fed.nodes
            states.append(fed.hidden[0, 0])
        assert torch.allclose(torch.stack(states), theirs, atol=1e-5)


def _drafting_decoder(tmp_path):
    """Tiny Mellum (a mixture of experts: its stacked expert weights run on torch's own kernels, so
    it loads with exact=False, exact to the token in float32) and its MTP layer."""
    folder = tiny_mtp_folder(tmp_path / "mellum")
    return folder, multidecode.load(str(folder), precision="float32", exact=False)


def test_speculate_mtp_reads_the_layer_from_the_checkpoint_and_stays_exact(tmp_path):
    from safetensors.torch import load_file

    folder, decoder = _drafting_decoder(tmp_path)
    head = MtpHead.of(decoder.model)
    written = load_file(folder / "model.safetensors")
    assert torch.equal(head.model.mtp.layers[0].eh_proj.weight, written["mtp.layers.0.eh_proj.weight"])
    assert torch.equal(head.model.mtp.layers[0].mtp_block.self_attn.q_proj.weight,
                       written["mtp.layers.0.mtp_block.self_attn.q_proj.weight"])
    prompt = decoder.tokenizer("Here is a document about support calls")["input_ids"]
    expected = reference_generate(decoder.model, prompt, max_new_tokens=16, eos_token_id=NO_EOS)
    for speculate in ("mtp", SpeculationSettings.parse("mtp", budget=3), "auto"):
        forest = run(decoder.model, prompt, [[]], speculate=decoder.speculation(speculate), max_new_tokens=16,
                     eos=[NO_EOS])
        assert outputs(forest) == [expected]
    assert [type(h) for h in decoder.learned_heads()] == [MtpHead]  # auto drafts with it where it pays
    assert run(decoder.model, prompt, [[]], speculate="mtp", max_new_tokens=8).stats.drafted > 0


def test_a_model_without_mtp_layers_or_their_weights_is_refused_clearly(tmp_path):
    plain = multidecode.load(str(tiny_model_folder(tmp_path / "llama")), precision="float32")
    with pytest.raises(InvalidArgument, match="no multi-token-prediction layers"):
        plain.speculation("mtp")
    assert plain.learned_heads() == []  # auto goes without
    folder = tiny_mtp_folder(tmp_path / "mellum")
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith("mtp.")}, weights,
              metadata={"format": "pt"})
    stripped = multidecode.load(str(folder), precision="float32", exact=False)
    with pytest.raises(InvalidArgument, match="MTP layers of .* could not be read"):
        stripped.speculation("mtp")
    with pytest.raises(InvalidArgument, match="model's own checkpoint"):
        SpeculationSettings.parse("mtp", head=str(folder))
    # a server drafting with an EAGLE head from a folder hands no folder to a request's "mtp"
    assert SpeculationSettings.parse("eagle", head=str(folder)).with_mode("mtp") == SpeculationSettings("mtp")


def test_a_mixture_of_experts_is_refused_the_exact_kernels_and_said_so(tmp_path):
    """Its stacked expert weights are multiplied by torch's own kernels: `load` refuses it with the
    exact kernels, naming them; the command line says so once and runs on the model's own, saying
    what they keep at its precision (the token in float32; in bfloat16 they said so too, wrongly)."""
    from click.testing import CliRunner

    from multidecode.cli import main
    from multidecode.errors import NotBitExact

    folder = tiny_mtp_folder(tmp_path / "mellum")
    with pytest.raises(NotBitExact, match="experts") as refused:
        multidecode.load(str(folder), precision="float32")
    assert "exact=False" in refused.value.hint
    result = CliRunner().invoke(main, ["generate", "--model", str(folder), "-p", "Here is", "--max-new-tokens", "3",
                                       "--precision", "float32"])
    assert result.exit_code == 0 and "exact to the token, not the bit" in result.stderr
    # in bfloat16 the model's own kernels can break a near-tie otherwise than a branch alone: said so
    with pytest.raises(NotBitExact) as refused:
        multidecode.load(str(folder), precision="bfloat16")
    assert "in float32 with exact=False" in refused.value.hint
    result = CliRunner().invoke(main, ["generate", "--model", str(folder), "-p", "Here is", "--max-new-tokens", "3",
                                       "--precision", "bfloat16"])
    assert result.exit_code == 0 and "exact to the token, not" not in result.stderr
    assert "in bfloat16 a near-tie can break" in " ".join(result.stderr.split())
    # speculation there is refused in the options' words (it said "the default of `load`" and speculate='auto')
    result = CliRunner().invoke(main, ["generate", "--model", str(folder), "-p", "Here is", "--max-new-tokens", "3",
                                       "--precision", "int8", "--speculate", "lookup"])
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "cannot be exact in bfloat16 (the dtype the model computes in)" in said, said
    assert "--precision float32" in said and "--speculate auto" in said and "`load`" not in said


def test_the_cli_drafts_with_the_checkpoints_mtp_layer(tmp_path):
    from click.testing import CliRunner

    from multidecode.cli import main

    folder = tiny_mtp_folder(tmp_path / "mellum")
    runner = CliRunner()
    args = ["complete", "--model", str(folder), "-p", "Here is a document", "--max-new-tokens", "12",
            "--precision", "float32", "--json", "--greedy", "--n", "1"]
    plain = runner.invoke(main, args)
    drafted = runner.invoke(main, [*args, "--speculate", "mtp", "--stats"])
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    assert json.loads(plain.stdout) == json.loads(drafted.stdout)
    assert "speculate=mtp" in drafted.stderr
    refused = runner.invoke(main, ["complete", "--model", str(tiny_model_folder(tmp_path / "llama")), "-p", "hi",
                                   "--speculate", "mtp"])
    assert refused.exit_code != 0 and "no multi-token-prediction layers" in refused.output
    assert "Traceback" not in refused.output
