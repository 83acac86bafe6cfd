"""Where each tensor of a GGUF file lies, read once from its header and kept in the user cache.

Parsing a GGUF file's metadata takes seconds (its vocabulary is thousands of fields): the
directory of its tensors is written beside its config in the described copy
(`converted.gguf_copy(described=True)`), and a load then reads the tensors straight out of the
memory-mapped file.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DIRECTORY = "gguf-tensors.json"


@dataclass(frozen=True)
class TensorDirectory:
    """Where each tensor of a GGUF file lies: its name, type, dims (ggml order), byte offset and
    size, and the file's architecture. Parsing a file's metadata takes seconds (its vocabulary is
    thousands of fields): the directory is kept beside the config, and tensors are then read
    straight out of the memory-mapped file."""

    architecture: str
    tensors: list[dict]

    @classmethod
    def read(cls, path: str | Path) -> TensorDirectory:
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


__all__ = ["DIRECTORY", "TensorDirectory"]
