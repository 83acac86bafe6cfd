"""A GGUF model's packed weights kept in the user cache, memory-mapped on every later load.

Reading a GGUF file's codes into the kernels' layout (`gguf.codes_of`, `kernels.portable.pack`)
costs a few hundred milliseconds for the embedded model and seconds for a larger one, on every
load. The first packed load writes what it built, every `PackedLinear`'s codes, scales and bias
and every other tensor the file fills, to one safetensors file beside the model's described copy
(`packed-<precision>-<key>.safetensors`, one per precision asked for); later loads memory-map it (safetensors maps the file: no byte is
read before a forward touches it, and the pages are the page cache's, shared between processes),
as llama.cpp maps a GGUF file.

A cache file is trusted only when it is the one the load would write:

- its name and its metadata carry `packed_key`: the GGUF file's identity (path, size, mtime, a
  SHA-256 of its header), the bits and the compute dtype asked for, `FORMAT`, and a SHA-256 of the
  source of the modules that make its bytes (the layout, the codes, the reading), so that a
  changed file or a changed layout is rebuilt, never read;
- it is written to a temporary file, flushed to disk and renamed into place, so a file under its
  name is whole; one that does not open (truncated, or a header overwritten: safetensors checks
  that its header and its size agree) or lacks a tensor is rebuilt. Bytes overwritten in place
  within the tensors (a disk error, a stray write) are not seen: checking them would read the
  whole file on every load, which the mapping is there to avoid (`multidecode cache clear` mends it).

Failing to write the file (a read-only cache) costs the next load its speed, never its model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from ..version import __version__
from .converted import PACKED_PREFIX, gguf_identity

FORMAT = 1
"""The packed file's own layout (its tensor names and metadata): bump it when they change."""
SUFFIX = ".safetensors"
_TEMPORARY = ".packed-"

log = logging.getLogger("multidecode.models")


@dataclass
class PackedWeights:
    """What a GGUF file puts into a model built on the meta device, as the file's reading and the
    cache both give it.

    packed: module name -> (bits, rows, inner) of the `PackedLinear` it becomes (the input
    embedding: a `PackedEmbedding` reading that linear's codes), whose codes, scales and bias are
    `tensors[f"{name}.codes"]`, `[f"{name}.scales"]` and `[f"{name}.bias"]` (if any).
    tensors: those, and every other tensor the file fills (by the model's parameter or buffer
    name, in its shape, at the compute dtype).
    report: what each of the file's tensors became, by the file's tensor name.
    """

    packed: dict[str, tuple[int, int, int]]
    tensors: dict[str, torch.Tensor]
    report: dict[str, str]

    def complete(self) -> bool:
        """Whether every packed module has its codes and scales."""
        return all(f"{name}.codes" in self.tensors and f"{name}.scales" in self.tensors for name in self.packed)


@dataclass(frozen=True)
class PackedFile:
    """Where the packed weights of one GGUF file at one precision are kept: `folder` (the file's
    described copy), `variant` (the bits and dtype, in words: one file per precision asked for)
    and `key` (see the module notes)."""

    folder: Path
    variant: str
    key: str

    @classmethod
    def of(cls, gguf: Path, folder: Path, *, bits: int | None, dtype: torch.dtype,
           makers: tuple[ModuleType, ...]) -> PackedFile:
        """The packed file of `gguf` at `bits` (None: each tensor's own width) and `dtype`, its bytes
        made by the code of `makers` (the modules whose source decides them)."""
        import transformers  # its tensor processors permute rows: another version may permute otherwise

        code = hashlib.sha256()
        for module in makers:
            code.update(_source(module))
        facts = [str(Path(gguf).resolve()), gguf_identity(gguf).key, str(bits), str(dtype), str(FORMAT),
                 code.hexdigest(), __version__, transformers.__version__]
        variant = f"{'own' if bits is None else f'int{bits}'}-{str(dtype).removeprefix('torch.')}"
        return cls(Path(folder), variant, hashlib.sha256("\n".join(facts).encode()).hexdigest())

    @property
    def path(self) -> Path:
        return self.folder / f"{PACKED_PREFIX}{self.variant}-{self.key[:24]}{SUFFIX}"

    def read(self) -> PackedWeights | None:
        """The packed weights kept here, memory-mapped; None where there are none, or none to trust
        (written for another key, cut short, not a safetensors file, incomplete)."""
        from safetensors import safe_open

        if not self.path.is_file():
            return None
        try:
            with safe_open(self.path, framework="pt") as handle:
                metadata = handle.metadata() or {}
                if metadata.get("key") != self.key or metadata.get("format") != str(FORMAT):
                    return None
                names = handle.keys()
                tensors = {name: handle.get_tensor(name) for name in names}  # mapped, not read
            packed = {name: tuple(shape) for name, shape in json.loads(metadata["packed"]).items()}
            weights = PackedWeights(packed, tensors, json.loads(metadata["report"]))
        except Exception as err:  # noqa: BLE001 - whatever a damaged file raises, it is rebuilt
            log.warning("the packed weights in %s cannot be read (%s); rebuilding them", self.path, err)
            return None
        if not weights.complete():
            log.warning("the packed weights in %s lack tensors; rebuilding them", self.path)
            return None
        return weights

    def write(self, weights: PackedWeights) -> Path | None:
        """Write `weights` here atomically (a temporary file, flushed, renamed) and remove this
        variant's older files; None where the cache cannot be written."""
        from safetensors import SafetensorError  # safetensors' own I/O errors (a full disk) are not OSErrors
        from safetensors.torch import save_file

        metadata = {"format": str(FORMAT), "key": self.key, "packed": json.dumps(weights.packed),
                    "report": json.dumps(weights.report)}
        temporary = None
        try:
            handle, temporary = tempfile.mkstemp(prefix=_TEMPORARY, suffix=".tmp", dir=self.folder)
            os.close(handle)
            save_file({name: tensor.contiguous() for name, tensor in weights.tensors.items()}, temporary,
                      metadata=metadata)
            with open(temporary, "rb+") as written:
                os.fsync(written.fileno())
            os.replace(temporary, self.path)
        except (OSError, SafetensorError) as err:
            log.warning("cannot keep the packed weights in %s (%s); the next load packs them again", self.folder, err)
            return None
        finally:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
        self.remove_others()
        return self.path

    def remove_others(self) -> None:
        """Remove this variant's other files (for an older GGUF file or layout) and the temporary
        files a killed write left (writes hold the copy's lock: none is under way)."""
        for path in [*self.folder.glob(f"{PACKED_PREFIX}{self.variant}-*{SUFFIX}"), *self.folder.glob(f"{_TEMPORARY}*.tmp")]:
            if path != self.path:
                with contextlib.suppress(OSError):
                    path.unlink()


def _source(module: ModuleType) -> bytes:
    """A module's source (its name where the source is not at hand: an install without .py files)."""
    try:
        return Path(module.__file__).read_bytes()
    except (OSError, TypeError):
        return module.__name__.encode()


__all__ = ["FORMAT", "PackedFile", "PackedWeights"]
