"""Published EAGLE heads load in their own layouts and draft exactly: tiny heads are written as the
EAGLE project publishes EAGLE-1/2 heads (`pytorch_model.bin`: `fc`, `layers.0.*` without an input
norm, no final norm) and EAGLE-3 heads (`midlayer.*`, `d2t`, a draft LM head), and in the
`speculators` format vLLM reads (`layers.0.*`, its own embeddings, named aux layers,
`norm_before_residual`). Each loads through `EagleHead.load` (what `--draft-head` reads), computes
on a forest what an independent re-statement of its published forward computes, and changes
nothing in the output of a run (greedy equals `generate`, with eos and compaction), alone and in
`auto` beside Medusa heads that read another layer."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from learned_heads import random_heads
from speculation_cases import (
    BRANCHES,
    NO_EOS,
    PREFIX,
    STEPS,
    check_exact_with_eos_and_compaction,
    outputs,
    run,
    tiny_references,
)
from tiny_models import VOCAB, tiny_model

from multidecode.engine import Engine
from multidecode.errors import InvalidArgument
from multidecode.forest import chain_parents
from multidecode.proposers.eagle import Eagle, EagleHead
from multidecode.proposers.eagle3 import Eagle3Head
from multidecode.speculation import Speculation, auto_proposer

H, HEADS, KV, HD, FF, EPS, THETA = 64, 4, 2, 16, 128, 1e-6, 10000.0
DRAFT_VOCAB = 96
LAYER = dict(hidden_size=H, intermediate_size=FF, num_hidden_layers=1, num_attention_heads=HEADS,
             num_key_value_heads=KV, rms_norm_eps=EPS, rope_theta=THETA, max_position_embeddings=2048,
             vocab_size=VOCAB, hidden_act="silu")


def _random(generator, *shape, scale=0.15):
    return torch.randn(*shape, generator=generator) * scale


def _layer(generator, prefix: str, width: int, hd: int = HD) -> dict[str, torch.Tensor]:
    """A decoder layer's attention (reading `width`, heads of `hd`) and MLP weights, and its
    post-attention norm."""
    return {f"{prefix}self_attn.q_proj.weight": _random(generator, HEADS * hd, width),
            f"{prefix}self_attn.k_proj.weight": _random(generator, KV * hd, width),
            f"{prefix}self_attn.v_proj.weight": _random(generator, KV * hd, width),
            f"{prefix}self_attn.o_proj.weight": _random(generator, H, HEADS * hd),
            f"{prefix}mlp.gate_proj.weight": _random(generator, FF, H),
            f"{prefix}mlp.up_proj.weight": _random(generator, FF, H),
            f"{prefix}mlp.down_proj.weight": _random(generator, H, FF),
            f"{prefix}post_attention_layernorm.weight": 1 + _random(generator, H, scale=0.1)}


def write_eagle1(folder, seed: int = 1, vocab: int = VOCAB):
    """An EAGLE-1/2 head as the EAGLE project publishes it (with fc's bias, and a copy of the
    target's embeddings that is not read), for a target of `vocab` tokens."""
    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LAYER, "architectures": ["LlamaForCausalLM"],
                                                    "model_type": "llama", "bias": True, "vocab_size": vocab}))
    tensors = {"fc.weight": _random(g, H, 2 * H), "fc.bias": _random(g, H), **_layer(g, "layers.0.", H),
               "embed_tokens.weight": _random(g, vocab, H)}
    torch.save(tensors, folder / "pytorch_model.bin")
    return folder


def _eagle3_tensors(g, prefix: str, aux: int, vocab: int = VOCAB, hd: int = HD) -> dict[str, torch.Tensor]:
    used = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
    return {"fc.weight": _random(g, H, aux * H), f"{prefix}input_layernorm.weight": 1 + _random(g, H, scale=0.1),
            f"{prefix}hidden_norm.weight": 1 + _random(g, H, scale=0.1), **_layer(g, prefix, 2 * H, hd),
            "norm.weight": 1 + _random(g, H, scale=0.1), "lm_head.weight": _random(g, DRAFT_VOCAB, H),
            "d2t": used - torch.arange(DRAFT_VOCAB), "t2d": torch.isin(torch.arange(vocab), used)}


def write_eagle3(folder, seed: int = 2, vocab: int = VOCAB):
    """An EAGLE-3 head in the EAGLE project's layout (model.safetensors; aux layers by default)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LAYER, "architectures": ["LlamaForCausalLMEagle3"],
                                                    "model_type": "llama", "draft_vocab_size": DRAFT_VOCAB,
                                                    "vocab_size": vocab}))
    save_file(_eagle3_tensors(g, "midlayer.", 3, vocab), str(folder / "model.safetensors"))
    return folder


SPECULATORS_AUX = [1, 2, 3]


def write_speculators(folder, seed: int = 3, vocab: int = VOCAB, aux: list[int] = SPECULATORS_AUX):
    """An EAGLE-3 head in the speculators format: its own embeddings, aux layers named, the
    residual taken after hidden_norm."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": True, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": aux,
              "transformer_layer_config": {**LAYER, "model_type": "llama", "head_dim": HD, "vocab_size": vocab},
              "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny-llama"}}}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({**_eagle3_tensors(g, "layers.0.", len(aux), vocab), "embed_tokens.weight": _random(g, vocab, H, scale=0.5)},
              str(folder / "model.safetensors"))
    return folder


WRITERS = {"eagle1": write_eagle1, "eagle3": write_eagle3, "speculators": write_speculators}


# ---------------------------------------------------------------------- the published forwards, restated
def _rms(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _rope(x):  # x [n, heads, HD] at positions 0..n-1
    inverse = 1.0 / THETA ** (torch.arange(0, HD, 2).float() / HD)
    angles = torch.arange(x.shape[0]).float()[:, None] * inverse[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., HD // 2:], x[..., : HD // 2]], -1) * sin


def _attention(x, w, prefix):
    n = x.shape[0]
    q = _rope((x @ w[f"{prefix}self_attn.q_proj.weight"].T).view(n, HEADS, HD))
    k = _rope((x @ w[f"{prefix}self_attn.k_proj.weight"].T).view(n, KV, HD)).repeat_interleave(HEADS // KV, 1)
    v = (x @ w[f"{prefix}self_attn.v_proj.weight"].T).view(n, KV, HD).repeat_interleave(HEADS // KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * HD)
    return out @ w[f"{prefix}self_attn.o_proj.weight"].T


def _mlp(x, w, prefix):
    return (F.silu(x @ w[f"{prefix}mlp.gate_proj.weight"].T) * (x @ w[f"{prefix}mlp.up_proj.weight"].T)) \
        @ w[f"{prefix}mlp.down_proj.weight"].T


def reference(kind: str, w: dict, embeds, features, target_head):
    """The published forward over a chain of pairs: (logits over the target's vocabulary with
    -inf outside the draft vocabulary [n, VOCAB], the hidden state fed back [n, H])."""
    if kind == "eagle1":  # fc([emb; f]) -> a layer without input norm; the target's LM head reads it raw
        x = torch.cat([embeds, features], -1) @ w["fc.weight"].T + w["fc.bias"]
        x = x + _attention(x, w, "layers.0.")
        x = x + _mlp(_rms(x, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.")
        return x @ target_head.T, x
    p = "midlayer." if kind == "eagle3" else "layers.0."
    hidden = features @ w["fc.weight"].T
    normed = _rms(hidden, w[f"{p}hidden_norm.weight"])
    x = torch.cat([_rms(embeds, w[f"{p}input_layernorm.weight"]), normed], -1)
    x = (normed if kind == "speculators" else hidden) + _attention(x, w, p)
    x = x + _mlp(_rms(x, w[f"{p}post_attention_layernorm.weight"]), w, p)
    draft = _rms(x, w["norm.weight"]) @ w["lm_head.weight"].T  # [n, Vd]
    full = torch.full((x.shape[0], VOCAB), float("-inf"))
    full[:, torch.arange(DRAFT_VOCAB) + w["d2t"]] = draft
    return full, x


def _weights(folder):
    from safetensors.torch import load_file

    path = folder / "model.safetensors"
    return load_file(path) if path.exists() else torch.load(folder / "pytorch_model.bin")


@pytest.mark.parametrize("kind", list(WRITERS))
def test_a_published_head_computes_its_published_forward_on_a_forest(kind, tmp_path):
    model = tiny_model("llama", "sdpa")
    head = EagleHead.load(WRITERS[kind](tmp_path / kind)).bind(model)
    assert isinstance(head, Eagle3Head) == (kind != "eagle1")
    w = _weights(tmp_path / kind)
    ids = torch.tensor([PREFIX])
    layers = {"eagle1": [-1], "eagle3": [0, 1, 2], "speculators": SPECULATORS_AUX}[kind]
    assert list(Eagle(head).layers) == layers
    with torch.inference_mode():
        states = model(ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i][0, :-1] for i in layers], -1)  # [n, layers * H]
        tokens = ids[0, 1:]
        table = w["embed_tokens.weight"] if kind == "speculators" else model.get_input_embeddings().weight
        expected, fed_back = reference(kind, w, table[tokens], features, model.lm_head.weight)
        engine = Engine(head.model)
        fed = engine.feed(tokens.tolist(), chain_parents(len(tokens)), logits_for=range(len(tokens)),
                          hidden_layers=[-1], embeds=head.inputs(features, tokens))
        ours = torch.full_like(expected, float("-inf"))
        ours[:, head.token_ids] = fed.logits
        assert torch.allclose(ours, expected, atol=1e-4)
        assert torch.allclose(fed.hidden[:, 0], fed_back, atol=1e-4)
        if kind != "eagle1":  # a deeper node's input is its parent's output beside the token, fc not applied again
            assert torch.equal(head.inputs(fed_back[:2], tokens[:2], own=True)[:, H:], fed_back[:2])


@pytest.mark.parametrize("kind", list(WRITERS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_published_head_is_exact_with_eos_and_compaction(kind, arch, tmp_path):
    model = tiny_model(arch, "sdpa")
    full = tiny_references(arch, "sdpa")
    head = EagleHead.load(WRITERS[kind](tmp_path / kind)).bind(model)
    check_exact_with_eos_and_compaction(model, full, lambda: Speculation(Eagle(head, width=2, confidence=0.0),
                                                                         budget=6))


def test_auto_drafts_with_heads_that_read_different_layers(tmp_path):
    """Medusa heads read the last layer, an EAGLE-3 head three others: the run feeds the union,
    each head reads its own, and the output is unchanged."""
    model = tiny_model("llama", "sdpa")
    eagle3 = EagleHead.load(write_eagle3(tmp_path / "eagle3")).bind(model)
    mixture = auto_proposer(heads=[random_heads(model), eagle3])
    assert mixture.layers == (-1, 0, 1, 2)
    forest = run(model, PREFIX, BRANCHES, speculate=Speculation(mixture, None, 6), max_new_tokens=STEPS,
                 eos=[NO_EOS])
    assert outputs(forest) == tiny_references("llama", "sdpa")
    assert forest.stats.drafted > 0


def test_published_heads_that_do_not_fit_are_refused_clearly(tmp_path):
    model = tiny_model("llama", "sdpa")
    with pytest.raises(InvalidArgument, match="hidden size 64 and a vocabulary of 256, the model has 32"):
        _wider_target_refused(tmp_path)
    folder = write_speculators(tmp_path / "spec")
    config = json.loads((folder / "config.json").read_text())
    for change, message in [({"norm_before_fc": True}, "norm_before_fc"),
                            ({"speculators_model_type": "eagle"}, "speculators 'eagle' model"),
                            ({"transformer_layer_config": {**LAYER, "model_type": "qwen3"}}, "qwen3 layer")]:
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(InvalidArgument, match=message):
            EagleHead.load(folder)
    (folder / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [1, 2]}))
    with pytest.raises(InvalidArgument, match="reads 3 layers"):
        EagleHead.load(folder).bind(model)
    # a tensor of another shape than the config says: refused with a message, not a torch error
    from safetensors.torch import load_file, save_file

    eagle3 = write_eagle3(tmp_path / "eagle3-bad")
    tensors = load_file(eagle3 / "model.safetensors")
    save_file({**tensors, "midlayer.mlp.down_proj.weight": torch.zeros(H, FF + 1)}, str(eagle3 / "model.safetensors"))
    with pytest.raises(InvalidArgument, match="does not match its config"):
        EagleHead.load(eagle3)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    torch.save({"something": torch.zeros(1)}, empty / "pytorch_model.bin")
    with pytest.raises(InvalidArgument, match="no layout"):
        EagleHead.load(empty)


def _wider_target_refused(tmp_path):
    import transformers as tf

    wide = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    EagleHead.load(write_eagle3(tmp_path / "eagle3")).bind(wide)


def test_the_cli_drafts_with_a_published_head_named_by_draft_head(model_dir, tmp_path):
    """`--speculate eagle --draft-head DIR` with an EAGLE-3 head as published, on a model folder
    (two layers: the head names its aux layers); the same text as without speculation."""
    from click.testing import CliRunner

    from multidecode.cli import main

    config = json.loads((model_dir / "config.json").read_text())
    folder = write_speculators(tmp_path / "spec", vocab=config["vocab_size"], aux=[0, 1, 2])
    args = ["generate", "--model", str(model_dir), "-p", "Here is a document about", "--max-new-tokens", "12",
            "--precision", "float32", "--json"]
    runner = CliRunner()
    plain = runner.invoke(main, [*args, "--speculate", "off"])
    drafted = runner.invoke(main, [*args, "--speculate", "eagle", "--draft-head", str(folder), "--stats"])
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    assert json.loads(plain.stdout)["text"] == json.loads(drafted.stdout)["text"]
    assert "speculate=eagle" in drafted.stderr


def test_a_head_folder_alone_implies_the_head_s_own_kind(model_dir, tmp_path):
    """`--draft-head DIR` without --speculate drafts with the kind of head DIR holds: an EAGLE
    head's folder means "eagle" (it was read as Medusa's, and refused for lacking Medusa's files);
    a Medusa layout's means "medusa"."""
    from click.testing import CliRunner

    from multidecode.cli import main
    from multidecode.speculation import SpeculationSettings

    config = json.loads((model_dir / "config.json").read_text())
    folder = write_speculators(tmp_path / "spec", vocab=config["vocab_size"], aux=[0, 1, 2])
    assert SpeculationSettings.parse(head=str(folder)).mode == "eagle"
    medusa = tmp_path / "medusa"
    medusa.mkdir()
    (medusa / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    assert SpeculationSettings.parse(head=str(medusa)).mode == "medusa"
    for mode, other, kind in (("eagle", medusa, "medusa"), ("medusa", folder, "eagle")):  # named the files it lacked
        with pytest.raises(InvalidArgument, match=f"holds a {kind} head, but speculate is '{mode}'") as refused:
            SpeculationSettings.parse(mode, head=str(other))
        assert f"speculate='{kind}'" in refused.value.hint
    args = ["generate", "--model", str(model_dir), "-p", "Here is a document about", "--max-new-tokens", "12",
            "--precision", "float32", "--json"]
    plain = CliRunner().invoke(main, [*args, "--speculate", "off"])
    drafted = CliRunner().invoke(main, [*args, "--draft-head", str(folder), "--stats"])
    assert drafted.exit_code == 0, drafted.output
    assert json.loads(plain.stdout)["text"] == json.loads(drafted.stdout)["text"]
    assert "speculate=eagle" in drafted.stderr


def test_an_eagle3_head_whose_config_names_its_head_dim_loads_with_it(tmp_path):
    """Heads whose heads are wider than hidden / heads (Qwen3's EAGLE-3 heads) name `head_dim`."""
    from safetensors.torch import save_file

    folder = tmp_path / "wide-heads"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LAYER, "head_dim": 2 * HD, "draft_vocab_size": DRAFT_VOCAB}))
    save_file(_eagle3_tensors(torch.Generator().manual_seed(4), "midlayer.", 3, hd=2 * HD),
              str(folder / "model.safetensors"))
    model = tiny_model("llama", "sdpa")
    head = EagleHead.load(folder).bind(model)
    assert head.model.self_attn.head_dim == 2 * HD
    check_exact_with_eos_and_compaction(model, tiny_references("llama", "sdpa"),
                                        lambda: Speculation(Eagle(head, width=2, confidence=0.0), budget=6))
