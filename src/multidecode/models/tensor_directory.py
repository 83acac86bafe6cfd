"""Where each tensor of a GGUF file lies, read once from its header and kept in the user cache.

gguf-py's reader parses every metadata field, seconds for a vocabulary of tens of thousands of
tokens; the directory needs none of them but the architecture and the alignment, so it is read
by stepping over the others (tens of milliseconds), written beside the config in the described
copy (`converted.gguf_copy(described=True)`), and a load then reads the tensors straight out of
the memory-mapped file.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DIRECTORY = "gguf-tensors.json"


@dataclass(frozen=True)
class TensorDirectory:
    """Where each tensor of a GGUF file lies: its name, type, dims (ggml order), byte offset and
    size, and the file's architecture (see the module notes)."""

    architecture: str
    tensors: list[dict]

    @classmethod
    def read(cls, path: str | Path) -> TensorDirectory:
        """The directory of the GGUF file at `path`, read from its header (`_Header`: the metadata
        skipped over, not parsed), or by gguf-py's reader where the header is not one `_Header`
        reads (a big-endian file, another version)."""
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            directory = _Header(data).directory()
        return directory if directory is not None else cls.read_with_gguf(path)

    @classmethod
    def read_with_gguf(cls, path: str | Path) -> TensorDirectory:
        """The directory as gguf-py's `GGUFReader` reads it (which parses every metadata field:
        seconds for a vocabulary of tens of thousands of tokens)."""
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        return cls(architecture, [{"name": t.name, "type": t.tensor_type.name, "dims": [int(d) for d in t.shape],
                                   "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in reader.tensors])

    @classmethod
    def load(cls, folder: str | Path) -> TensorDirectory:
        data = json.loads((Path(folder) / DIRECTORY).read_text(encoding="utf-8"))
        return cls(data["architecture"], data["tensors"])

    def save_pretrained(self, folder: str | Path) -> None:
        payload = {"architecture": self.architecture, "tensors": self.tensors}
        (Path(folder) / DIRECTORY).write_text(json.dumps(payload), encoding="utf-8")

    def tensor_bytes(self) -> int:
        """The bytes of the file's tensors (its size without the header and metadata)."""
        return sum(t["bytes"] for t in self.tensors)

    def types(self) -> Counter:
        """How many of the file's matrices (2-d tensors) are of each GGUF type."""
        return Counter(t["type"] for t in self.tensors if len(t["dims"]) == 2)

    def arrays(self, path: str | Path):
        """(name, type, raw array) of each tensor, memory-mapped: quantized types as
        [rows, bytes per row] uint8, float types as their numpy dtype."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        floats = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for t in self.tensors:
            raw = data[t["offset"]: t["offset"] + t["bytes"]]
            shape = tuple(reversed(t["dims"]))
            if t["type"] in floats:
                yield t["name"], t["type"], raw.view(floats[t["type"]]).reshape(shape)
            else:
                yield t["name"], t["type"], raw.reshape(quant_shape_to_byte_shape(shape, GGMLQuantizationType[t["type"]]))


SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF's scalar value types -> their struct format (8 is a string, 9 an array)."""
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


class _Header:
    """A cursor over a little-endian GGUF header (version 2 or 3): magic, version, tensor and
    field counts, the metadata fields (key, type, value), the tensor infos (name, dims, type,
    offset in the data section), then the data section at the next multiple of
    `general.alignment`. Only the architecture and the alignment are parsed out of the metadata;
    every other value is stepped over by its size."""

    def __init__(self, data) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (size,) = self.take("Q")
        self.at += size
        return bytes(self.data[self.at - size: self.at]).decode("utf-8")

    def skip(self, kind: int) -> None:
        """Step over a value of GGUF type `kind`."""
        if kind in SCALARS:
            self.at += struct.calcsize(SCALARS[kind])
        elif kind == STRING:
            (size,) = self.take("Q")
            self.at += size
        elif kind == ARRAY:
            item, count = self.take("IQ")
            if item in SCALARS:
                self.at += count * struct.calcsize(SCALARS[item])
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")

    def directory(self) -> TensorDirectory | None:
        """The file's tensor directory, or None where the header is not one this reads."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        magic, version, tensor_count, field_count = self.take("4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            return None
        known = {}
        for _ in range(field_count):
            key, (kind,) = self.string(), self.take("I")
            if key == "general.architecture" and kind == STRING:
                known[key] = self.string()
            elif key == "general.alignment" and kind in SCALARS:
                known[key] = self.take(SCALARS[kind])[0]
            else:
                self.skip(kind)
        infos = []
        for _ in range(tensor_count):
            name, (dimensions,) = self.string(), self.take("I")
            dims = list(self.take(f"{dimensions}Q"))
            kind, offset = self.take("IQ")
            infos.append((name, dims, GGMLQuantizationType(kind), offset))
        alignment = known.get("general.alignment", DEFAULT_ALIGNMENT)
        start = self.at + (-self.at % alignment)
        tensors = []
        for name, dims, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[kind]
            tensors.append({"name": name, "type": kind.name, "dims": dims, "offset": start + offset,
                            "bytes": math.prod(dims) * size // block})
        return TensorDirectory(known["general.architecture"], tensors)


__all__ = ["DIRECTORY", "TensorDirectory"]
