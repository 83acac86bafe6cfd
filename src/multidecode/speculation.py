"""How a run speculates: which proposer drafts, and how many draft tokens a step may feed.

`speculate=` on every decoding entry point takes:

- None (or False): no speculation, one token per branch per step;
- "lookup": prompt lookup (`proposers.lookup`), up to `DEFAULT_BUDGET` draft nodes per branch
  per step, all fed;
- "suffix": drafts from everything this process saw before (`proposers.suffix`);
- "lookahead": lookahead decoding's Jacobi window and n-gram pool (`proposers.lookahead`), at
  the paper's settings (N=5, W=G=7) unless given a `Lookahead` of other settings;
- "draft": a draft model (`proposers.draft`; the `draft=` argument: a model sharing the target's
  tokenizer, or a self-draft of the target, see `self_draft`);
- "medusa", "eagle": a learned head on the target's last hidden state (`proposers.medusa`, Medusa
  heads; `proposers.eagle`, an EAGLE-style decoder layer): the head `head=` names (a folder), else
  the one trained for this model by `multidecode train-drafter` (kept in the user cache), else
  the one shipped for the embedded model;
- "mtp": the multi-token-prediction layer that ships in the model's own checkpoint
  (`proposers.mtp`: DeepSeek-V3, GLM-4.5, Mellum style), read from the files the model was
  loaded from;
- "auto": prompt lookup and the suffix store merged into one tree (`proposers.mixture`), with
  the draft nodes of each step chosen by the measured cost of a forward on this hardware and the
  acceptance each source has had so far (`cost`), so that it speculates only where that pays,
  and not at all where it does not;
- a `Proposer`: that proposer, at the default budget;
- a `Speculation`: all of it spelled out;
- a `SpeculationSettings`: a mode by name with its details (a draft budget, lookahead's W,N,G, a
  draft model by name or a self-draft's skipped layers), as the command line, the server and the
  batch job take them: parsed and checked before any model loads (`SpeculationSettings.parse`),
  built into a `Speculation` once the target is loaded (`resolve`, with the draft model that
  `load_draft` made).

This module alone says what a `speculate=` value means; the CLI, the server's protocol, the batch
job and the benchmarks all go through it.

Speculation never changes what is generated: greedy output equals plain greedy decoding and a
seeded sampled run equals the same run without speculation (see `verify`). That holds wherever
the forest is exact: at every precision with the batch-invariant kernels (`exact`, the default
of `load`), and in float32 with the model's own attention. With the model's own attention in
bfloat16 or float16 a masked forward takes other kernels and near-ties can break differently,
so explicit speculation is refused there and "auto" does not speculate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from . import data
from .errors import InvalidArgument, check_positive, is_int
from .models.loading import load_model_and_tokenizer
from .proposers.base import Proposer
from .proposers.draft import DraftModel, check_same_tokenizer
from .proposers.eagle import Eagle, EagleHead
from .proposers.eagle3 import Eagle3Head
from .proposers.heads import head_dir, shape_key, shipped_head_dir
from .proposers.lookahead import Lookahead
from .proposers.lookup import PromptLookup
from .proposers.medusa import Medusa, MedusaHeads
from .proposers.mixture import Mixture
from .proposers.mtp import Mtp, MtpHead
from .proposers.self_draft import choose_skip, self_draft
from .proposers.suffix import SuffixProposer

DEFAULT_BUDGET = 8
"""Draft nodes per branch per step for a fixed-budget mode ("lookup", or a proposer object)."""

AUTO_MAX_DRAFT = 16
"""In "auto", the most draft nodes a branch proposes per step (the cost model keeps fewer)."""

MODES = ("lookup", "suffix", "lookahead", "draft", "medusa", "eagle", "mtp", "auto")
LEARNED = {"medusa": ((MedusaHeads,), Medusa), "eagle": ((EagleHead, Eagle3Head), Eagle), "mtp": ((MtpHead,), Mtp)}
"""The modes that draft with a learned head: its head classes (the first one's `load` reads each
layout, found by `load_heads`) and its proposer's class."""
SHIPPED_WITH_MODEL = ("mtp",)
"""The learned kinds whose head comes in the model's own checkpoint, not from a folder of its own."""
OFF = ("off", "none")
"""Names that mean no speculation, beside None."""
EXACT_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Speculation:
    """A proposer and its budget.

    budget: draft nodes per branch per step, all fed; None lets the cost model choose each step
        among up to `max_draft` proposed nodes per branch ("auto").
    """

    proposer: Proposer
    budget: int | None = DEFAULT_BUDGET
    max_draft: int = AUTO_MAX_DRAFT

    def __post_init__(self) -> None:
        if not isinstance(self.proposer, Proposer):
            raise InvalidArgument(f"a Speculation needs a Proposer, got {type(self.proposer).__name__}",
                                  "use multidecode.proposers.lookup.PromptLookup() or a subclass of Proposer")
        if self.budget is not None:
            check_positive("the draft budget", self.budget)
        check_positive("max_draft", self.max_draft)

    @property
    def auto(self) -> bool:
        return self.budget is None

    @property
    def name(self) -> str:
        return "auto" if self.auto else self.proposer.name

    @property
    def size(self) -> int:
        """The most draft nodes a branch proposes in one step."""
        return self.max_draft if self.budget is None else self.budget


def resolve(speculate, dtype: torch.dtype, *, budget: int | None = None, draft=None,
            exact: bool = False) -> Speculation | None:
    """`speculate` (see the module notes) as a `Speculation`, or None for none.

    budget: overrides the draft budget of a named mode or proposer (for "auto", the most nodes a
    branch may propose). draft: the draft model (or `DraftModel` proposer) of "draft", the
    head of "medusa" or "eagle" (`MedusaHeads`, `EagleHead`), and for "auto" a list of learned
    heads it then drafts with too, where they pay. exact:
    whether the model's forwards are batch-invariant (`multidecode.exact`): then speculation is
    exact in every dtype. Raises `InvalidArgument` for an unknown mode, a bad budget, "draft"
    without a draft model, or explicit speculation in a dtype where it cannot be exact.
    """
    if budget is not None:
        check_positive("the draft budget", budget)
    if speculate is None or speculate is False:
        return None
    if isinstance(speculate, SpeculationSettings):
        return speculate.build(dtype, draft=draft, exact=exact)
    if isinstance(speculate, str):
        speculate = speculate.strip().lower()
        if speculate in OFF:
            return None
    if isinstance(speculate, Speculation):
        spec = speculate
    elif isinstance(speculate, Proposer):
        spec = Speculation(speculate, budget or speculate.default_budget or DEFAULT_BUDGET)
    elif speculate == "auto":  # with the learned heads `draft` lists among its members
        heads = draft if isinstance(draft, (list, tuple)) else ()
        spec = Speculation(auto_proposer(heads=heads), None, budget or AUTO_MAX_DRAFT)
    else:
        proposer = named_proposer(speculate, draft)
        spec = Speculation(proposer, budget or proposer.default_budget or DEFAULT_BUDGET)
    if exact or dtype in EXACT_DTYPES:
        return spec
    if spec.auto:
        return None  # "auto" does not speculate where it cannot be exact
    raise inexact(spec.name, dtype)


def inexact(name: str, dtype: torch.dtype) -> InvalidArgument:
    """The error for explicit speculation (`name`) in a dtype where it cannot be exact."""
    return InvalidArgument(
        f"speculation ({name}) cannot be exact in {str(dtype).removeprefix('torch.')}: masked forwards take "
        "other kernels there, so near-ties may break differently than in plain decoding",
        "load the model with exact attention (the default of `load`), in float32, or use speculate='auto' "
    "(which then does not speculate)")


def named_proposer(mode: str, draft=None) -> Proposer:
    """A fresh proposer for a named mode (`draft`: the draft model of "draft")."""
    mode = mode.strip().lower() if isinstance(mode, str) else mode
    if mode == "lookup":
        return PromptLookup()
    if mode == "suffix":
        return SuffixProposer()
    if mode == "lookahead":
        return Lookahead()
    if mode == "draft":
        if draft is None:
            raise InvalidArgument("speculate='draft' needs a draft model",
                                  "pass draft= (a model with the target's tokenizer, or self_draft(model, layers)); "
                                  "on the command line, --draft-model PATH or --draft-skip-layers")
        return draft if isinstance(draft, DraftModel) else DraftModel(draft)
    if mode in LEARNED:
        head_classes, proposer_class = LEARNED[mode]
        if isinstance(draft, proposer_class):
            return draft
        if draft is None and mode in SHIPPED_WITH_MODEL:
            return proposer_class()  # reads its head from the target's checkpoint when the run starts
        if not isinstance(draft, head_classes) and mode in SHIPPED_WITH_MODEL:
            raise InvalidArgument(f"speculate={mode!r} drafts with the model's own {mode} layer",
                                  f"pass draft={head_classes[0].__name__}.of(model), or none to read it from the "
                                  "model's checkpoint")
        if not isinstance(draft, head_classes):
            raise InvalidArgument(f"speculate={mode!r} needs a {mode} head",
                                  f"pass draft={head_classes[0].__name__}.load(folder), or train one for the model: "
                                  f"multidecode train-drafter --kind {mode}")
        return proposer_class(draft)
    raise InvalidArgument(f"unknown speculation mode {mode!r}", f"use one of {', '.join(MODES)}, a Proposer, or None")


def auto_proposer(store=None, heads: Sequence = ()) -> Mixture:
    """What "auto" drafts with: prompt lookup and the suffix store (`store`, default the shared
    one), lookahead where the hardware makes its window nearly free (`Mixture.fit`, done when a
    run starts and the cost curve is known), and the learned `heads` the model has, as fallbacks
    for the branches the others have no guess for. The cost model keeps the nodes of each that
    pay, by the acceptance each has had."""
    return Mixture([PromptLookup(), SuffixProposer(store=store)], name="auto", lookahead=True,
                   fallbacks=[named_proposer(learned_kind(h), h) for h in heads])


def learned_kind(head) -> str:
    """The mode name of a learned head ("medusa", "eagle", "mtp")."""
    return next(kind for kind, (head_classes, _) in LEARNED.items() if isinstance(head, head_classes))


# ---------------------------------------------------------------------- settings by name
@dataclass(frozen=True)
class Spelling:
    """How error messages name the settings: as Python arguments or as command-line options."""

    mode: str = "speculate={!r}"
    current: str = "speculate is {!r}"
    budget: str = "draft_budget"
    lookahead: str = "lookahead"
    draft_model: str = "draft_model"
    skip_layers: str = "draft_skip_layers"
    head: str = "draft_head"

    def setting(self, mode: str) -> str:
        """How to write the mode setting `mode`: speculate='lookup', --speculate lookup."""
        return self.mode.format(mode)

    def is_set(self, mode: str | None) -> str:
        """How to say the mode is `mode`: speculate is 'lookup', --speculate is lookup."""
        return self.current.format("off" if mode is None else mode)


PYTHON = Spelling()


@dataclass(frozen=True)
class SpeculationSettings:
    """A speculation mode by name and its details, as a user writes them (see the module notes).

    mode: one of `MODES`, or None for no speculation. budget: draft nodes per branch per step (for
    "auto", the most a branch may propose). lookahead: (window, n-gram size, guesses) for
    "lookahead". draft_model: a model name (as `load` takes it) to draft with; skip_layers: draft
    with the target itself, these layers skipped, or "auto" to choose them by measured
    acceptance. Either one implies mode "draft"; with neither, "draft" uses the caller's draft
    model (`MultiDecoder(draft=...)`). head: the folder of a learned head ("medusa"; implies it);
    without it the head is looked up for the model (`load_heads`).
    """

    mode: str | None = None
    budget: int | None = None
    lookahead: tuple[int, int, int] | None = None
    draft_model: str | None = None
    skip_layers: tuple[int, ...] | str | None = None
    head: str | None = None

    @classmethod
    def parse(cls, mode: str | None = None, *, budget: int | None = None, lookahead: str | Sequence[int] | None = None,
              draft_model: str | None = None, skip_layers: str | Sequence[int] | None = None,
              head: str | None = None, spelling: Spelling = PYTHON) -> SpeculationSettings:
        """Settings from what a user wrote, checked: an unknown mode, a bad budget, lookahead
        settings or layer list, or details that need another mode raise `InvalidArgument`,
        naming each setting as `spelling` does (Python arguments by default)."""
        mode = None if mode is None else str(mode).strip().lower()
        mode = None if mode in OFF else mode
        if mode is not None and mode not in MODES:
            raise InvalidArgument(f"unknown speculation mode {mode!r}", f"use one of {', '.join(MODES)}, or off")
        if draft_model is not None and skip_layers is not None:
            raise InvalidArgument(f"{spelling.draft_model} and {spelling.skip_layers} both name a draft",
                                  "keep one: a second model, or the target with layers skipped")
        drafting = draft_model is not None or skip_layers is not None
        if drafting and mode in (None, "auto"):
            mode = "draft"
        if head is not None and mode in (None, "auto"):
            mode = "medusa"
        if head is not None and (mode not in LEARNED or mode in SHIPPED_WITH_MODEL):
            raise InvalidArgument(f"{spelling.head} names a learned head, but {spelling.is_set(mode)}"
                                  + (" (whose layers come in the model's own checkpoint)" if mode in LEARNED else ""),
                                  f"use {spelling.setting('medusa')} or {spelling.setting('eagle')}")
        if budget is not None:
            check_positive("the draft budget", budget)
        if mode is None:
            given = spelling.budget if budget is not None else spelling.lookahead if lookahead is not None else None
            if given:
                raise InvalidArgument(f"{given} needs speculation, and {spelling.is_set(None)}",
                                      f"add {spelling.setting('lookup')}, {spelling.setting('lookahead')} or "
                                      f"{spelling.setting('auto')}")
            return cls()
        if drafting and mode != "draft":
            raise InvalidArgument(f"a draft model was given but {spelling.is_set(mode)}",
                                  f"use {spelling.setting('draft')}")
        if lookahead is not None and mode != "lookahead":
            raise InvalidArgument(f"{spelling.lookahead} sets lookahead decoding, but {spelling.is_set(mode)}",
                                  f"add {spelling.setting('lookahead')}")
        return cls(mode, budget, None if lookahead is None else lookahead_settings(lookahead, spelling),
                   draft_model, None if skip_layers is None else skip_layer_list(skip_layers, spelling),
                   None if head is None else str(head))

    @property
    def off(self) -> bool:
        return self.mode is None

    @property
    def own_draft(self) -> bool:
        """Whether these settings name their own draft (a model to load, or a self-draft)."""
        return self.draft_model is not None or self.skip_layers is not None

    def with_mode(self, mode: str | None) -> SpeculationSettings:
        """The details that apply under another mode (a server request picking a mode of its own)."""
        mode = None if mode is None else str(mode).strip().lower()
        if mode is None or mode in OFF:
            return SpeculationSettings()
        return SpeculationSettings.parse(mode, budget=self.budget,
                                         lookahead=self.lookahead if mode == "lookahead" else None,
                                         draft_model=self.draft_model if mode == "draft" else None,
                                         skip_layers=self.skip_layers if mode == "draft" else None,
                                         head=self.head if mode in LEARNED and mode not in SHIPPED_WITH_MODEL
                                         else None)

    def check(self, dtype: torch.dtype | None = None, *, draft=None, exact: bool = False,
              spelling: Spelling = PYTHON) -> None:
        """Refuse, before anything loads, what cannot run: explicit speculation in a dtype where
        it cannot be exact (unless the model's forwards are `exact`; no dtype: not known yet),
        and "draft" without a draft model."""
        if self.mode == "draft" and not self.own_draft and draft is None:
            raise InvalidArgument(f"{spelling.setting('draft')} needs a draft model",
                                  f"add {spelling.draft_model}, or {spelling.skip_layers} auto to draft with the "
                                  "model itself")
        if self.mode not in (None, "auto") and dtype is not None and dtype not in EXACT_DTYPES and not exact:
            raise inexact(self.mode, dtype)

    def build(self, dtype: torch.dtype, *, draft=None, exact: bool = False) -> Speculation | None:
        """A `Speculation` with a fresh proposer (see `resolve`); draft: the draft model for
        "draft" (from `load_draft` where these settings name their own)."""
        if self.mode is None:
            return None
        if self.mode == "lookahead" and self.lookahead is not None:
            window, ngram, guesses = self.lookahead
            return resolve(Lookahead(window=window, ngram=ngram, guesses=guesses), dtype, budget=self.budget,
                           exact=exact)
        return resolve(self.mode, dtype, budget=self.budget, draft=draft, exact=exact)


def load_draft(settings: SpeculationSettings, model, tokenizer):
    """The draft model `settings` name, made for the target `model`: the model `draft_model`
    names, loaded in the target's dtype and on its device (its tokenizer must be the target's),
    or the target with `skip_layers` skipped (sharing its weights; "auto" chooses them first,
    see `choose_draft_layers`)."""
    if settings.draft_model is not None:
        device = next(model.parameters()).device
        draft, draft_tokenizer = load_model_and_tokenizer(settings.draft_model, precision=model.dtype, device=device,
                                                          exact=False)
        check_same_tokenizer(tokenizer, draft_tokenizer)
        return draft
    return self_draft(model, list(choose_draft_layers(settings, model, tokenizer).skip_layers))


def load_heads(settings: SpeculationSettings, model):
    """The learned heads of `settings` for `model`, checked against it: from the folder
    `settings.head`, else the user cache (`heads.head_dir`, where `multidecode train-drafter`
    writes), else the heads shipped in the package for the embedded model; an MTP layer from the
    model's own checkpoint. Raises `InvalidArgument` when there are none, naming the command that
    trains them."""
    kind = settings.mode
    head_class = LEARNED[kind][0][0]
    if kind in SHIPPED_WITH_MODEL:
        return head_class.of(model)
    if settings.head is not None:
        return head_class.load(settings.head).bind(model)
    for folder in (head_dir(model, kind), shipped_head_dir(model, kind)):
        if (folder / "config.json").exists():
            return head_class.load(folder).bind(model)
    raise InvalidArgument(f"no {kind} head was trained for this model ({shape_key(model)})",
                          f"train one: multidecode train-drafter --model M --kind {kind} "
                          "(or name a head's folder with --draft-head)")


def choose_draft_layers(settings: SpeculationSettings, model, tokenizer, *, sample_ids=None) -> SpeculationSettings:
    """`settings` with skip_layers "auto" replaced by the layers chosen for `model`, by the
    agreement measured on `sample_ids` (default: the shipped sample of prose and code); other
    settings come back as they are. Raises `InvalidArgument` where no set of layers pays."""
    if settings.skip_layers != "auto":
        return settings
    sample = sample_ids if sample_ids is not None else [tokenizer(data.self_draft_sample())["input_ids"]]
    layers = tuple(choose_skip(model, sample).layers)
    if not layers:
        raise InvalidArgument(
            "no set of skipped layers is expected to pay on this model: a self-draft agrees with it too "
            "rarely for what it saves", "name the layers yourself (e.g. 10-14), or speculate with 'auto'")
    return replace(settings, skip_layers=layers)


def lookahead_settings(value: str | Sequence[int], spelling: Spelling = PYTHON) -> tuple[int, int, int]:
    """'W,N,G' (or three ints) as (window >= 1, n-gram size >= 2, guesses >= 0)."""
    try:
        parts = value.split(",") if isinstance(value, str) else list(value)
        window, ngram, guesses = (int(part) for part in parts)
    except (ValueError, TypeError):
        raise InvalidArgument(f"{spelling.lookahead} {value!r} is not three integers W,N,G",
                              f"write e.g. {spelling.lookahead} 7,5,7") from None
    if window < 1 or ngram < 2 or guesses < 0:
        raise InvalidArgument(f"{spelling.lookahead} {value}: need W >= 1, N >= 2 and G >= 0",
                              f"write e.g. {spelling.lookahead} 7,5,7")
    return window, ngram, guesses


def skip_layer_list(value: str | Sequence[int], spelling: Spelling = PYTHON) -> tuple[int, ...] | str:
    """'4,6,8-12' (or a list of ints) as (4, 6, 8, 9, 10, 11, 12); "auto" stays "auto"."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if not isinstance(value, str):
        if all(is_int(v) for v in value):
            return tuple(int(v) for v in value)
        value = ",".join(map(str, value))
    layers: list[int] = []
    try:
        for part in value.split(","):
            first, _, last = part.strip().partition("-")
            layers += range(int(first), int(last or first) + 1)
    except ValueError:
        raise InvalidArgument(f"{spelling.skip_layers} {value!r} is not a list of layer numbers",
                              f"write e.g. {spelling.skip_layers} 4,6,8-12, or auto") from None
    return tuple(layers)

