"""Self-draft models: the target with layers skipped, sharing its weights, exact on every architecture.

The reference for a draft with skipped layers is built differently from the draft: the target
itself, with forward hooks that make each skipped layer hand back its input unchanged (what
skipping a residual block means), run over the whole sequence without a cache.
"""

import random

import pytest
import torch
import transformers as tf
from tiny_models import ARCHITECTURES, ARCHS, COMMON, NO_EOS, VOCAB, combos, reference_generate, tiny_model

import multidecode
from multidecode import InvalidArgument, UnsupportedModel
from multidecode.models.vetting import check_supported
from multidecode.proposers.self_draft import (
    SkipChoice,
    choose_skip,
    choose_skip_layers,
    decoder_layers,
    expected_speedup,
    self_draft,
)

STEPS = 14  # past the sliding window (6) of the tiny sliding models

_rng = random.Random(7)
IDS = torch.tensor([[_rng.randrange(3, VOCAB) for _ in range(24)]])  # [1, 24]
PREFIX = [_rng.randrange(3, VOCAB) for _ in range(8)]
BRANCHES = [[], [_rng.randrange(3, VOCAB)], [_rng.randrange(3, VOCAB) for _ in range(5)]]
SAMPLE = [[_rng.randrange(3, VOCAB) for _ in range(40)], [_rng.randrange(3, VOCAB) for _ in range(25)]]


def skip_sets(model) -> list[list[int]]:
    """First, a middle, last, and first-plus-last layers."""
    n = len(decoder_layers(model)[1])
    return [[0], [1], [n - 1], [0, n - 1]]


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()  # [1, n, vocab]


def logits_with_identity_layers(model, skip) -> torch.Tensor:
    """The target's logits with the layers `skip` replaced by the identity (forward hooks, removed after)."""
    def hand_back_input(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    _, layers = decoder_layers(model)
    handles = [layers[i].register_forward_hook(hand_back_input, with_kwargs=True) for i in skip]
    try:
        return logits(model)
    finally:
        for handle in handles:
            handle.remove()


def fresh_model(arch: str, attn: str = "eager", **overrides):
    """A new (uncached) tiny model, free to be modified by a test."""
    config, cls = ARCHITECTURES[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = attn
    torch.manual_seed(1234)
    return cls(config).eval()


# ---------------------------------------------------------------------- the draft computes the skipped model
@pytest.mark.parametrize("arch, attn", combos(("eager", "sdpa", "multidecode_sdpa")))
def test_no_skip_equals_target(arch, attn):
    model = tiny_model(arch, attn)
    draft = self_draft(model, [])
    torch.testing.assert_close(logits(draft), logits(model), rtol=0, atol=1e-6)


def test_bfloat16_draft():
    model = tiny_model("llama", "sdpa", torch.bfloat16)
    draft = self_draft(model, [])
    assert draft.dtype == torch.bfloat16
    torch.testing.assert_close(logits(draft), logits(model), rtol=0, atol=0)


@pytest.mark.parametrize("arch, attn", combos())
def test_skipping_equals_target_with_identity_layers(arch, attn):
    """Skipping the first, a middle, the last, and the first and last layers: the draft's logits are
    the target's with those layers made identities; per-layer settings (sliding or full) follow
    their layers."""
    model = tiny_model(arch, attn)
    for skip in skip_sets(model):
        draft = self_draft(model, skip)
        assert draft.config.num_hidden_layers == len(decoder_layers(model)[1]) - len(skip)
        expected = logits_with_identity_layers(model, skip)
        assert not torch.allclose(expected, logits(model), atol=1e-3), "skipping must change something"
        torch.testing.assert_close(logits(draft), expected, rtol=0, atol=1e-5, msg=f"skip {skip}")


def test_per_layer_settings_follow_their_layers():
    """gemma3: sliding, full, sliding, full; skipping layer 0 leaves full, sliding, full (and the
    hybrid qwen2's threshold `max_window_layers` counts the kept full layers)."""
    draft = self_draft(tiny_model("gemma3", "eager"), [0])
    assert draft.config.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    qwen = tiny_model("qwen2-hybrid", "eager")  # layer 0 full, layers 1 and 2 sliding
    assert qwen.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    draft = self_draft(qwen, [0])
    assert draft.config.layer_types == ["sliding_attention", "sliding_attention"]
    assert draft.config.max_window_layers == 0
    assert self_draft(qwen, [2]).config.max_window_layers == 1


# ---------------------------------------------------------------------- sharing, and the target untouched
@pytest.mark.parametrize("arch", ARCHS)
def test_draft_shares_every_tensor(arch):
    model = tiny_model(arch, "eager")
    name, layers = decoder_layers(model)
    skip = [1]
    draft = self_draft(model, skip)
    keep = [i for i in range(len(layers)) if i not in skip]

    def target_key(key: str) -> str:
        if not key.startswith(name + "."):
            return key
        index, rest = key[len(name) + 1:].split(".", 1)
        return f"{name}.{keep[int(index)]}.{rest}"

    target_tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    draft_tensors = list(draft.named_parameters(remove_duplicate=False)) + list(draft.named_buffers())
    assert draft_tensors
    for key, tensor in draft_tensors:
        assert tensor.data_ptr() == target_tensors[target_key(key)].data_ptr(), key
    target_ptrs = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in draft.parameters()} <= target_ptrs  # no new parameter memory
    skipped = sum(p.numel() for p in layers[1].parameters())
    assert sum(p.numel() for p in draft.parameters()) == sum(p.numel() for p in model.parameters()) - skipped
    assert draft.get_submodule(name)[0] is not layers[0]  # new modules around shared tensors
    out, inp = draft.get_output_embeddings(), draft.get_input_embeddings()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (out.weight is inp.weight) == tied
    if arch in ("gemma3", "gpt2"):
        assert tied
    assert draft.dtype == model.dtype and draft.device == model.device and not draft.training
    assert draft.config._attn_implementation == model.config._attn_implementation
    assert draft.generation_config.to_dict() == model.generation_config.to_dict()
    check_supported(draft)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_target_with_tiled_norms_drafts_with_them(arch):
    """On a GPU the exact path wraps every norm in a `RowTiledNorm` (its weight then under
    `layer.`): the draft takes the target's wrapped norms as they are and decodes as the target
    does (here on the CPU, the norms wrapped as `use_exact_kernels` wraps them on a GPU)."""
    import copy

    from multidecode.exact import RowTiledNorm

    model = copy.deepcopy(tiny_model(arch, "eager"))
    expected = reference_generate(model, IDS[0].tolist(), max_new_tokens=8)
    for _, parent in list(model.named_modules()):
        for child, layer in list(parent.named_children()):
            if (tiled := RowTiledNorm.of(layer, torch.device("cuda"))) is not None:
                setattr(parent, child, tiled)
    assert any(isinstance(m, RowTiledNorm) for m in model.modules())
    draft = self_draft(model, [])
    assert {id(m) for m in draft.modules() if isinstance(m, RowTiledNorm)} <= {id(m) for m in model.modules()}
    assert reference_generate(draft, IDS[0].tolist(), max_new_tokens=8) == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_target_unchanged(arch):
    model = fresh_model(arch)
    before_config = model.config.to_dict()
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_logits = logits(model)
    next(decoder_layers(model)[1][1].parameters()).requires_grad_(False)  # a kept layer's frozen parameter
    model.get_input_embeddings().weight.requires_grad_(False)  # stay frozen, the others trainable
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    ids = {k: id(m) for k, m in model.named_modules()}
    draft = self_draft(model, [0, 2])
    logits(draft)
    multidecode.attention.use_forest_sdpa(draft)  # switching the draft's attention leaves the target's
    assert model.config.to_dict() == before_config
    assert {k: id(m) for k, m in model.named_modules()} == ids
    assert {k: p.requires_grad for k, p in model.named_parameters()} == flags
    for key, value in model.state_dict().items():
        assert torch.equal(value, before_state[key]), key
    torch.testing.assert_close(logits(model), before_logits, rtol=0, atol=0)


# ---------------------------------------------------------------------- decoding with the draft
@pytest.mark.parametrize("arch, attn", combos())
def test_draft_decodes_exactly_on_the_engine(arch, attn):
    """A forest of branches over one SlotCache with the draft's renumbered layers equals the
    draft's own transformers generate, branch by branch."""
    draft = self_draft(tiny_model(arch, attn), [1])
    out = multidecode.decode(draft, PREFIX, BRANCHES, max_new_tokens=STEPS, eos_token_id=NO_EOS)
    assert out == [reference_generate(draft, PREFIX + b, max_new_tokens=STEPS, eos_token_id=NO_EOS) for b in BRANCHES]


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_assisted_generation_accepts_the_draft(arch):
    """transformers' assisted generation with the draft as assistant equals plain greedy."""
    model = tiny_model(arch, "eager")
    draft = self_draft(model, [len(decoder_layers(model)[1]) - 1])
    prompt = torch.tensor([PREFIX])
    settings = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=STEPS,
                    eos_token_id=NO_EOS, pad_token_id=0)
    calls = []
    handle = draft.register_forward_hook(lambda *_: calls.append(1))  # on the draft: the target stays bare
    with torch.inference_mode():
        plain = model.generate(prompt, **settings)
        assisted = model.generate(prompt, assistant_model=draft, **settings)
    handle.remove()
    assert assisted.tolist() == plain.tolist()
    assert calls, "the assistant was never run"


# ---------------------------------------------------------------------- choosing the layers
def test_expected_speedup():
    assert expected_speedup(1.0, 0.5) == (9 / 5, 8)  # every draft token accepted: the longest chain
    speedup, k = expected_speedup(0.0, 0.5)  # none accepted: one token for 1 + c
    assert (speedup, k) == (1 / 1.5, 1)
    speedup, k = expected_speedup(0.8, 0.3)
    assert speedup == pytest.approx((1 - 0.8 ** (k + 1)) / 0.2 / (1 + 0.3 * k)) and 1 < speedup < 2.5


@pytest.mark.parametrize("arch, outputs", [("llama", ["self_attn.o_proj", "mlp.down_proj"]),
                                           ("gpt2", ["attn.c_proj", "mlp.c_proj"])])
def test_choose_skip_picks_a_no_op_layer_first(arch, outputs):
    """A layer whose output projections are zero adds nothing to the residual stream: skipping it
    agrees with the target everywhere, so the search takes it first."""
    model = fresh_model(arch, num_hidden_layers=4, **({"n_layer": 4} if arch == "gpt2" else {}))
    assert len(decoder_layers(model)[1]) == 4
    with torch.no_grad():
        for path in outputs:
            module = decoder_layers(model)[1][2].get_submodule(path)
            module.weight.zero_()
            module.bias is not None and module.bias.zero_()
    first = choose_skip(model, SAMPLE, max_skip=1)
    assert first.layers == (2,) and first.agreement == 1.0 and first.expected_speedup > 1
    assert 2 in choose_skip_layers(model, SAMPLE)


def test_choose_skip_is_valid_and_deterministic():
    model = tiny_model("gemma3", "eager")
    depth = len(decoder_layers(model)[1])
    choice = choose_skip(model, SAMPLE)
    assert isinstance(choice, SkipChoice)
    assert choice == choose_skip(model, SAMPLE)
    assert list(choice.layers) == sorted(set(choice.layers)) and len(choice.layers) < depth
    assert all(0 <= i < depth for i in choice.layers)
    assert 0 <= choice.agreement <= 1 and 0 < choice.draft_cost <= 1
    assert choose_skip_layers(model, SAMPLE) == list(choice.layers)
    assert choose_skip_layers(model, SAMPLE, max_skip=0) == []
    assert set(choose_skip_layers(model, torch.tensor(SAMPLE[0]), candidates=[1, 2])) <= {1, 2}
    if choice.layers:
        draft = self_draft(model, choice.layers)
        hits = sum(int((logits(draft, torch.tensor([s])).argmax(-1) == logits(model, torch.tensor([s])).argmax(-1))
                       .sum()) for s in SAMPLE)
        assert choice.agreement == hits / sum(len(s) for s in SAMPLE)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("skip, words", [
    ([3], "not layer indices"), ([-1], "not layer indices"), ([1.0], "not layer indices"),
    ([1, 1], "more than once"), ([0, 1, 2], "skips all 3 layers"), ("1", "sequence of layer indices"),
    (2, "sequence of layer indices"),
])
def test_bad_skip_layers(skip, words):
    with pytest.raises(InvalidArgument, match=words) as info:
        self_draft(tiny_model("llama", "eager"), skip)
    assert info.value.hint


def test_bad_choose_skip_arguments():
    model = tiny_model("llama", "eager")
    with pytest.raises(InvalidArgument, match="candidates"):
        choose_skip(model, SAMPLE, candidates=[5])
    with pytest.raises(InvalidArgument, match="max_skip"):
        choose_skip(model, SAMPLE, max_skip=-1)
    for bad in ([], [[]], [[VOCAB]], "text"):
        with pytest.raises(InvalidArgument, match="sample_ids"):
            choose_skip(model, bad)


def test_model_without_decoder_layers():
    with pytest.raises(InvalidArgument, match="num_hidden_layers"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_layers_that_depend_on_their_index_are_refused():
    """GPT-2 with scale_attn_by_inverse_layer_idx scales attention by 1/(layer index + 1):
    renumbering a layer would change it, so only skips that keep every index (the last layer) work."""
    config = tf.GPT2Config(**COMMON, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                           scale_attn_by_inverse_layer_idx=True)
    model = tf.GPT2LMHeadModel(config).eval()
    with pytest.raises(UnsupportedModel, match="depend on their own index"):
        self_draft(model, [0])
    torch.testing.assert_close(logits(self_draft(model, [2])), logits_with_identity_layers(model, [2]),
                               rtol=0, atol=1e-5)


def test_the_command_names_its_option_for_layers_the_model_lacks(model_dir):
    """The command said "skip_layers 5 is not layer indices", the Python argument's name."""
    from click.testing import CliRunner

    from multidecode.cli import main

    result = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "-p", "hi", "--max-new-tokens", "2",
                                       "--draft-skip-layers", "5"])
    assert result.exit_code == 2 and "--draft-skip-layers 5 is not layer indices" in result.stderr, result.output
