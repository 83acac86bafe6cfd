"""Loading a model by name.

A model may be named as nothing (the embedded default), a local Hugging Face folder, a local
`.gguf` file, or a hub id (which works only where the hub is reachable or cached).

A loaded model is vetted (`vetting.check_supported`), put in eval mode on its device, and given
the forest's sdpa kernel (`attention.use_forest_sdpa`).
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..attention import use_forest_sdpa
from ..errors import CacheUnwritable, InvalidArgument, ModelNotFound, MultiDecodeError
from ..exact import use_exact_kernels
from ..user_cache import cache_dir
from . import precision
from .converted import cache_copies, discard_copies, embedded_gguf, gguf_copy
from .packed import pack_model
from .reading import from_pretrained, in_one_line, loading_errors, quiet_transformers
from .vetting import check_supported

log = logging.getLogger("multidecode.models")


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device.strip().lower() if isinstance(device, str) else device)
    except (RuntimeError, TypeError) as err:
        raise InvalidArgument(f"unknown device {device!r}", "use cpu, cuda or cuda:N") from err
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"device {device!r} is not supported", "use cpu, cuda or cuda:N")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device {device!r} was asked for, but this torch has no usable CUDA",
                              "use the CPU (device='cpu', --device cpu), or install a CUDA build of torch on a machine with a GPU")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise InvalidArgument(f"there is no {device} (this machine has {torch.cuda.device_count()} CUDA devices)",
                              "use cuda:0, or leave the device unset")
    return resolved


@dataclass
class Loaded:
    """A loaded model: the model, its tokenizer, the precision it runs at (and why), and what each
    of its file's tensors became (`formats`, for a GGUF file; empty otherwise)."""

    model: object
    tokenizer: object
    precision: precision.Precision
    formats: dict[str, str] = field(default_factory=dict)
    source: str = "embedded"
    file_tensor_bytes: int | None = None  # a GGUF file's tensor bytes, where its directory was read


def load_model_and_tokenizer(model: str | os.PathLike | None = None, *, precision=None, device=None,
                             exact: bool = True):
    """(model, tokenizer) from a name as described in the module docstring (see `load_model`)."""
    loaded = load_model(model, precision_name=precision, device=device, exact=exact)
    return loaded.model, loaded.tokenizer


def load_model(model: str | os.PathLike | None = None, *, precision_name=None, device=None,
               exact: bool = True) -> Loaded:
    """Load a model by name at a precision (see `precision`; `auto` by default).

    exact: switch it to batch-invariant attention (`multidecode.exact`): a node's logits do not
    depend on what shares its forward, bit for bit; False keeps the model's own (sdpa) attention,
    faster on long prompts, exact to the token.
    """
    torch_device = resolve_device(device)
    if _is_gguf(model):
        loaded = _load_gguf(model, precision_name, torch_device)
    else:
        loaded = _load_folder(str(model), resolve_precision(model, precision_name, torch_device))
    lm = loaded.model
    lm.to(torch_device)
    lm.eval()
    check_supported(lm)
    if exact:
        use_exact_kernels(lm)
    else:
        use_forest_sdpa(lm)
    return loaded


def resolve_precision(model: str | os.PathLike | None = None, precision_name=None,
                      device=None) -> precision.Precision:
    """The precision `load_model` loads `model` at, found without loading its weights: from the
    name alone, or for `auto` from a folder's config or a GGUF file's tensor types (its described
    copy, written to the user cache on first use). Refuses an unknown precision or one the
    device cannot run."""
    name = precision.parse(precision_name)
    torch_device = resolve_device(device)
    precision.check(name, torch_device)
    if name != "auto":
        return precision.resolve(name, torch_device)
    if _is_gguf(model):
        from .tensor_directory import TensorDirectory

        return precision.resolve(name, torch_device, gguf_types=TensorDirectory.load(_described(model)).types())
    folder, kwargs = locate(str(model))
    return precision.resolve(name, torch_device, folder_dtype=_folder_dtype(folder, kwargs))


def _is_gguf(model) -> bool:
    return model is None or str(model).lower().endswith(".gguf")


def _gguf_path(model) -> Path:
    """A GGUF model's file (None: the embedded one's), whose copies `gguf_copy` finds."""
    return embedded_gguf() if model is None else gguf_file(str(model))


def _described(model) -> Path:
    """The described copy (config, tokenizer, tensor directory) of a GGUF model (None: the embedded one)."""
    return gguf_copy(_gguf_path(model), described=True)


def _load_gguf(model, precision_name, device: torch.device) -> Loaded:
    """A GGUF file (None: the embedded model's) at a packed precision, read straight from the
    file (at `auto` each tensor at its own width), or at a float one through its float32 copy.
    Where reading its copies in the cache fails (one cut short by a power cut, or removed by a
    `cache clear` under way), the copies this load found are made again and the load tried once
    more: a copy is the cache's to mend, and what fails after that is the file's. A user's error
    (an unknown precision, say) is raised as it is, and mends nothing."""
    from safetensors import SafetensorError

    precision.check(precision.parse(precision_name), device)  # (a bad name: refused before any read)
    found = cache_copies(_gguf_path(model))  # each with its mark as found (one that is no GGUF file: refused here)
    try:
        return _load_gguf_once(model, precision_name, device)
    except (ModelNotFound, OSError, ValueError, SafetensorError) as err:
        user_error = isinstance(err, MultiDecodeError) and not isinstance(err, ModelNotFound)
        if not user_error and (denied := _cache_refused(err)) is not None:  # the folder's fault: copies are kept
            raise CacheUnwritable(f"cannot use the cache folder {cache_dir()}: {in_one_line(denied)}",
                                  "set MULTIDECODE_CACHE to a folder of your own with room to write") from err
        if user_error or not found:  # nothing of the cache's to mend, or it failed making them
            raise
        reason = in_one_line(err)
    # out of the except block: the first attempt's model is freed before the second loads
    discard_copies(found)
    log.warning("a cache copy of %s did not load (%s): made again", model or "the embedded model", reason)
    return _load_gguf_once(model, precision_name, device)


CACHE_REFUSALS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}
"""Why an OSError says the cache folder cannot be used (permissions, a read-only or full disk),
whatever state its copies are in: making them again would fail the same way, after removing them."""


def _cache_refused(err: BaseException) -> OSError | None:
    """The OSError behind `err` (itself, or what it was raised from) that the folder caused, if any."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in CACHE_REFUSALS:
            return err
        err = err.__cause__
    return None


def _load_gguf_once(model, precision_name, device: torch.device) -> Loaded:
    from .gguf import load_packed
    from .tensor_directory import TensorDirectory

    chosen = resolve_precision(model, precision_name, device)
    keep_widths = precision.parse(precision_name) == "auto"  # each GGUF tensor at its own width
    path = _gguf_path(model)
    source = "embedded" if model is None else str(path)
    if chosen.bits is None:
        loaded = _float_folder(gguf_copy(path), {}, chosen, source)
        described = gguf_copy(path, described=True, convert=False)
    else:
        described = _described(model)
        with quiet_transformers(), loading_errors(model or path):
            tokenizer = described_tokenizer(described)
            lm, formats = load_packed(path, described, bits=None if keep_widths else chosen.bits, dtype=chosen.dtype)
        loaded = Loaded(lm, tokenizer, chosen, formats, source)
    if described is not None:
        loaded.file_tensor_bytes = TensorDirectory.load(described).tensor_bytes()
    return loaded


TOKENIZER_PICKLE = "tokenizer-{transformers}-{tokenizers}.pickle"
"""The described copy's tokenizer as loaded, kept beside it: transformers' `from_pretrained` parses
the tokenizer's JSON in Python (about 0.25 s of a 0.5 s warm load); unpickling takes 0.06 s. The
name carries the versions that wrote it, so another transformers or tokenizers builds it anew."""


def described_tokenizer(described: Path):
    """The tokenizer of a described copy, from its kept pickle when there is a good one (one that
    does not load is rebuilt, never trusted), else read and kept."""
    import pickle

    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    kept = Path(described) / TOKENIZER_PICKLE.format(transformers=transformers.__version__,
                                                     tokenizers=tokenizers.__version__)
    try:
        return pickle.loads(kept.read_bytes())
    except Exception:  # noqa: BLE001 - missing, truncated or from elsewhere: read the copy again
        tokenizer = AutoTokenizer.from_pretrained(described)
    try:
        partial = kept.with_name(f".{kept.name}.{os.getpid()}")
        partial.write_bytes(pickle.dumps(tokenizer))
        os.replace(partial, kept)
    except OSError:  # a read-only cache: read it each time
        pass
    return tokenizer


def _load_folder(model: str, chosen: precision.Precision) -> Loaded:
    """A Hugging Face folder or hub id at its own dtype (auto) or the one asked for, its linear
    weights packed for int8 / int4."""
    folder, kwargs = locate(model)
    loaded = _float_folder(folder, kwargs, chosen, model)
    if chosen.bits is not None:
        loaded.formats = pack_model(loaded.model, chosen.bits, chosen.dtype)
    return loaded


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""Files a Hugging Face folder's tokenizer is read from (one is enough); a folder with none got
transformers' words about installing sentencepiece or tiktoken."""


def _float_folder(folder, kwargs: dict, chosen: precision.Precision, source: str) -> Loaded:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if Path(folder).is_dir() and not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFound(f"{source} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})",
                            "copy the tokenizer's files from the model's original folder beside its config.json")
    with quiet_transformers(), loading_errors(source):
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        lm = from_pretrained(AutoModelForCausalLM, folder, chosen.dtype, kwargs)
    return Loaded(lm, tokenizer, chosen, {}, source)


def _folder_dtype(folder, kwargs: dict) -> torch.dtype | None:
    """The dtype a Hugging Face folder's config names, if any."""
    from transformers import AutoConfig

    with quiet_transformers(), loading_errors(folder):
        config = AutoConfig.from_pretrained(folder, **kwargs)
    dtype = getattr(config, "dtype", None)  # transformers reads an older file's torch_dtype into it
    if isinstance(dtype, str):
        dtype = precision.DTYPES.get(dtype)
    return dtype if isinstance(dtype, torch.dtype) else None


def gguf_file(name: str) -> Path:
    """`name` as a GGUF file's path; `ModelNotFound` where it is a folder, missing, or not GGUF."""
    path = Path(name).expanduser()
    if path.is_dir():
        raise ModelNotFound(f"{path} is a folder, not a .gguf file", "name the .gguf file itself, or a model folder "
                            "without .gguf in its name")
    if not path.is_file():
        raise ModelNotFound(f"no model at {path}: the path does not exist", "check the path")
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ModelNotFound(f"{path} is not a GGUF file (it lacks the GGUF header)", "check the file")
    return path


def locate(name: str) -> tuple[str, dict]:
    """What `from_pretrained` reads for `name`: a model folder (a .gguf file's converted copy) or a
    hub id, and the keyword arguments it needs; `ModelNotFound` where there is nothing to read."""
    refuse_unreadable(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path), {}
    if path.is_file():
        return str(gguf_copy(gguf_file(name))), {}
    return name, _hub_kwargs(name)


def refuse_unreadable(name: str) -> None:
    """`ModelNotFound` where `name` can be seen to hold no model without reading one: empty, a
    folder without config.json, a file that is no GGUF file, a path where nothing is. Cheap enough
    for a command to check before it starts anything (a server, before it listens)."""
    if not str(name).strip():  # Path("") is the working folder
        raise ModelNotFound("the model name is empty",
                            "give a model folder, a .gguf file or a hub id (none: the embedded model)")
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(
                f"{path} holds no config.json, so it is not a Hugging Face model folder",
                "name the folder that holds config.json and the weights (--model on the command line)",
            )
    elif path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(
                f"{path} is a file but not a .gguf model",
                "pass a Hugging Face model folder or a .gguf file",
            )
        gguf_file(name)
    else:
        refuse_missing_path(name)


def refuse_missing_path(name: str) -> None:
    """`ModelNotFound` where `name` is written as a path (not a hub id) and nothing is there: a
    check cheap enough to make before anything loads."""
    path = Path(name).expanduser()
    if path.exists():
        return
    looks_like_path = name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1
    if looks_like_path or os.sep in name and Path(name.split(os.sep)[0]).exists():
        raise ModelNotFound(f"no model at {path}: the path does not exist", "check the path")


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
            "pass a local model folder or .gguf file, or name no model (load(), no --model) for the embedded one",
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
