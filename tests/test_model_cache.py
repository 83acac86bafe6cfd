"""The float32 cache of GGUF models (loaded at --precision float32), and `multidecode cache list|clear`.

Every test writes its own tiny Llama GGUF (`gguf_files`: a byte-level BPE vocabulary of 263 tokens
in the metadata, Q8_0 matrices, 44 KB) with the `gguf` package, and points MULTIDECODE_CACHE at a
folder of its own: nothing is downloaded and the user's cache is never touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import pytest
import torch
from click.testing import CliRunner
from gguf_files import write_tiny_gguf

from multidecode import CacheUnwritable, ModelNotFound
from multidecode.cli import main
from multidecode.kernels.build import BUILD_LOCK, KERNELS_FOLDER
from multidecode.models import converted, loading


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def conversions(monkeypatch):
    """Count the conversions (the calls of converted._convert_gguf)."""
    calls = []
    real = converted._convert_gguf

    def counted(gguf, target):
        calls.append(target.name)
        return real(gguf, target)

    monkeypatch.setattr(converted, "_convert_gguf", counted)
    return calls


def load(path):
    """The float32 copy's load (packed precisions read the file itself: tests/test_precision.py)."""
    return loading.load_model_and_tokenizer(str(path), precision="float32", device="cpu")


def copies(cache):
    return sorted(p.name for p in cache.iterdir() if p.name.startswith("gguf-")) if cache.exists() else []


def leftovers(cache):
    return sorted(p.name for p in cache.iterdir() if p.name.startswith(converted._PARTIAL)) if cache.exists() else []


def cli(*args, input=None):
    return CliRunner().invoke(main, ["cache", *args], input=input)


# ---------------------------------------------------------------------- converting once
def test_the_first_load_converts_into_a_named_folder_with_a_manifest(cache, tiny_gguf, conversions):
    lm, tokenizer = load(tiny_gguf)
    assert lm.config.model_type == "llama" and tokenizer.decode(tokenizer("hello world")["input_ids"]) == "hello world"
    identity = converted.gguf_identity(tiny_gguf)
    name = f"gguf-tiny-{identity.key[:12]}"
    assert conversions == [name] and copies(cache) == [name] and leftovers(cache) == []
    folder = cache / name
    assert (folder / "model.safetensors").is_file() and (folder / converted._COMPLETE).is_file()
    manifest = json.loads((folder / converted.MANIFEST).read_text())
    stat = tiny_gguf.stat()
    assert manifest["name"] == name and manifest["kind"] == "gguf" and manifest["source"] == str(tiny_gguf.resolve())
    assert manifest["size"] == stat.st_size and manifest["mtime_ns"] == stat.st_mtime_ns
    assert manifest["header_sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()  # the file < 1 MiB
    assert manifest["key"] == identity.key and manifest["dtype"] == "float32"
    assert manifest["multidecode_version"] == __import__("multidecode").__version__
    assert abs(time.time() - _epoch(manifest["created"])) < 600


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


def test_a_second_load_uses_the_copy(cache, tiny_gguf, conversions):
    load(tiny_gguf)
    weights = cache / copies(cache)[0] / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    load(tiny_gguf)
    assert len(conversions) == 1 and weights.stat().st_mtime_ns == stamp
    assert converted.gguf_copy(tiny_gguf, convert=False) == weights.parent


def test_a_touched_file_gets_a_new_copy(cache, tiny_gguf, conversions):
    load(tiny_gguf)
    before = converted.gguf_copy_name(tiny_gguf)
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert converted.gguf_copy_name(tiny_gguf) != before
    assert converted.gguf_copy(tiny_gguf, convert=False) is None
    load(tiny_gguf)
    assert len(conversions) == 2 and len(copies(cache)) == 2


def test_a_rewritten_header_of_the_same_size_and_mtime_gets_a_new_key(tiny_gguf):
    before = converted.gguf_identity(tiny_gguf)
    stat = tiny_gguf.stat()
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data.replace(b"tiny", b"tinz", 1))  # general.name, in the metadata
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = converted.gguf_identity(tiny_gguf)
    assert (after.size, after.mtime_ns) == (before.size, before.mtime_ns)
    assert after.header_sha256 != before.header_sha256 and after.key != before.key


def test_a_copy_of_the_file_elsewhere_with_the_same_identity_shares_the_copy(cache, tiny_gguf, tmp_path, conversions):
    load(tiny_gguf)
    twin = tmp_path / "elsewhere" / "tiny.gguf"
    twin.parent.mkdir()
    twin.write_bytes(tiny_gguf.read_bytes())
    stat = tiny_gguf.stat()
    os.utime(twin, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    load(twin)
    assert len(conversions) == 1


class _Interrupted(Exception):
    pass


def test_an_interrupted_conversion_leaves_no_broken_folder(cache, tiny_gguf, monkeypatch):
    def killed(*args, **kwargs):
        raise _Interrupted("killed half-way through writing")

    monkeypatch.setattr(converted, "_write_manifest", killed)  # after the weights and the tokenizer are written
    with pytest.raises(_Interrupted):
        load(tiny_gguf)
    assert copies(cache) == [] and leftovers(cache) == []
    assert converted.gguf_copy(tiny_gguf, convert=False) is None
    monkeypatch.undo()
    monkeypatch.setenv("MULTIDECODE_CACHE", str(cache))
    load(tiny_gguf)
    assert len(copies(cache)) == 1


def test_a_partial_folder_of_a_killed_conversion_is_removed_by_the_next(cache, tiny_gguf):
    name = converted.gguf_copy_name(tiny_gguf)
    stale = cache / f"{converted._PARTIAL}{name}-k1lled"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    load(tiny_gguf)
    assert leftovers(cache) == [] and copies(cache) == [name]


def test_two_threads_loading_at_once_convert_once(cache, tiny_gguf, monkeypatch):
    calls = []
    real = converted._convert_gguf

    def slow(gguf, target):
        calls.append(target.name)
        time.sleep(0.3)  # long enough for the other thread to reach the lock
        return real(gguf, target)

    monkeypatch.setattr(converted, "_convert_gguf", slow)
    results = []
    threads = [threading.Thread(target=lambda: results.append(converted.gguf_copy(tiny_gguf))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and results[0].is_dir()


def test_the_copy_gives_the_logits_of_the_gguf_loaded_by_transformers(cache, tiny_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm, tokenizer = load(tiny_gguf)
    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    direct_tokenizer = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    text = "hello world, hello cables"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == direct_tokenizer(text, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        ours, theirs = lm(ids).logits, direct(ids).logits
    assert lm.dtype == torch.float32 and theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_the_embedded_file_named_by_path_uses_the_embedded_copy(cache, tiny_gguf, monkeypatch, conversions):
    monkeypatch.setattr(converted, "embedded_gguf", lambda: tiny_gguf)
    assert converted.gguf_copy(tiny_gguf) == cache / converted.EMBEDDED_COPY == converted.embedded_copy(convert=False)
    assert conversions == [converted.EMBEDDED_COPY] and copies(cache) == []
    assert json.loads((cache / converted.EMBEDDED_COPY / converted.MANIFEST).read_text())["kind"] == "embedded"


def test_a_cache_that_cannot_be_written_is_named(monkeypatch, tmp_path, tiny_gguf):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MULTIDECODE_CACHE", str(blocker / "cache"))
    with pytest.raises(CacheUnwritable, match="tiny.gguf"):
        load(tiny_gguf)


def test_a_full_disk_under_the_float32_copy_is_named(cache, tiny_gguf, monkeypatch):
    """safetensors says a full disk with an error of its own, not an OSError: it was a traceback."""
    import safetensors
    import transformers.modeling_utils

    def full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    with pytest.raises(CacheUnwritable, match="cannot write the float32 copy of tiny.gguf.*No space left") as caught:
        load(tiny_gguf)
    assert "MULTIDECODE_CACHE" in caught.value.hint and copies(cache) == []


def test_a_broken_gguf_is_not_found_and_leaves_nothing(cache, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelNotFound, match="broken.gguf"):
        load(broken)
    assert copies(cache) == [] and leftovers(cache) == []


# ---------------------------------------------------------------------- multidecode cache
def _costs(cache):
    (cache / "costs").mkdir(parents=True)
    (cache / "costs" / "0123456789abcdef0123.json").write_text("{}")


def test_cache_list_shows_each_copy_and_the_cost_curves(cache, tiny_gguf):
    load(tiny_gguf)
    _costs(cache)
    (cache / "notes.txt").write_text("mine")
    name = copies(cache)[0]
    result = cli("list")
    assert result.exit_code == 0, result.output
    for needle in (name, "model", "current", f"from {tiny_gguf.resolve()}", "costs", "1 cost curve", "notes.txt",
                   "other", "total", "3 items"):
        assert needle in result.output
    listed = json.loads(cli("list", "--json").output)
    assert listed["folder"] == str(cache)
    by_name = {e["name"]: e for e in listed["entries"]}
    assert set(by_name) == {name, "costs", "notes.txt"}
    model = by_name[name]
    assert model["kind"] == "model" and model["source"] == str(tiny_gguf.resolve()) and model["state"] == "current"
    assert model["manifest"]["dtype"] == "float32" and model["created"] == model["manifest"]["created"]
    assert model["bytes"] == sum(p.stat().st_size for p in (cache / name).iterdir())
    assert model["weights"] == {"float32": sum(p.stat().st_size for p in (cache / name).glob("*.safetensors"))}
    assert listed["total_bytes"] == sum(e["bytes"] for e in listed["entries"])
    assert by_name["costs"]["kind"] == "costs" and by_name["notes.txt"]["kind"] == "other"


def test_cache_list_says_when_a_source_changed_or_went(cache, tiny_gguf):
    load(tiny_gguf)
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert [e["state"] for e in json.loads(cli("list", "--json").output)["entries"]] == ["source changed"]
    tiny_gguf.unlink()
    assert [e["state"] for e in json.loads(cli("list", "--json").output)["entries"]] == ["source missing"]


def test_cache_clear_yes_removes_the_copies_and_keeps_the_cost_curves(cache, tiny_gguf, conversions):
    load(tiny_gguf)
    _costs(cache)
    name = copies(cache)[0]
    result = cli("clear", "--yes")
    assert result.exit_code == 0, result.output
    assert f"removed {name}" in result.output and "Freed" in result.output
    assert copies(cache) == [] and (cache / "costs").is_dir()
    load(tiny_gguf)  # converted again
    assert len(conversions) == 2


def test_cache_clear_names_only_what_it_names(cache, tmp_path):
    first, second = write_tiny_gguf(tmp_path / "first.gguf"), write_tiny_gguf(tmp_path / "second.gguf", seed=1)
    load(first)
    load(second)
    _costs(cache)
    keep, drop = converted.gguf_copy_name(first), converted.gguf_copy_name(second)
    assert cli("clear", "--yes", drop, "costs").exit_code == 0
    assert copies(cache) == [keep] and not (cache / "costs").exists()


def test_cache_clear_asks_first(cache, tiny_gguf):
    load(tiny_gguf)
    name = copies(cache)[0]
    refused = cli("clear", input="n\n")
    assert refused.exit_code != 0 and name in refused.output and copies(cache) == [name]
    assert "Nothing removed" in refused.output and "--yes" in refused.output  # was click's bare "Aborted!"
    unanswered = cli("clear", input="")  # no terminal to answer at: a script that forgot --yes
    assert unanswered.exit_code != 0 and "--yes" in unanswered.output and copies(cache) == [name]
    accepted = cli("clear", input="y\n")
    assert accepted.exit_code == 0 and copies(cache) == []


def test_cache_clear_leaves_a_conversion_under_way_alone(cache, tiny_gguf):
    load(tiny_gguf)
    name = converted.gguf_copy_name(tiny_gguf)
    partial = cache / f"{converted._PARTIAL}gguf-other-0123456789ab-x7y"
    partial.mkdir()
    lock = converted._lock_path("gguf-other-0123456789ab")
    with converted._exclusive(lock):  # held as a converting process holds it
        states = {e["name"]: e["state"] for e in json.loads(cli("list", "--json").output)["entries"]}
        assert states[partial.name] == "converting"
        assert partial.name not in [e.name for e in converted.select_entries()]
        result = cli("clear", "--yes", partial.name)
        assert result.exit_code == 0 and "another process is converting it" in result.output
        assert partial.is_dir()
        with converted._exclusive(converted._lock_path(name)):
            assert cli("clear", "--yes", name).exit_code == 0
            assert copies(cache) == [name]
    result = cli("clear", "--yes", partial.name)
    assert result.exit_code == 0 and not partial.exists()


def test_an_abandoned_partial_is_listed_and_cleared(cache):
    partial = cache / f"{converted._PARTIAL}gguf-gone-0123456789ab-q2w"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"x" * 100)
    (entry,) = json.loads(cli("list", "--json").output)["entries"]
    assert (entry["kind"], entry["state"], entry["bytes"]) == ("partial", "abandoned", 100)
    assert cli("clear", "--yes").exit_code == 0 and not partial.exists()


def test_cache_clear_of_an_unknown_name_fails_cleanly(cache, tiny_gguf):
    load(tiny_gguf)
    result = cli("clear", "--yes", "gguf-nothing-000000000000")
    assert result.exit_code == 2
    assert "nothing named gguf-nothing-000000000000" in result.output and copies(cache) != []
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("command", [["list"], ["list", "--json"], ["clear", "--yes"]])
def test_a_cache_folder_not_made_yet_is_an_empty_cache(cache, command):
    result = cli(*command)
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert not cache.exists()  # looking does not make it
    if "--json" in command:  # a script reads an empty listing, not an error
        assert json.loads(result.output) == {"folder": str(cache), "entries": [], "total_bytes": 0}
    else:
        assert ("Nothing to clear" if command[0] == "clear" else "0 items") in result.output


@pytest.mark.parametrize("command", [["list"], ["clear", "--yes"]])
def test_a_cache_folder_that_is_a_file_is_a_clean_error(cache, command):
    cache.write_text("not a folder")
    result = cli(*command)
    assert result.exit_code == 2 and "is a file" in result.output and "MULTIDECODE_CACHE" in result.output
    assert "Traceback" not in result.output


def kernel_builds(cache, *keys):
    """A kernels folder with one (fake) build per key, as `multidecode.kernels.build` lays them out."""
    for key in keys:
        (cache / KERNELS_FOLDER / key).mkdir(parents=True)
        (cache / KERNELS_FOLDER / key / "multidecode_kernels.so").write_bytes(b"x" * 10)
    return cache / KERNELS_FOLDER


def test_the_compiled_kernels_are_listed_and_cleared_only_by_name(cache):
    kernels = kernel_builds(cache, "a" * 16, "b" * 16)
    (entry,) = json.loads(cli("list", "--json").output)["entries"]
    assert (entry["name"], entry["kind"], entry["state"], entry["bytes"]) == ("kernels", "kernels", "2 builds", 20)
    assert cli("clear", "--yes").exit_code == 0 and kernels.exists()  # not a converted model
    assert cli("clear", "--yes", "kernels").exit_code == 0 and not kernels.exists()


def test_a_kernels_build_under_way_is_left_alone(cache):
    from filelock import FileLock

    kernels = kernel_builds(cache, "a" * 16, "b" * 16)
    with FileLock(str(kernels / ("b" * 16) / BUILD_LOCK)):  # as a build compiling in another process holds it
        (entry,) = json.loads(cli("list", "--json").output)["entries"]
        assert entry["state"] == "2 builds, 1 building now"
        result = cli("clear", "--yes", "kernels")
        assert result.exit_code == 0 and "skipped kernels: another process is building them" in result.output
        assert "Freed 10 B" in result.output  # the build that was not compiling went
        assert not (kernels / ("a" * 16)).exists() and (kernels / ("b" * 16) / "multidecode_kernels.so").exists()
    assert cli("clear", "--yes", "kernels").exit_code == 0 and not kernels.exists()  # once it is done


def test_clearing_an_empty_cache_says_so(cache):
    cache.mkdir()
    result = cli("clear")
    assert result.exit_code == 0 and "Nothing to clear" in result.output


def test_the_status_line_of_a_first_read_says_what_and_about_how_long(cache, tiny_gguf):
    from multidecode.cli.common import _first_read, first_read_seconds

    line = _first_read(str(tiny_gguf), None)  # packed: the description and the packed weights
    assert line.startswith("Reading ") and f"about {first_read_seconds(tiny_gguf.stat().st_size):.0f} s" in line
    assert "Converting" in _first_read(str(tiny_gguf), "float32")
    assert first_read_seconds(2 * 10**9) > first_read_seconds(10**8) > 0  # a bigger file, a longer wait
    loading.load_model_and_tokenizer(str(tiny_gguf), device="cpu")
    assert _first_read(str(tiny_gguf), None) is None  # read once: no line, nothing to wait for


def test_the_described_tokenizer_is_kept_and_a_damaged_copy_rebuilt(cache, tiny_gguf):
    from transformers import AutoTokenizer

    described = converted.gguf_copy(tiny_gguf, described=True)
    first = loading.described_tokenizer(described)
    (kept,) = described.glob("tokenizer-*.pickle")
    again = loading.described_tokenizer(described)  # from the kept pickle
    read = AutoTokenizer.from_pretrained(described)
    text = "hello <s> world"
    assert again(text)["input_ids"] == first(text)["input_ids"] == read(text)["input_ids"]
    assert again.get_vocab() == read.get_vocab() and again.eos_token_id == read.eos_token_id
    kept.write_bytes(b"not a pickle")  # damaged: read again and kept anew, never trusted
    assert loading.described_tokenizer(described)(text)["input_ids"] == read(text)["input_ids"]
    assert kept.read_bytes() != b"not a pickle"


def test_compiled_graphs_are_kept_in_the_user_cache_unless_the_user_chose_a_place(monkeypatch, tmp_path):
    """torch writes its /tmp default into TORCHINDUCTOR_CACHE_DIR the first time it asks (a load
    does), and setdefault then kept it: graphs landed in /tmp, not in the user cache as the docs say."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from multidecode import compiled

    monkeypatch.setenv("MULTIDECODE_CACHE", str(tmp_path / "cache"))
    for before in (None, default_cache_dir()):
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        compiled.use_inductor_cache()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    compiled.use_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_cache_this_user_cannot_write_is_listed(cache, monkeypatch):
    """Listing opened each build's lock to append to it: a read-only cache (or root's) was a traceback."""
    import builtins

    kernels = kernel_builds(cache, "a" * 16)
    (kernels / ("a" * 16) / BUILD_LOCK).write_text("")  # as every build leaves it
    opened = builtins.open

    def read_only(file, mode="r", *args, **kwargs):
        if str(file).startswith(str(cache)) and any(c in mode for c in "wax+"):
            raise OSError(30, "Read-only file system", str(file))
        return opened(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only)
    result = cli("list", "--json")
    assert result.exit_code == 0, result.output
    assert [e["state"] for e in json.loads(result.output)["entries"]] == ["1 build"]


def test_another_users_copy_is_listed_as_not_readable(cache, tiny_gguf, monkeypatch):
    """Copies are made mode 0700: another user's `cache list` (and `cache clear`) met a
    PermissionError looking into one, a traceback."""
    from pathlib import Path

    converted.gguf_copy(tiny_gguf, described=True)
    real = Path.is_file

    def not_ours(path):
        if path.name == converted._COMPLETE:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(Path, "is_file", not_ours)
    result = cli("list", "--json")
    assert result.exit_code == 0, result.output
    assert [e["state"] for e in json.loads(result.output)["entries"]] == ["not readable here (Permission denied)"]


def test_the_embedded_copy_follows_the_installed_file(cache, tmp_path, monkeypatch, conversions):
    """Its name is fixed, so a package upgrade with other weights kept the old copy: float32 ran the
    weights the package no longer had, and `cache list` said "embedded". A reinstall (a new mtime,
    the same bytes) still costs no conversion."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    installed = write_tiny_gguf(tmp_path / "a" / "SmolLM2.gguf")
    monkeypatch.setattr(converted, "embedded_gguf", lambda: installed)
    converted.embedded_copy()
    os.utime(installed, ns=(time.time_ns(), time.time_ns() + 10**9))  # reinstalled: a new mtime only
    converted.embedded_copy()
    assert conversions == [converted.EMBEDDED_COPY]
    moved = tmp_path / "c" / "SmolLM2.gguf"  # the same file in another install (the first one since removed)
    moved.parent.mkdir()
    installed.rename(moved)
    monkeypatch.setattr(converted, "embedded_gguf", lambda: moved)
    (entry,) = [e for e in json.loads(cli("list", "--json").output)["entries"] if e["name"] == converted.EMBEDDED_COPY]
    assert entry["state"] == "embedded" and entry["source"] == str(moved)  # not the path that is gone
    upgraded = write_tiny_gguf(tmp_path / "b" / "SmolLM2.gguf", seed=7)
    monkeypatch.setattr(converted, "embedded_gguf", lambda: upgraded)
    (entry,) = [e for e in json.loads(cli("list", "--json").output)["entries"] if e["name"] == converted.EMBEDDED_COPY]
    assert entry["state"] == "source changed"
    copy = converted.embedded_copy()
    assert conversions == [converted.EMBEDDED_COPY] * 2
    manifest = json.loads((copy / converted.MANIFEST).read_text())
    assert manifest["header_sha256"] == converted.gguf_identity(upgraded).header_sha256
