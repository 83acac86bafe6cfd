"""Loading models by name, the embedded model's float32 cache, and dtypes.

Nothing here touches the network: hub ids are served from a hub cache laid out on disk, and the
embedded conversion is exercised with a tiny stand-in (the real one is checked in test_embedded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from local_models import tiny_tokenizer
from tiny_models import reference_generate, tiny_model

import multidecode
from multidecode.cli import main
from multidecode.models import converted, loading


@pytest.mark.parametrize("precision, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                              ("int8", torch.bfloat16), ("int4", torch.bfloat16)])
def test_load_a_local_folder_at_each_cpu_precision(model_dir, precision, dtype):
    decoder = multidecode.load(str(model_dir), precision=precision, device="cpu")
    assert decoder.model.dtype == dtype and decoder.memory()["precision"] == precision
    assert decoder.model.config._attn_implementation == "multidecode_exact"
    (answer,) = decoder.ask("Here is a document about cables.", ["What is it about?"], max_new_tokens=5)
    assert 1 <= len(answer.token_ids) <= 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forests_run_and_stay_close(dtype):
    """bf16 forests run on the exact kernels, fp16 ones (no exact kernels: exact=False) on the
    model's own: the forest runs, and most greedy tokens still agree with the model's own
    generate in the same dtype."""
    model = tiny_model("llama", "sdpa", dtype)
    prefix, branches = list(range(10, 30)), [[40, 41], [50], [60, 61, 62]]
    outs = multidecode.decode(model, prefix, branches, max_new_tokens=8, eos_token_id=[],
                              exact=dtype == torch.bfloat16)
    agree = total = 0
    for branch, out in zip(branches, outs):
        ref = reference_generate(model, prefix + branch, max_new_tokens=8, eos_token_id=[])
        assert len(out) == 8
        agree += sum(a == b for a, b in zip(out, ref))
        total += len(ref)
    assert agree >= total // 2


def test_float16_is_refused_the_exact_kernels_with_its_remedy():
    with pytest.raises(multidecode.UnsupportedModel, match="float16") as refused:
        multidecode.decode(tiny_model("llama", "sdpa", torch.float16), [10, 11], [[12]], max_new_tokens=2)
    assert "exact=False" in refused.value.hint


def test_a_hub_id_is_served_from_the_local_hub_cache(model_dir, tmp_path):
    """A hub id works offline when the hub cache holds it (run as a user would, in a subprocess)."""
    snapshot = tmp_path / "hub" / "models--someorg--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (tmp_path / "hub" / "models--someorg--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someorg--tiny" / "refs" / "main").write_text("abc123")
    doc = tmp_path / "doc.txt"
    doc.write_text("Here is a document about cables.")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    script = Path(sys.executable).parent / "multidecode"
    result = subprocess.run([str(script), "ask", "--model", "someorg/tiny", "--document", str(doc), "-q", "why?",
                             "--max-new-tokens", "3", "--json"], capture_output=True, text=True, env=env, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)[0]["token_ids"]) <= 3


def test_a_hub_id_neither_cached_nor_reachable_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setattr(loading, "_hub_reachable", lambda timeout=3.0: False)
    doc = tmp_path / "doc.txt"
    doc.write_text("text")
    result = CliRunner().invoke(main, ["ask", "--model", "someorg/not-cached-anywhere", "--document", str(doc), "-q", "x"])
    assert result.exit_code == 2
    assert "hub is unreachable" in result.output + result.stderr


def test_loading_hints_speak_to_a_python_caller_too(monkeypatch):
    """load()'s hints spoke only of options (--device cpu, leave --model out) to Python callers."""
    monkeypatch.setattr(loading, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(multidecode.ModelNotFound) as caught:
        multidecode.load("someorg/not-cached-anywhere")
    assert "load()" in caught.value.hint
    if not torch.cuda.is_available():
        with pytest.raises(multidecode.InvalidArgument) as caught:
            multidecode.load(device="cuda")
        assert "device='cpu'" in caught.value.hint


def test_a_folder_without_a_tokenizer_is_named_with_what_transformers_missed(tmp_path, capfd, caplog):
    """The error kept transformers' first line only ("Couldn't instantiate the backend tokenizer
    from one of:"), which ends at a colon, and a deprecation warning of ours reached stderr."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1,
                                                    "num_attention_heads": 2, "intermediate_size": 32,
                                                    "vocab_size": 64}))
    # a tokenizer file that holds no tokenizer reaches transformers' words (a folder with no tokenizer
    # file at all is said to have none: tests/test_errors.py)
    (folder / "tokenizer_config.json").write_text("{}")
    with pytest.raises(multidecode.ModelNotFound) as caught:
        multidecode.load(str(folder))
    message = caught.value.message
    assert "\n" not in message and not message.rstrip().endswith(":"), message
    assert "tokenizer" in message and "serialization file" in message
    assert "torch_dtype" not in capfd.readouterr().err + caplog.text  # where transformers' logger writes


class _Interrupted(Exception):
    pass


def _fake_gguf_source(monkeypatch, tmp_path, *, fail_on_save: bool):
    """Make the embedded conversion load a tiny model instead of de-quantizing the real GGUF."""
    import transformers

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(converted, "embedded_gguf", lambda: fake)
    tiny = tiny_model("llama")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    tokenizer = tiny_tokenizer()
    if fail_on_save:
        def interrupted_save(*args, **kwargs):
            raise _Interrupted("killed half-way through writing")
        monkeypatch.setattr(tokenizer, "save_pretrained", interrupted_save)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)


def test_an_interrupted_conversion_leaves_no_copy_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIDECODE_CACHE", str(tmp_path / "cache"))
    _fake_gguf_source(monkeypatch, tmp_path, fail_on_save=True)
    with pytest.raises(_Interrupted):
        converted.embedded_copy()
    cache = tmp_path / "cache"
    assert not (cache / converted.EMBEDDED_COPY).exists()
    assert [p.name for p in cache.iterdir() if p.name.startswith(".convert-")] == []
    assert converted.embedded_copy(convert=False) is None


def test_a_conversion_is_done_once_and_then_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIDECODE_CACHE", str(tmp_path / "cache"))
    _fake_gguf_source(monkeypatch, tmp_path, fail_on_save=False)
    first = converted.embedded_copy()
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    assert converted.embedded_copy(convert=False) == first
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert converted.embedded_copy() == first and (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MULTIDECODE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert converted.cache_dir() == tmp_path / "xdg" / "multidecode"
    monkeypatch.setenv("MULTIDECODE_CACHE", str(tmp_path / "mine"))
    assert converted.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("MULTIDECODE_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert converted.cache_dir() == Path.home() / ".cache" / "multidecode"


@pytest.mark.embedded
@pytest.mark.xdist_group("embedded")
def test_a_gguf_file_loads_by_path():
    """The GGUF in the wheel, named as a file (served from the embedded model's float32 copy)."""
    decoder = multidecode.load(str(converted.embedded_gguf()))
    (answer,) = decoder.ask("The ticket number is 48213.", ["What is the ticket number?"], max_new_tokens=12)
    assert "48213" in answer.text


def test_a_models_display_name_is_what_it_was_made_from():
    """Results and explanations named the embedded model "SmolLM2-135M-Instruct-described" (its
    config's folder in the user cache), and a GGUF file's copy "gguf-<stem>-<hash>"."""
    from types import SimpleNamespace

    from multidecode.models.converted import model_display_name

    def named(name, model_type="llama"):
        return SimpleNamespace(config=SimpleNamespace(_name_or_path=name, model_type=model_type))

    cache = "/root/.cache/multidecode"
    assert model_display_name(named(f"{cache}/SmolLM2-135M-Instruct-described")) == "SmolLM2-135M-Instruct"
    assert model_display_name(named(f"{cache}/SmolLM2-135M-Instruct-float32")) == "SmolLM2-135M-Instruct"
    assert model_display_name(named(f"{cache}/gguf-Llama-3.2-1B.Q4_0-0123456789ab-described")) == "Llama-3.2-1B.Q4_0"
    assert model_display_name(named("HuggingFaceTB/SmolLM2-360M")) == "SmolLM2-360M"
    assert model_display_name(named("/models/my-model")) == "my-model"
    assert model_display_name(named("")) == "llama"
