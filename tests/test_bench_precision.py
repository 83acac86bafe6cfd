"""`bench precision`: one GGUF file at several precisions (and in llama.cpp where it is installed),
on a tiny random GGUF of the library's own writing. Timings are not asserted, only the shape of
the result, the per-step figures and the same-precision check."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from click.testing import CliRunner

from multidecode.bench import llamacpp
from multidecode.bench.common import AnswersDiffer, Measurement
from multidecode.bench.precision import (
    HF,
    LLAMA,
    SPECULATING,
    FileAtPrecisions,
    check_same_precision,
    ours,
    run_precision_benchmark,
)
from multidecode.bench.results import tables
from multidecode.cli import main
from multidecode.errors import InvalidArgument, InvalidInput
from multidecode.memory import measure_bandwidth
from multidecode.models.packed import step_bytes
from multidecode.models.precision import parse_all
from multidecode.models.random_gguf import write_random_gguf


@pytest.fixture
def tiny_gguf(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIDECODE_CACHE", str(tmp_path / "cache"))
    return write_random_gguf(tmp_path / "tiny.gguf", shape="tiny")["path"]


def quick(path, **settings):
    settings = {"questions": 2, **settings}
    return run_precision_benchmark(path, precisions_to_run=("float32", "auto"), names=["story"], max_new_tokens=6,
                                   context_tokens=40, context_new_tokens=4, question_tokens=4,
                                   document="Ann called about a late parcel. Bob sent a new one.",
                                   repeats=1, budget_s=0.01, warmup=False, bandwidth=1e10, **settings)


def test_every_case_reports_steps_per_token_and_resident_weights(tiny_gguf):
    result = quick(tiny_gguf)
    for row in result["cases"]:  # every method, llama.cpp included, answered every prompt
        assert all(m["new_tokens"] >= len(row["answer_tokens"]) > 0 for m in row["methods"].values())
    assert [row["case"] for row in result["cases"]] == ["story", "context", "2_questions"]
    assert result["config"]["precisions"] == ["auto", "float32"]
    for row in result["cases"]:
        steps = row["steps"]
        assert steps[ours("auto")]["weights_bytes"] < steps[ours("float32")]["weights_bytes"] / 3  # 4-bit codes
        for step in steps.values():
            assert step["floor_ms"] == pytest.approx(1000 * step["weights_bytes"] / 1e10)
            assert step["vs_floor"] == pytest.approx(step["ms_per_step"] / step["floor_ms"])
        assert set(row["per_token"]) >= {ours("auto"), ours("float32"), SPECULATING}
        assert row["agreement_with_auto"][SPECULATING]["identical"] == row["agreement_with_auto"][SPECULATING]["of"]
    questions = result["main"]
    assert questions["agreement_with_auto"][HF] == {"identical": 2, "of": 2, "first_difference_at": []}
    assert 0 < questions["resident"]["ratio"] <= 1.25
    for profiled in result["profile"].values():
        assert profiled["op_calls_per_step"] > 0 and profiled["op_ms_per_step"] > 0 and profiled["top_ops"]
    titles = [t.title for t in tables(result)]
    assert titles[-3:] == ["What a decode step reads and costs", "One decode step profiled (one stream, short prompt)",
                           "Targets"]
    names = {t["name"] for t in result["targets"]}
    assert "resident weights at auto / the file's tensor bytes" in names
    if llamacpp.missing() is None:
        assert LLAMA in questions["methods"] and questions["methods"][LLAMA]["decode_passes"] >= 1
        assert questions["steps"][LLAMA]["weights_bytes"] > 0
    else:
        assert questions["skipped"][LLAMA] == llamacpp.missing()


def test_a_llama_cpp_that_dies_on_this_cpu_is_skipped_saying_why(tiny_gguf, monkeypatch):
    """A llama-cpp-python built for AMX, on a VM whose CPU reports AMX but does not enable it, died
    of SIGILL in the warm-up (`tilezero`), ending the benchmark's own process: every measurement
    was lost, with no word why. It is tried in a child first and left out, saying how to rebuild it."""
    real = importlib.util.find_spec  # installed or not, llama-cpp-python is found: the trial decides
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real(name, *a))
    llamacpp.runs_here.cache_clear()
    monkeypatch.setattr(llamacpp, "TRIAL", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    loaded = FileAtPrecisions.of(tiny_gguf, ["float32"], threads=1)  # what the benchmark loads first
    assert loaded.llama is None and "died of SIGILL" in loaded.llama_missing
    assert "CMAKE_ARGS" in loaded.llama_missing and "GGML_NATIVE=OFF" in loaded.llama_missing
    for trial, said in (("raise SystemExit('no such tensor')", "llama.cpp could not run tiny.gguf (no such tensor)"),
                        ("pass", None)):
        llamacpp.runs_here.cache_clear()
        monkeypatch.setattr(llamacpp, "TRIAL", trial)
        assert llamacpp.missing(True, tiny_gguf) == said
    llamacpp.runs_here.cache_clear()


def test_methods_left_out_are_said(tiny_gguf):
    result = quick(tiny_gguf, with_llama=False, transformers=False)
    assert result["cases"][0]["skipped"] == {LLAMA: "left out (--no-llama)"}
    assert result["main"]["skipped"] == {HF: "left out (--no-transformers)", LLAMA: "left out (--no-llama)"}
    assert result["config"]["llama_cpp"] == "left out (--no-llama)"


def test_a_document_cut_to_about_n_tokens():
    from multidecode.data import sample_opening

    def words(text):
        return len(text.split())

    short, longer = sample_opening(20, words), sample_opening(200, words)
    assert 20 <= words(short) < words(longer) and longer.startswith(short)


def measurement(name, answers):
    return Measurement(name, 1.0, 1, 1, 0, 0.0, 0.0, [1.0], 1, answers=answers)


def test_a_same_precision_difference_fails_the_run():
    same = {ours("auto"): measurement("a", [[1, 2, 3]]), SPECULATING: measurement("s", [[1, 2, 3]]),
            ours("float32"): measurement("f", [[1, 9, 9]])}
    check_same_precision(same)  # another precision may differ: it is reported, not raised
    with pytest.raises(AnswersDiffer, match="at the same precision"):
        check_same_precision({**same, HF: measurement("h", [[1, 2, 4]])})


def test_an_untied_packed_embedding_counts_in_the_weights_and_not_in_a_step():
    """A packed input embedding that is not the LM head's keeps its own codes outside the module
    tree (`PackedEmbedding.head`): the model's bytes count them (they are resident), a decode
    step's do not (a lookup reads only its rows)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from multidecode.models.packed import PackedEmbedding, pack_model, packed_bytes

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config)
    pack_model(model, 4)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, PackedEmbedding) and embedding.head[0] is not model.get_output_embeddings()
    own = sum(t.untyped_storage().nbytes() for t in [*embedding.head[0].parameters(), *embedding.head[0].buffers()])
    tree = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t
                                                      for t in [*model.parameters(), *model.buffers()]}.values())
    assert own > 0 and packed_bytes(embedding) == own
    assert packed_bytes(model) == tree + own
    assert step_bytes(model) == tree


def test_step_bytes_leave_out_an_untied_input_embedding():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    untied = LlamaForCausalLM(config)
    everything = sum(t.numel() * 4 for t in [*untied.parameters(), *untied.buffers()])
    assert step_bytes(untied) == everything - 100 * 16 * 4
    tied = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": True}))
    assert step_bytes(tied) == sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t
                                   for t in [*tied.parameters(), *tied.buffers()]}.values())


def test_precisions_are_checked_before_anything_loads():
    assert parse_all(["fp32", "auto", "float32"], torch.device("cpu")) == ["auto", "float32"]
    with pytest.raises(InvalidArgument):
        parse_all(["float33"], torch.device("cpu"))


@pytest.mark.parametrize("args, said", [
    (["--precisions", "float33"], "precision"),
    (["--model", "model.txt"], ".gguf"),
    (["--workloads", "poem"], "workload"),
    (["--context-tokens", "-1"], "--context-tokens"),
])
def test_bad_settings_exit_2_with_a_hint(tmp_path, monkeypatch, args, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.txt").write_text("not a model")
    result = CliRunner().invoke(main, ["bench", "precision", *args])
    assert result.exit_code == 2, result.output
    assert said in result.output and "hint:" in result.output


def test_random_gguf_command_writes_a_file_and_refuses_an_unknown_shape(tmp_path):
    result = CliRunner().invoke(main, ["bench", "random-gguf", str(tmp_path / "t.gguf"), "--shape", "tiny"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "t.gguf").stat().st_size > 0
    assert "parameters" in result.output and "0.00B" not in result.output  # a tiny model's count, not 0.00B
    result = CliRunner().invoke(main, ["bench", "random-gguf", str(tmp_path / "u.gguf"), "--shape", "huge"])
    assert result.exit_code == 2 and "unknown shape" in result.output


def test_random_gguf_refuses_a_path_it_cannot_write_naming_it(tmp_path):
    """A missing folder ended in a FileNotFoundError traceback from deep inside the GGUF writer."""
    result = CliRunner().invoke(main, ["bench", "random-gguf", str(tmp_path / "no/such/t.gguf"), "--shape", "tiny"])
    assert result.exit_code != 0 and "does not exist" in result.output and "hint:" in result.output, result.output
    assert not isinstance(result.exception, FileNotFoundError), result.exception
    with pytest.raises(InvalidInput, match="is a folder"):
        write_random_gguf(tmp_path, shape="tiny")
    assert not list(tmp_path.rglob("*.partial"))


def test_measured_bandwidth_is_a_plausible_rate():
    assert 1e8 < measure_bandwidth(repeats=2, size=16 << 20) < 1e13
    assert torch.get_num_threads() >= 1


def test_a_run_without_the_questions_case_draws_its_tables(tiny_gguf):
    """--questions 0 (its help: leave it out) ended in KeyError: 'hf_sequential_auto', the pair of
    the speculating forest and transformers declared with no transformers method to draw."""
    result = quick(tiny_gguf, questions=0, with_llama=False, profile=False)
    assert [row["case"] for row in result["cases"]] == ["story", "context"]
    assert tables(result) and HF not in result["labels"]
