"""Reading a model with transformers: quietly, with errors a user can act on.

`from_pretrained` asks for sdpa attention and falls back to eager where a model has no sdpa
kernel; `loading_errors` turns what transformers raises for something it cannot read into
`ModelNotFound`; `quiet_transformers` silences its progress bars, logs and warnings (the library
prints nothing). Both `loading` and the GGUF conversion of `converted` read models through here.
"""

from __future__ import annotations

import contextlib
import os
import struct
import warnings
from collections.abc import Callable
from typing import TypeVar

from ..errors import ModelNotFound, MultiDecodeError, UnsupportedModel

T = TypeVar("T")


@contextlib.contextmanager
def quiet_transformers(*, loading: bool = True):
    """transformers says nothing inside the block (the library prints nothing): its logs below
    errors are off and, while `loading`, its progress bars and all of stderr (GGUF de-quantization
    draws its own tqdm bar there). Running a model (`loading=False`: benchmarks, the demo), its
    Python warnings (generation flags, padding hints) are off instead, and stderr is left to the
    caller's own progress."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    level, hub_level = hf_logging.get_verbosity(), hub_logging.get_verbosity()
    if loading:
        hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    try:
        if loading:
            with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
                yield
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
    finally:
        hf_logging.set_verbosity(level)
        hub_logging.set_verbosity(hub_level)
        if loading and bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def loading_errors(model):
    """Turn what transformers raises for a model it cannot read into `ModelNotFound`: a file cut
    short or damaged (safetensors' own error, struct's), a config value of the wrong type
    (huggingface_hub's validation error), a missing one."""
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    try:
        yield
    except MultiDecodeError:
        raise
    except (OSError, ValueError, KeyError, struct.error, EOFError, SafetensorError, StrictDataclassError) as err:
        hint = "pass a local Hugging Face model folder, a .gguf file, or nothing for the embedded model"
        if str(model).lower().endswith(".gguf") or isinstance(err, SafetensorError):  # most often a cut download
            hint = f"{model} may be cut short or damaged (a download that did not finish?): fetch it again; or " + hint
        elif isinstance(err, StrictDataclassError):
            hint = f"fix that value in {model}'s config.json (or fetch the file again)"
        raise ModelNotFound(f"could not load a causal language model from {model}: {in_one_line(err)}", hint) from err


def sdpa_or_eager(build: Callable[[str], T]) -> T:
    """`build(attn_implementation)` with sdpa, or with eager where the model's class has no sdpa
    (recurrent layers, say: the vetting then says why such a model is refused, not transformers)."""
    try:
        return build("sdpa")
    except ValueError as err:
        if "sdpa" not in str(err).lower() and "scaled_dot_product" not in str(err).lower():
            raise
    return build("eager")


def from_pretrained(auto_class, folder, dtype, kwargs):
    """`auto_class.from_pretrained` with our attention (`sdpa_or_eager`), the folder's config read
    first and passed whole: left to transformers, a config.json's own "_attn_implementation"
    (flash_attention_2, in many published folders) won over the attention asked for, and loading
    failed with flash-attn's ImportError. The weights are the same whatever attention reads them.
    (A GGUF file's config, read through `gguf_file`, names no attention: left to transformers.)"""
    from transformers import AutoConfig

    if "gguf_file" not in kwargs:
        kwargs = {**kwargs, "config": AutoConfig.from_pretrained(folder, **kwargs)}
    try:
        return sdpa_or_eager(lambda attention: auto_class.from_pretrained(folder, dtype=dtype,
                                                                         attn_implementation=attention, **kwargs))
    except ValueError as err:
        if "Unrecognized configuration class" in str(err) or "does not recognize" in str(err):
            raise UnsupportedModel(
                f"{folder} is not a causal language model: {in_one_line(err)}",
                "MultiDecode needs a decoder-only model (AutoModelForCausalLM)",
            ) from err
        raise


def in_one_line(err: BaseException, limit: int = 400) -> str:
    """An error's message on one line for an `error:` line: its lines joined (transformers often
    says what is missing only after a first line ending in a colon), cut at `limit` characters."""
    text = " ".join(str(err).split())
    if not text:
        return type(err).__name__
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."
