"""The packed weights of a GGUF model kept in the user cache (`models.packed_cache`).

The first packed load of a GGUF file writes its codes in the kernels' layout beside its described
copy; later loads memory-map them and convert nothing. A file written for another GGUF file, bits
or layout, or a damaged one, is rebuilt, and every way gives the same model, bit for bit. Every test
writes its own tiny GGUF (`gguf_files`) and cache folder (the `cache` fixture).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from gguf_files import write_tiny_gguf

from multidecode.cli import main
from multidecode.errors import CacheUnwritable, InvalidArgument, ModelNotFound
from multidecode.models import converted, gguf, loading, packed, packed_cache
from multidecode.models.tensor_directory import TensorDirectory

IDS = torch.tensor([[3, 17, 42, 101, 7, 250]])


@pytest.fixture
def conversions(monkeypatch):
    """Count the calls that turn a file's blocks into packed codes (gguf.codes_of, portable.pack)."""
    calls = []

    def counted(name, real):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(gguf, "codes_of", counted("codes_of", gguf.codes_of))
    monkeypatch.setattr(packed, "pack", counted("pack", packed.pack))
    return calls


def load(model, precision=None):
    """(the loaded model, its logits on IDS)."""
    loaded = loading.load_model(None if model is None else str(model), precision_name=precision, device="cpu")
    with torch.no_grad():
        return loaded, loaded.model(IDS).logits


def packed_files(folder=None):
    folders = [folder] if folder else [p for p in converted.cache_dir().iterdir() if p.name.endswith("-described")]
    return sorted(p.name for f in folders for p in f.glob("packed-*"))


def fresh(tmp_path, model, precision=None):
    """The logits of a load in a cache of its own (nothing kept: read from the file)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTIDECODE_CACHE", str(tmp_path / f"fresh-cache-{precision}"))
        return load(model, precision)[1]


def described_of(path):
    return converted.gguf_copy(path, described=True, convert=False)


# ---------------------------------------------------------------------- written once, mapped after
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K"])
def test_the_second_load_maps_the_kept_weights_and_equals_the_first_bit_for_bit(cache, tmp_path, conversions, kind):
    shape = {"hidden": 256, "ffn": 256} if kind == "Q4_K" else {}  # Q4_K: rows of 256-weight super-blocks
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type=kind, **shape)
    first, first_logits = load(path)
    assert conversions and len(packed_files()) == 1
    conversions.clear()
    second, second_logits = load(path)
    assert conversions == []  # nothing converted: the codes come from the kept file
    assert torch.equal(first_logits, second_logits)
    assert second.formats == first.formats and second.file_tensor_bytes == first.file_tensor_bytes
    mine, theirs = first.model.state_dict(), second.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert packed.packed_bytes(first.model) == packed.packed_bytes(second.model)


def test_each_precision_keeps_its_own_file(cache, tmp_path, conversions):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type="Q4_0")
    own, int8 = load(path)[1], load(path, "int8")[1]
    assert len(packed_files()) == 2 and not torch.equal(own, int8)
    conversions.clear()
    assert torch.equal(load(path)[1], own) and torch.equal(load(path, "int8")[1], int8)
    assert conversions == []
    assert torch.equal(int8, fresh(tmp_path, path, "int8"))
    # `cache list` shows them apart (it showed one row of their sum): a line of weights by precision
    (entry,) = [e for e in converted.cache_entries() if e.name.endswith("-described")]
    assert list(entry.weights) == ["auto", "int8"] and all(size > 0 for size in entry.weights.values())
    listed = CliRunner().invoke(main, ["cache", "list"])
    assert listed.exit_code == 0 and "weights: auto " in listed.output and ", int8 " in listed.output, listed.output


# ---------------------------------------------------------------------- never trusted when stale
def test_a_changed_gguf_file_is_packed_again_even_where_its_described_copy_stays(cache, tmp_path, monkeypatch,
                                                                                   conversions):
    """The embedded model's described copy has a fixed name (a reinstall keeps it): the packed
    file's key, not the folder, tells a changed file."""
    path = write_tiny_gguf(tmp_path / "embedded.gguf", seed=0)
    monkeypatch.setattr(converted, "embedded_gguf", lambda: path)
    monkeypatch.setattr(loading, "embedded_gguf", lambda: path)
    old = load(None)[1]
    before = packed_files()
    write_tiny_gguf(path, seed=1)  # same shapes and vocabulary, other weights
    conversions.clear()
    new = load(None)[1]
    assert conversions and not torch.equal(old, new)
    after = packed_files()
    assert len(after) == 1 and after != before  # the stale file is gone
    assert torch.equal(new, fresh(tmp_path, path))


def test_a_changed_layout_is_packed_again(cache, tmp_path, monkeypatch, conversions):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    expected = load(path)[1]
    monkeypatch.setattr(packed_cache, "FORMAT", packed_cache.FORMAT + 1)
    conversions.clear()
    assert torch.equal(load(path)[1], expected) and conversions
    assert len(packed_files()) == 1


# ---------------------------------------------------------------------- never trusted when damaged
def _truncate(file):
    os.truncate(file, file.stat().st_size // 2)


def _garbage(file):
    file.write_bytes(os.urandom(file.stat().st_size))


def _one_byte_short(file):
    os.truncate(file, file.stat().st_size - 1)


@pytest.mark.parametrize("damage", [_truncate, _garbage, _one_byte_short])
def test_a_damaged_file_is_rebuilt_and_gives_the_same_logits(cache, tmp_path, conversions, caplog, damage):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type="Q4_1")
    expected = load(path)[1]
    (kept,) = described_of(path).glob("packed-*")
    damage(kept)
    conversions.clear()
    with caplog.at_level(logging.WARNING, logger="multidecode.models"):
        got = load(path)[1]
    assert conversions and "rebuilding" in caplog.text
    assert torch.equal(got, expected)
    conversions.clear()
    assert torch.equal(load(path)[1], expected) and conversions == []  # whole again


def test_a_file_written_for_another_key_is_not_read(cache, tmp_path, conversions):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    expected = load(path)[1]
    (kept,) = described_of(path).glob("packed-*")
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=3)
    load(other)
    (foreign,) = described_of(other).glob("packed-*")
    os.replace(foreign, kept)  # another model's weights under this one's name
    conversions.clear()
    assert torch.equal(load(path)[1], expected) and conversions


@pytest.mark.parametrize("error", ["os", "safetensors"])
def test_a_cache_that_cannot_be_written_costs_speed_not_the_model(cache, tmp_path, conversions, caplog, error):
    """safetensors says a full disk with an error of its own, not an OSError: it was a traceback."""
    import safetensors.torch

    path = write_tiny_gguf(tmp_path / "tiny.gguf")

    def full(*args, **kwargs):
        if error == "os":
            raise OSError(28, "No space left on device")
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.WARNING, logger="multidecode.models"):
        patch.setattr(safetensors.torch, "save_file", full)
        got = load(path)[1]
    assert "cannot keep the packed weights" in caplog.text
    assert packed_files() == [] and not list(described_of(path).glob(".packed-*"))  # no temporary left
    assert torch.equal(got, fresh(tmp_path, path))
    conversions.clear()
    load(path)
    assert conversions and len(packed_files()) == 1  # written by the next load that can


# ---------------------------------------------------------------------- the tensor directory
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "F16", "F32", "Q4_K"])
def test_the_directory_read_from_the_header_is_gguf_pys(tmp_path, kind):
    shape = {"hidden": 256, "ffn": 256} if kind == "Q4_K" else {}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type=kind, **shape)
    assert TensorDirectory.read(path) == TensorDirectory.read_with_gguf(path)


def test_the_directory_honours_the_files_alignment(tmp_path):
    import gguf as gguf_py
    import numpy as np

    path = tmp_path / "aligned.gguf"
    writer = gguf_py.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(256)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "def"])
    writer.add_tensor("odd", np.arange(7, dtype=np.float32))
    writer.add_tensor("after", np.ones((3, 5), dtype=np.float16))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    directory = TensorDirectory.read(path)
    assert directory == TensorDirectory.read_with_gguf(path)
    assert all(t["offset"] % 256 == 0 for t in directory.tensors)


@pytest.mark.embedded
def test_the_embedded_models_directory_read_from_the_header_is_gguf_pys():
    path = converted.embedded_gguf()
    assert TensorDirectory.read(path) == TensorDirectory.read_with_gguf(path)


@pytest.mark.parametrize("damaged, precision", [("gguf-tensors.json", None), ("config.json", None),
                                                ("model.safetensors", "float32"), ("config.json", "float32")])
def test_a_damaged_copy_is_made_again(cache, tmp_path, damaged, precision):
    """A copy cut short under its completion mark (a power cut after the rename) was a traceback on
    every later run, or an error blaming the GGUF file ("fetch it again")."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    expected = load(path, precision)[1]
    copy = converted.gguf_copy(path, described=precision is None, convert=False)
    whole = (copy / damaged).read_bytes()
    (copy / damaged).write_bytes(whole[:20])
    assert torch.equal(load(path, precision)[1], expected)
    assert (copy / damaged).read_bytes() == whole  # made again


def test_a_copy_cleared_while_it_loads_is_made_again(cache, tmp_path, monkeypatch):
    """`cache clear` in another process between a load's lookup of the float32 copy and its read:
    the load failed with transformers' "Repo id must be in the form ...", blaming the GGUF file."""
    import shutil

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    expected = load(path, "float32")[1]
    real, cleared = loading._float_folder, []

    def cleared_first(folder, *args):
        if not cleared:
            cleared.append(folder)
            shutil.rmtree(folder)
        return real(folder, *args)

    monkeypatch.setattr(loading, "_float_folder", cleared_first)
    assert torch.equal(load(path, "float32")[1], expected) and cleared


@pytest.mark.parametrize("refusal", [errno.EACCES, errno.ENOSPC])
def test_a_cache_folder_that_refuses_a_write_mends_nothing_and_says_so(cache, tmp_path, monkeypatch, refusal):
    """A write the folder refuses (another user's, read-only, full) was taken for a damaged copy:
    the good copies were removed to be made again, where that fails the same way (as a user without
    write access, a traceback from removing them). It is a CacheUnwritable, and the copies stay."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    load(path, None)
    before = sorted(p.name for p in converted.cache_dir().iterdir())

    def refused(*args):
        raise ModelNotFound("could not load") from OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(loading, "_load_gguf_once", refused)
    with pytest.raises(CacheUnwritable, match=os.strerror(refusal)) as caught:
        load(path, "int8")
    assert "MULTIDECODE_CACHE" in caught.value.hint
    assert sorted(p.name for p in converted.cache_dir().iterdir()) == before


def test_a_lock_this_user_cannot_write_is_taken_read_only(cache, monkeypatch):
    """A read-only cache whose lock files exist: the lock was opened for appending (`touch` had
    passed: a file's owner may stamp it), a PermissionError out of every load at a new precision."""
    lock = converted._lock_path("some-copy")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    real_open = open

    def read_only(file, mode="r", *args, **kwargs):
        if Path(file) == lock and mode != "r":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", read_only)
    with converted.locked_copy("some-copy"):
        assert converted._held(lock)


def test_a_users_error_mends_nothing_in_the_cache(cache, tmp_path):
    """An unknown precision (an InvalidArgument, a ValueError) was taken for a damaged copy: every
    copy of the model was removed, to be converted again by the next run."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    load(path, "float32")
    before = sorted(p.name for p in converted.cache_dir().iterdir())
    with pytest.raises(InvalidArgument, match="int3"):
        load(path, "int3")
    assert sorted(p.name for p in converted.cache_dir().iterdir()) == before
