"""The CUDA path: every node of a random forest equals its path alone bit for bit on the GPU too
(products and norms in row tiles, `kernels.in_row_tiles`); forests, speculation and beam search
there equal transformers' own results; structured output, the sampling extras, seeded
completions, the merged batch job and the server run there through `load(device="cuda")`.
Skipped where no GPU is present (CI and the CPU machines run everything else)."""

from __future__ import annotations

import json

import pytest
import torch
from forests import differing, exact_model
from tiny_models import ARCHITECTURES, MAIN_ARCHITECTURES, VOCAB

import multidecode
from multidecode import kernels
from multidecode.api import start_forest
from multidecode.cost import measure_cost
from multidecode.sampling_params import SamplingParams
from multidecode.strategies.beam import run_beam_search

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PREFIX = [7, 19, 33, 7, 19, 33, 41, 5]
BRANCHES = [[], [9, 12], [7, 19]]


def cuda_model(arch: str):
    config, cls = ARCHITECTURES[arch]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    return cls(config).to("cuda", torch.float32).eval()


def generate(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=VOCAB, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "gpt2"])
@pytest.mark.parametrize("speculate", [None, "lookup", "suffix", "lookahead", "auto"])
def test_forest_on_cuda_equals_generate(arch, speculate):
    model = cuda_model(arch)
    run = start_forest(model, PREFIX, BRANCHES, max_new_tokens=16, eos_token_id=[VOCAB],
                       sampling=[SamplingParams()] * len(BRANCHES), speculate=speculate).finish()
    assert [b.output.token_ids for b in run.branches] == [generate(model, PREFIX + b, 16) for b in BRANCHES]
    assert run.engine.cache.layers[0].keys.device.type == "cuda"


def test_beam_search_on_cuda_equals_generate():
    model = cuda_model("llama")
    run = run_beam_search(model, PREFIX, num_beams=3, max_new_tokens=8, eos_token_id=[VOCAB])
    ids = torch.tensor([PREFIX], device="cuda")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3, max_new_tokens=8,
                             eos_token_id=VOCAB, pad_token_id=0)
    assert run.beams[0].token_ids == out[0, len(PREFIX):].tolist()


def test_seeded_sampling_on_cuda_is_the_same_with_speculation():
    model = cuda_model("llama")
    out = [multidecode.decode(model, PREFIX, BRANCHES, max_new_tokens=12, eos_token_id=VOCAB, do_sample=True,
                              temperature=0.8, seed=3, speculate=s) for s in (None, "lookup")]
    assert out[0] == out[1]


def test_cost_curve_on_cuda():
    curve = measure_cost(cuda_model("llama"), sizes=(1, 2, 8, 32), contexts=(64,), repeats=2)
    assert all(b >= a > 0 for a, b in zip(curve.seconds[0], curve.seconds[0][1:]))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_draft_models_on_cuda_equal_generate(arch):
    """A self-draft (one layer skipped) and a draft identical to the target, on the GPU."""
    from multidecode.proposers.draft import DraftModel
    from multidecode.proposers.self_draft import self_draft
    from multidecode.speculation import Speculation

    model = cuda_model(arch)
    expected = [generate(model, PREFIX + b, 16) for b in BRANCHES]
    for draft in (self_draft(model, [1]), model):
        run = start_forest(model, PREFIX, BRANCHES, max_new_tokens=16, eos_token_id=[VOCAB],
                           sampling=[SamplingParams()] * len(BRANCHES),
                           speculate=Speculation(DraftModel(draft, confidence=0.0), budget=4)).finish()
        assert [b.output.token_ids for b in run.branches] == expected


def test_sampled_draft_speculation_on_cuda_runs_the_rule_against_q():
    from multidecode.proposers.draft import DraftModel
    from multidecode.proposers.self_draft import self_draft

    model = cuda_model("llama")
    out = multidecode.decode(model, PREFIX, BRANCHES, max_new_tokens=12, eos_token_id=VOCAB, do_sample=True,
                             temperature=0.8, seed=3, speculate=DraftModel(self_draft(model, [1])))
    assert [len(o) for o in out] == [12] * len(BRANCHES)


# ---------------------------------------------------------------------- exact by construction
@pytest.mark.parametrize("arch", MAIN_ARCHITECTURES)
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_every_node_of_a_random_forest_on_cuda_equals_its_path_alone_bit_for_bit(arch, precision):
    """The exactness tests' random forests (draft trees, rollbacks, compactions) on the GPU: the
    products and norms in row tiles, attention on the portable kernel."""
    model = exact_model(arch, "sdpa", precision, device="cuda")
    for seed in range(3):
        bad, fed = differing(model, seed=seed)
        assert fed and not bad, f"seed {seed}: {len(bad)} of {fed} nodes differ from their paths alone"


def test_products_and_norms_at_their_own_row_counts_fail_the_check(monkeypatch):
    """The mutant: torch's kernels called with the forward's true row count (no tiles)."""
    monkeypatch.setattr(kernels, "in_row_tiles", lambda layer, x: layer(x))
    model = exact_model("llama", "sdpa", "float32", device="cuda")
    assert any(differing(model, seed=seed)[0] for seed in range(3))


# ---------------------------------------------------------------------- what came after the engine
# Structured output, the sampling extras, seeded completions, the merged batch job, the server and
# memory accounting, each on the GPU through the user's own entry point (`load(device="cuda")`):
# the tiny model folder, a forest against each branch alone there.
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                   "color": {"enum": ["red", "green", "light blue"]}},
    "required": ["name", "ok", "color"],
    "additionalProperties": False,
}
QUESTIONS = ["name?", "is it ok?", "which color?", "and the rest?"]


@pytest.fixture(scope="module")
def cuda_decoder(model_dir):
    return multidecode.load(str(model_dir), device="cuda")


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("speculate", [None, "auto"])
def test_constrained_answers_on_cuda_equal_each_alone_and_validate(cuda_decoder, speculate):
    answers = cuda_decoder.ask("A call about a router.", QUESTIONS, json_schema=SCHEMA, max_new_tokens=60,
                               speculate=speculate)
    for answer in answers:
        alone = cuda_decoder.generate(answer.prompt_ids, json_schema=SCHEMA, max_new_tokens=60, speculate=None)
        assert answer.token_ids == alone.token_ids
        assert answer.finish_reason == "length" or valid(answer.text), answer.text
    assert any(a.finish_reason == "stop" for a in answers)


def test_a_self_draft_of_a_model_loaded_on_cuda_decodes_as_the_target(cuda_decoder):
    """`load(device="cuda")` tiles the norms (`RowTiledNorm`); a self-draft shares them."""
    from multidecode.proposers.draft import DraftModel
    from multidecode.proposers.self_draft import self_draft

    prompt = cuda_decoder.tokenizer("A call about a router.")["input_ids"]
    plain = cuda_decoder.generate(prompt, max_new_tokens=16, speculate=None)
    drafted = multidecode.decode(cuda_decoder.model, prompt, [[]], max_new_tokens=16, eos_token_id=2,
                                 speculate=DraftModel(self_draft(cuda_decoder.model, []), confidence=0.0))
    assert drafted[0] == plain.token_ids


def test_penalties_and_logit_bias_on_cuda_equal_each_alone(cuda_decoder):
    extras = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={5: 3.0, 9: -2.0})
    answers = cuda_decoder.ask("A call about a router.", QUESTIONS, max_new_tokens=24, speculate="auto", **extras)
    plain = cuda_decoder.ask("A call about a router.", QUESTIONS, max_new_tokens=24, speculate=None)
    for answer in answers:
        alone = cuda_decoder.generate(answer.prompt_ids, max_new_tokens=24, speculate=None, **extras)
        assert answer.token_ids == alone.token_ids
    assert [a.token_ids for a in answers] != [a.token_ids for a in plain]  # the extras did act


def test_seeded_completions_on_cuda_equal_each_seed_alone(cuda_decoder):
    many = cuda_decoder.complete("The ticket:", n=4, seed=7, temperature=0.9, json_schema=SCHEMA, max_new_tokens=60)
    for i, completion in enumerate(many):
        (alone,) = cuda_decoder.complete("The ticket:", n=1, seed=7 + i, temperature=0.9, json_schema=SCHEMA,
                                         max_new_tokens=60, speculate="auto")
        assert completion.token_ids == alone.token_ids
        assert completion.finish_reason == "length" or valid(completion.text), completion.text


def test_merged_batch_on_cuda_equals_each_line_alone(cuda_decoder):
    from multidecode.batch import BatchSettings, parse_line
    from multidecode.batch.merged import ForestAnswerer, answer_merged

    rows = [{"id": f"doc-{i}", "document": "router fan noise " * (1 + i), "questions": QUESTIONS[: 1 + i % 3]}
            for i in range(5)]
    items = [parse_line(json.dumps(row).encode(), i + 1) for i, row in enumerate(rows)]
    with ForestAnswerer(cuda_decoder, BatchSettings(max_new_tokens=8)) as answerer:
        outcomes = list(answer_merged(answerer, items))
    assert all(o.error is None for o in outcomes)
    for outcome in outcomes:
        alone = cuda_decoder.ask(outcome.item.document, list(outcome.item.questions), max_new_tokens=8)
        assert [a.token_ids for a in outcome.answers] == [a.token_ids for a in alone]


@pytest.mark.parametrize("stream", [False, True])
def test_server_on_cuda_answers_a_json_schema_with_n_choices(model_dir, stream):
    from serving import MODEL, chat_choices, running_server, tiny_loader

    with running_server(tiny_loader(model_dir)) as running:
        assert next(running.forest.model.parameters()).device.type == "cuda"  # load picks the GPU by default
        reply = running.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A record, please."}], max_tokens=60, n=2, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}},
            stream=stream)
        texts, finishes = chat_choices(reply, 2, stream=stream)
    for text, finish in zip(texts, finishes):
        assert finish == "length" or valid(text), text


def test_memory_on_cuda_counts_the_devices_own_bytes(cuda_decoder):
    from multidecode import memory

    free = memory.available_bytes("cuda")
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory
    assert next(cuda_decoder.model.parameters()).device.type == "cuda"


def test_packed_precisions_are_refused_on_cuda_before_loading(model_dir):
    from multidecode.errors import InvalidArgument

    for name in ("int8", "int4"):
        with pytest.raises(InvalidArgument, match="packed CPU kernels"):
            multidecode.load(str(model_dir), device="cuda", precision=name)
