"""Loading a model by name.

A model may be named as nothing (the embedded default), a local Hugging Face folder, a local
`.gguf` file, or a hub id (which works only where the hub is reachable or cached).

A loaded model is vetted (`vetting.check_supported`), put in eval mode on its device, and given
the forest's sdpa kernel (`attention.use_forest_sdpa`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..attention import use_forest_sdpa
from ..errors import InvalidArgument, ModelNotFound
from .converted import embedded_copy, gguf_copy
from .reading import from_pretrained, loading_errors, quiet_transformers
from .vetting import check_supported


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise InvalidArgument(f"unknown device {device!r}", "use cpu, cuda or cuda:N") from err
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"device {device!r} is not supported", "use cpu, cuda or cuda:N")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device {device!r} was asked for, but this torch has no usable CUDA",
                              "use --device cpu, or install a CUDA build of torch on a machine with a GPU")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise InvalidArgument(f"there is no {device} (this machine has {torch.cuda.device_count()} CUDA devices)",
                              "use cuda:0 or leave --device unset")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise InvalidArgument(f"unknown dtype {dtype!r}", f"use one of {', '.join(sorted(names))}")
    return names[dtype]


def load_model_and_tokenizer(model: str | os.PathLike | None = None, *, dtype=None, device=None):
    """Load (model, tokenizer) from a name as described in the module docstring."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    kwargs: dict = {}
    if model is None:
        folder, kwargs = embedded_copy(), {}
    else:
        folder, kwargs = _locate(str(model))
    with quiet_transformers(), loading_errors(model):
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        lm = from_pretrained(AutoModelForCausalLM, folder, torch_dtype, kwargs)
    lm.to(torch_device)
    lm.eval()
    check_supported(lm)
    use_forest_sdpa(lm)
    return lm, tokenizer


def _locate(name: str) -> tuple[str, dict]:
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(
                f"{path} holds no config.json, so it is not a Hugging Face model folder",
                "point --model at the folder that holds config.json and the weights",
            )
        return str(path), {}
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(
                f"{path} is a file but not a .gguf model",
                "pass a Hugging Face model folder or a .gguf file",
            )
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ModelNotFound(f"{path} is not a GGUF file (it lacks the GGUF header)", "check the file")
        return str(gguf_copy(path)), {}
    looks_like_path = name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1
    if looks_like_path or os.sep in name and Path(name.split(os.sep)[0]).exists():
        raise ModelNotFound(f"no model at {path}: the path does not exist", "check the path")
    return name, _hub_kwargs(name)


def _hub_kwargs(repo_id: str) -> dict:
    """How to load a hub id: from the local hub cache if it is there, else from the hub if it
    answers within a few seconds (instead of a minute of retries), else a clear error."""
    from transformers import AutoConfig

    with quiet_transformers():
        try:
            AutoConfig.from_pretrained(repo_id, local_files_only=True)
            return {"local_files_only": True}
        except (OSError, ValueError):
            pass
    if not _hub_reachable():
        raise ModelNotFound(
            f"{repo_id!r} is not a local path, is not in the local Hugging Face cache, and the hub is unreachable",
            "pass a local model folder or .gguf file, or leave --model out for the embedded model",
        )
    return {}


def _hub_reachable(timeout: float = 3.0) -> bool:
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False
