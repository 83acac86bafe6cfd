"""`bench speculate` on tiny random models: the shipped workloads, transformers' prompt lookup
(identical tokens, draft counts read from the forward calls), MultiDecode's lookup and auto on
the same prompts, and the CLI command writing its three files."""

from __future__ import annotations

import ast
import json

import pytest
from byte_tokenizer import ByteTokenizer
from tiny_models import EOS, reference_generate, tiny_model
from transformers.generation import candidate_generator

from multidecode import MultiDecoder
from multidecode.bench.common import ForwardCounter
from multidecode.bench.speculate import draft_counts, hf_generate, run_speculate_benchmark, workloads
from multidecode.data import text as data_text

HF = ("hf_greedy", "hf_lookup_3", "hf_lookup_10", "hf_assisted_self")
OURS = ("multidecode_plain", "multidecode_lookup", "multidecode_auto", "multidecode_lookahead",
        "multidecode_lookahead_fit", "multidecode_suffix", "multidecode_draft", "multidecode_suffix_2nd",
        "multidecode_auto_2nd")
# a prompt that repeats itself, so that n-gram lookup finds candidates
PROMPT = [1] + [40, 41, 42, 43, 44, 45, 46, 47] * 3 + [40, 41]


def test_the_shipped_workloads():
    shipped = {w.name: w for w in workloads()}
    assert list(shipped) == ["summary", "code_edit", "story"]
    assert [w.max_new_tokens for w in shipped.values()] == [128, 200, 128]
    assert data_text("support_call.txt").strip() in shipped["summary"].text()
    assert "5 sentences" in shipped["summary"].text()
    code = data_text(shipped["code_edit"].document)
    assert 55 <= len(code.splitlines()) <= 65 and code.strip() in shipped["code_edit"].text()
    function = ast.parse(code).body[0]
    arguments = function.args.args + function.args.kwonlyargs
    assert function.returns is None and all(a.annotation is None for a in arguments)  # no type hints yet
    assert "{document}" not in shipped["story"].text() and shipped["story"].document is None


def test_draft_counts_worked_example():
    """A 10-token prompt, forwards feeding 10+3, 1+3 and 1+0 tokens, 6 new tokens."""
    counter = ForwardCounter(model=None)
    counter.calls = [("prefill", 0.0, (1, 13)), ("decode", 0.0, (1, 4)), ("decode", 0.0, (1, 1))]
    assert draft_counts(counter, 10, 6) == {"drafted": 6, "accepted": 3, "acceptance": 0.5}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_prompt_lookup_is_exact_and_its_drafts_are_counted(arch, monkeypatch):
    """transformers' prompt lookup gives plain greedy's tokens; the drafted and accepted counts read
    from the forward calls equal what its candidate generator proposed and what generate accepted."""
    model = tiny_model(arch)
    seen = {"drafted": 0, "accepted": 0}
    propose = candidate_generator.PromptLookupCandidateGenerator.get_candidates

    def counted_propose(self, input_ids, **kwargs):
        out = propose(self, input_ids, **kwargs)
        seen["drafted"] += out[0].shape[1] - input_ids.shape[1]
        return out

    def counted_update(self, input_ids, scores, num_matches):
        seen["accepted"] += int(num_matches)

    monkeypatch.setattr(candidate_generator.PromptLookupCandidateGenerator, "get_candidates", counted_propose)
    monkeypatch.setattr(candidate_generator.PromptLookupCandidateGenerator, "update_candidate_strategy",
                        counted_update, raising=False)
    expected = reference_generate(model, PROMPT, max_new_tokens=24, eos_token_id=[EOS])
    expected = expected[: expected.index(EOS) + 1] if EOS in expected else expected
    for lookup in (0, 3, 10):
        seen.update(drafted=0, accepted=0)
        with ForwardCounter(model) as counter:
            out = hf_generate(model, PROMPT, counter, lookup=lookup, max_new_tokens=24, eos_ids=[EOS], pad_id=0)
        assert out.answers == [expected]
        assert out.extra["drafted"] == seen["drafted"] and out.extra["accepted"] == seen["accepted"]
        if lookup:
            assert out.extra["drafted"] > 0 and counter.forward_passes < len(expected)
        else:
            assert out.extra["drafted"] == 0 and out.extra["acceptance"] is None
            assert counter.forward_passes == len(expected)


def test_every_method_runs_and_equals_plain_greedy():
    settings = {"names": ["story"], "max_new_tokens": 6, "repeats": 1, "warmup": False}
    result = run_speculate_benchmark(MultiDecoder(tiny_model("llama"), ByteTokenizer()), **settings)
    assert result["answers_identical"] is True and "main" not in result
    (row,) = result["workloads"]
    assert row["workload"] == "story" and "skipped" not in row
    assert list(row["methods"]) == [*HF, *OURS]
    assert row["prompt_tokens"] > 40 and row["max_new_tokens"] == 6
    for name in [*HF[1:], *OURS]:
        assert row[f"{name}_vs"]["hf_greedy"]["speedup"] > 0
    assert row["methods"]["hf_greedy"]["tokens_per_forward"] == 1.0
    assert row["methods"]["multidecode_auto"]["extra"]["speculate"] == "auto"
    assert row["methods"]["multidecode_lookup"]["extra"]["drafted"] >= 0
    assert row["methods"]["multidecode_draft"]["extra"]["draft_forwards"] > 0
    assert row["methods"]["multidecode_lookahead"]["extra"]["speculate"] == "lookahead"
    # the second pass has seen this workload's greedy output: its drafts are accepted
    assert row["methods"]["multidecode_suffix_2nd"]["extra"]["accepted"] > 0
    assert [t["name"] for t in result["targets"]] == [
        "story: auto over plain greedy", "story: lookahead at least lade's best (0.95x)",
        "story: MD suffix 2nd over plain greedy", "story: auto 2nd pass over plain greedy"]
    assert result["config"]["self_draft_skips"]  # a quarter of the layers at least


def test_bench_speculate_command_writes_its_three_files(tmp_path):
    from click.testing import CliRunner
    from local_models import tiny_model_folder

    from multidecode.cli import main

    model = tiny_model_folder(tmp_path / "model", max_positions=4096)
    args = ["bench", "speculate", "--model", str(model), "--max-new-tokens", "5", "--repeats", "1",
            "--output", str(tmp_path / "out")]
    result = CliRunner().invoke(main, [*args, "--workloads", "story,code_edit"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "bench_speculate.json", "bench_speculate.md", "bench_speculate.png"]
    stored = json.loads((tmp_path / "out" / "bench_speculate.json").read_text())
    assert [row["workload"] for row in stored["workloads"]] == ["code_edit", "story"]  # file order
    md = (tmp_path / "out" / "bench_speculate.md").read_text()
    assert "| workload | method |" in md and "speed-up over HF greedy" in md
    bad = CliRunner().invoke(main, [*args, "--workloads", "poem"])
    assert bad.exit_code == 2 and "unknown workload(s): poem" in bad.output
    none = CliRunner().invoke(main, [*args, "--workloads", ","])
    assert none.exit_code == 2 and "no workload chosen" in none.output


def test_the_learned_heads_of_the_model_join_the_benchmark(tmp_path, monkeypatch):
    """With a Medusa and an EAGLE head trained for the model in the user cache, each is measured,
    auto drafts with them and is compared with auto without them, and all equal plain greedy."""
    from learned_heads import random_head, random_heads

    from multidecode.proposers.heads import head_dir

    monkeypatch.setenv("MULTIDECODE_CACHE", str(tmp_path))
    model = tiny_model("llama")
    random_heads(model).save(head_dir(model, "medusa"))
    random_head(model).save(head_dir(model, "eagle"))
    settings = {"names": ["story"], "max_new_tokens": 6, "repeats": 1, "warmup": False}
    result = run_speculate_benchmark(MultiDecoder(model, ByteTokenizer()), **settings)
    assert result["answers_identical"] is True
    (row,) = result["workloads"]
    assert {"multidecode_medusa", "multidecode_eagle", "multidecode_auto_tokens"} <= set(row["methods"])
    assert row["multidecode_auto_vs"]["multidecode_auto_tokens"]["speedup"] > 0
    names = [t["name"] for t in result["targets"]]
    assert "story: medusa over plain greedy" in names and "story: eagle over plain greedy" in names
    assert "story: auto with the heads no worse than without" in names
    assert set(result["config"]["learned_heads"]) == {"medusa", "eagle"}


def test_a_model_without_a_self_draft_runs_without_the_draft_methods(monkeypatch):
    """Where the model cannot be self-drafted (a GGUF file whose layers keep different formats),
    the benchmark leaves out the two self-draft methods and says why, and measures the rest."""
    from multidecode.errors import UnsupportedModel

    def refuse(*args, **kwargs):
        raise UnsupportedModel("layer 1 of the target and layer 0 of the draft differ", "use another model")

    monkeypatch.setattr("multidecode.bench.speculate.choose_skip", refuse)
    settings = {"names": ["story"], "max_new_tokens": 4, "repeats": 1, "warmup": False}
    result = run_speculate_benchmark(MultiDecoder(tiny_model("llama"), ByteTokenizer()), **settings)
    (row,) = result["workloads"]
    assert "hf_assisted_self" not in row["methods"] and "multidecode_draft" not in row["methods"]
    assert "multidecode_auto" in row["methods"] and result["answers_identical"] is True
    assert result["config"]["self_draft"].startswith("no self-draft: layer 1")
