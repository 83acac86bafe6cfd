"""Learned draft heads on disk: which target a head was trained for, where it is kept, and its tensors.

A **learned head** is a small network that drafts from the target's own hidden states (Medusa's
heads, `medusa`; an EAGLE-style layer, `eagle`). It is only worth anything on the model it was trained for, so every head
written here carries its target's **fingerprint**: the shape of its config (architecture, layers,
widths, vocabulary) and a **probe**, the sums of a few rows of its input embeddings. The shape
names the folder a head is kept in (`head_dir`: the user cache, `drafters/<shape>/<kind>`, where
`speculate="medusa"` and `"eagle"` look first); the probe tells two models of one shape apart (a fine-tune of
the same base), within the rounding that separates the target's precisions.

Heads published elsewhere come in their own formats (a `config.json` beside a
`*.safetensors` or a `*.pt` state dict); `read_tensors` reads either, and each kind's module
reads its own keys.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .. import data
from ..errors import InvalidArgument
from ..models.packed import weights_device
from ..user_cache import cache_dir
from .drafting import vocabulary_size

SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size")
PROBE_ROWS = 16
"""The probe sums this many embedding rows, spread over the vocabulary."""
PROBE_MATCH = 0.98
"""Two probes name one model when their cosine similarity is at least this (4-bit weights of a
model stay above 0.999 against its float32 ones; unrelated models of one shape fall near 0)."""


def shape_key(model) -> str:
    """The folder name of a target's heads: its model type and a hash of its config's shape."""
    config = model.config
    shape = {key: getattr(config, key, None) for key in SHAPE_KEYS}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    return f"{shape['model_type']}-{digest}"


def probe(model) -> list[float]:
    """A fingerprint of the target's weights: the sums of `PROBE_ROWS` embedding rows."""
    embeddings = model.get_input_embeddings()
    rows = torch.linspace(0, embeddings.num_embeddings - 1, PROBE_ROWS).long()
    with torch.inference_mode():
        return [round(float(v), 5) for v in embeddings(rows[None])[0].float().sum(-1)]


def fingerprint(model) -> dict:
    """What a head records of its target (see the module notes)."""
    return {"shape": shape_key(model), "probe": probe(model),
            "name": str(getattr(model.config, "_name_or_path", "") or "")}


def check_head_fits(model, hidden_size: int, vocab_size: int, recorded: dict | None, kind: str, *,
                    what: str | None = None, fix: str | None = None, token_ids: torch.Tensor | None = None) -> None:
    """Refuse a head of `kind` (named `what`) made for other widths than `model`'s, trained for
    another model, or whose draft vocabulary (`token_ids`, target ids) names an id outside the
    model's; `fix`: what to do instead (default: train one)."""
    what = what or f"the {kind} head"
    hidden, vocab = getattr(model.config.get_text_config(), "hidden_size", None), vocabulary_size(model)
    fix = fix or f"train one for this model: multidecode train-drafter --kind {kind}"
    if hidden != hidden_size or vocab != vocab_size:
        raise InvalidArgument(f"{what} is for hidden size {hidden_size} and a vocabulary of {vocab_size}, "
                              f"the model has {hidden} and {vocab}", fix)
    outside = [] if token_ids is None else token_ids[(token_ids < 0) | (token_ids >= vocab)].tolist()
    if outside:
        raise InvalidArgument(f"{what}'s draft vocabulary names token id {outside[0]}, outside the model's "
                              f"vocabulary of {vocab}", fix)
    check_target(recorded, model, what)


def on_device_of(head: torch.nn.Module, model) -> None:
    """Move a head to the device its target computes on (keeping the head's own dtype)."""
    head.to(weights_device(model))


def causal_mask(config, embeds: torch.Tensor, cache, position_ids: torch.Tensor | None):
    """The mask a head layer run outside a model's own forward needs when an `Engine` feed passes
    none (a plain continuation): causal, or causal within the sliding window of a sliding layer
    (`config.layer_types[0]`), as transformers' masking utilities build them."""
    from transformers import masking_utils

    sliding = (getattr(config, "layer_types", None) or ["full_attention"])[0] == "sliding_attention"
    build = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    return build(config=config, inputs_embeds=embeds, attention_mask=None, cache=cache, position_ids=position_ids)


def load_checked(head: torch.nn.Module, tensors: dict, what: str) -> tuple[list[str], list[str]]:
    """`head.load_state_dict(tensors, strict=False)`, a tensor of the wrong shape refused with a
    message; returns the missing and unexpected keys."""
    try:
        return head.load_state_dict(tensors, strict=False)
    except RuntimeError as error:
        raise InvalidArgument(f"{what} does not match its config ({str(error).splitlines()[-1].strip()})",
                              "point at a head's folder as it was written or published") from None


def check_target(recorded: dict | None, model, what: str) -> None:
    """Refuse a head whose recorded target (`fingerprint`) is not `model`. A head with no record
    (one published elsewhere) is taken on trust, after its shapes were checked."""
    if not recorded:
        return
    other = other_target(recorded, model)
    if other is not None:
        raise InvalidArgument(f"{what} was trained for {other}", "train a head for this model: multidecode "
                                                                 "train-drafter --model M")


def other_target(recorded: dict, model) -> str | None:
    """How the target a `fingerprint` records differs from `model` ("another model (its name), not
    this one (shape)", "a model of this shape with other weights (its name)"), None where it is
    `model` (at any precision: the probes agree within `PROBE_MATCH`)."""
    if recorded.get("shape") != shape_key(model):
        return f"another model ({recorded.get('name') or recorded.get('shape')}), not this one ({shape_key(model)})"
    mine, theirs = torch.tensor(probe(model)), torch.tensor(recorded.get("probe", []), dtype=torch.float32)
    if theirs.shape != mine.shape or float(torch.cosine_similarity(mine, theirs, dim=0)) < PROBE_MATCH:
        return f"a model of this shape with other weights ({recorded.get('name') or 'unnamed'})"
    return None


def head_dir(model, kind: str) -> Path:
    """Where the head of `kind` trained for `model` is kept: the user cache's drafters/<shape>/<kind>."""
    return cache_dir() / "drafters" / shape_key(model) / kind


def shipped_head_dir(model, kind: str) -> Path:
    """Where the package keeps a head of `kind` for `model`, if it ships one (the embedded model's)."""
    return data.folder() / "drafters" / shape_key(model) / kind


def read_config(folder: Path, what: str) -> dict:
    """A head folder's config.json, refused with a message when missing or not JSON."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument(f"{what}: no config.json in {folder}",
                              "point at the folder that holds the head's config.json and weights") from None
    except json.JSONDecodeError as err:
        raise InvalidArgument(f"{what}: {path} is not JSON ({err})", "rewrite or replace the file") from None
    if not isinstance(config, dict):  # `[]` read as a head's settings failed with "list indices must be integers"
        raise InvalidArgument(f"{what}: {path} holds a JSON {type(config).__name__}, not an object of settings",
                              "rewrite or replace the file")
    return config


def read_tensors(folder: Path, stem: str, what: str) -> dict[str, torch.Tensor]:
    """The tensors of `<stem>.safetensors` (or `<stem>.pt`, a torch state dict) in `folder`."""
    return read_state_dict(folder, (f"{stem}.safetensors", f"{stem}.pt"), what)


def read_state_dict(folder: Path, names: tuple[str, ...], what: str) -> dict[str, torch.Tensor]:
    """The tensors of the first of the files `names` (safetensors, or a pickled torch state dict)
    that `folder` holds."""
    folder = Path(folder)
    for path in (folder / name for name in names):
        if path.exists():
            state = _load(path, what)
            if not isinstance(state, dict):
                raise InvalidArgument(f"{what}: {path} holds a {type(state).__name__}, not a state dict",
                                      "save the head's state_dict()")
            return state
    raise InvalidArgument(f"{what}: none of {', '.join(names)} in {folder}",
                          "point at the folder that holds the head's config.json and weights")


def _load(path: Path, what: str):
    """A weights file's tensors, refused with a message when it cannot be read (cut short, say)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the user's to replace
        raise InvalidArgument(f"{what}: cannot read {path} ({type(err).__name__}: {err})",
                              "the file is damaged or not a weights file: write or download it again") from None


def write_head(folder: Path, stem: str, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write a head (config.json and `<stem>.safetensors`) into `folder`, each file whole or not at all."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / f"{stem}.safetensors"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(weights.with_suffix(".tmp")))
    weights.with_suffix(".tmp").replace(weights)
    tmp = folder / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    tmp.replace(folder / "config.json")
    return folder
