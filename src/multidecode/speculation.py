"""How a run speculates: which proposer drafts, and how many draft tokens a step may feed.

`speculate=` on every decoding entry point takes:

- None (or False, "off", "none"): no speculation, one token per branch per step;
- a mode by name: one row of `PROPOSERS`, the table of the proposers a name stands for (their
  class, how a run builds one, their learned heads, their line of --speculate's help). Named
  modes run at their proposer's default budget (`Proposer.default_budget`, else `DEFAULT_BUDGET`
  draft nodes per branch per step, all fed):
  "lookup" (prompt lookup, `proposers.lookup`), "suffix" (everything this process saw before,
  `proposers.suffix`), "lookahead" (the Jacobi window and n-gram pool, `proposers.lookahead`, at
  the paper's settings unless given a `Lookahead` of other settings), "draft" (a draft model,
  `proposers.draft`: the `draft=` argument, a model sharing the target's tokenizer or a self-draft
  of the target, see `self_draft`), the learned heads "medusa" and "eagle" (on the target's
  hidden states: the head `head=` names, else the one `multidecode train-drafter` trained for
  this model, else the one shipped for the embedded model, see `load_heads`), "mtp" (the
  multi-token-prediction layer in the model's own checkpoint), and "auto": prompt lookup and the
  suffix store merged into one tree (`proposers.mixture`), with the draft nodes of each step
  chosen by the measured cost of a forward on this hardware and the acceptance each source has
  had so far (`cost`), so that it speculates only where that pays, and not at all where it does not;
- a `Proposer`: that proposer, at the default budget;
- a `Speculation`: all of it spelled out;
- a `SpeculationSettings`: a mode by name with its details (a draft budget, lookahead's W,N,G, a
  draft model by name or a self-draft's skipped layers), as the command line, the server and the
  batch job take them: parsed and checked before any model loads (`SpeculationSettings.parse`),
  built into a `Speculation` once the target is loaded (`build_speculation`, with the draft
  model that `load_draft` made).

This module alone says what a `speculate=` value means; the CLI, the server's protocol, the batch
job and the benchmarks all go through it, and every mode given by name is read by one function,
`speculation_mode`.

Speculation never changes what is generated: greedy output equals plain greedy decoding and a
seeded sampled run equals the same run without speculation (see `verify`). That holds wherever
the forest is exact: at every precision with the batch-invariant kernels (`exact`, the default
of `load`), and in float32 with the model's own attention. With the model's own attention in
bfloat16 or float16 a masked forward takes other kernels and near-ties can break differently,
so explicit speculation is refused there and "auto" does not speculate.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import data
from .errors import InvalidArgument, check_positive, is_int
from .models.loading import load_model_and_tokenizer
from .models.packed import weights_device
from .proposers.base import Proposer
from .proposers.draft import DraftModel, check_same_tokenizer
from .proposers.eagle import Eagle, EagleHead
from .proposers.eagle3 import Eagle3Head
from .proposers.heads import head_dir, shape_key, shipped_head_dir
from .proposers.lookahead import Lookahead, window_problem
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
MAX_LOOKAHEAD_NODES = 1 << 16
"""The most tokens a lookahead step may feed per branch ((W + G) x (N - 1)): its window is built
before the memory check, and a larger one only stalls the run."""

OFF = ("off", "none")
"""Names that mean no speculation, beside None."""
EXACT_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Speculation:
    """A proposer and its budget.

    budget: draft nodes per branch per step, all fed; None lets the cost model choose each step
        among up to `max_draft` proposed nodes per branch ("auto").
    against_q: where a proposer drew its candidates from a distribution q (a draft model or a
        learned head sampling), verify a sampled branch by the speculative-sampling rule against q
        (`verify.speculative_sample`): it accepts more often, and its tokens follow the model's
        distribution, but it spends random draws on the candidates, so a seeded branch's tokens
        then differ from the run without speculation and depend on the drafts its neighbours
        shaped. False (the default): draw, then match, as for every other draft: a seeded branch
        gives the same tokens with or without speculation, whatever shares its forward.
    """

    proposer: Proposer
    budget: int | None = DEFAULT_BUDGET
    max_draft: int = AUTO_MAX_DRAFT
    against_q: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.proposer, Proposer):
            raise InvalidArgument(f"a Speculation needs a Proposer, got {type(self.proposer).__name__}",
                                  "use multidecode.proposers.lookup.PromptLookup() or a subclass of Proposer")
        kind = type(self.proposer)
        if kind.propose is Proposer.propose and kind.propose_many is Proposer.propose_many:
            raise InvalidArgument(f"the proposer {kind.__name__} defines no propose method",
                                  "a Proposer subclass defines propose(context, budget) -> DraftTree")
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


# ---------------------------------------------------------------------- the proposers by name
@dataclass(frozen=True)
class ProposerMode:
    """One row of `PROPOSERS`: a speculation mode by name and the proposer it stands for.

    name: the mode, as `speculate=` and `--speculate` take it. proposer: its class. summary: a few
    words on it for --speculate's help. make: how a run builds one from `draft=`, where calling the
    class is not enough (a learned mode needs none: it builds its proposer on its head). heads: a
    learned mode's head classes (the first one's `load` reads a head's folder; `of` reads it from
    the model's checkpoint). shipped_with_model: its head comes in the model's own checkpoint, not
    in a folder of its own. takes_draft: besides a learned head, it drafts with what `draft=`
    carries (the decoder's draft model for "draft", the learned heads found for the model for "auto").
    needs_draft: it cannot run without a draft model (one its settings name, or the decoder's).
    """

    name: str
    proposer: type[Proposer]
    summary: str
    make: Callable[[object], Proposer] | None = None
    heads: tuple[type, ...] = ()
    shipped_with_model: bool = False
    takes_draft: bool = False
    needs_draft: bool = False

    @property
    def learned(self) -> bool:
        """Whether it drafts with a learned head."""
        return bool(self.heads)

    @property
    def drafts_with_decoder(self) -> bool:
        """Whether a `MultiDecoder` supplies what it drafts with (a draft model, learned heads)."""
        return self.takes_draft or self.learned

    def build(self, draft=None) -> Proposer:
        """A fresh proposer of this mode; draft: what it drafts with (see `build_speculation`)."""
        if self.make is not None:
            return self.make(draft)
        if self.learned:
            return learned_proposer(self, draft)
        return self.proposer()


def draft_model_proposer(draft) -> DraftModel:
    """"draft"'s proposer: `draft` (a model with the target's tokenizer, a self-draft, or a `DraftModel`)."""
    if draft is None:
        raise InvalidArgument("speculate='draft' needs a draft model",
                              "give MultiDecoder(..., draft=...) a model with the target's tokenizer, or "
                              "self_draft(model, layers); to decode, pass speculate=DraftModel(that model); "
                              "on the command line, --draft-model PATH or --draft-skip-layers")
    return draft if isinstance(draft, DraftModel) else DraftModel(draft)


def learned_proposer(mode: ProposerMode, draft) -> Proposer:
    """A learned mode's proposer on the head `draft` (or `draft` itself, that proposer already
    built); a mode whose head ships with the model reads it from the target's checkpoint when
    the run starts if `draft` is None."""
    if isinstance(draft, mode.proposer):
        return draft
    if draft is None and mode.shipped_with_model:
        return mode.proposer()
    if not isinstance(draft, mode.heads) and mode.shipped_with_model:
        raise InvalidArgument(f"speculate={mode.name!r} drafts with the model's own {mode.name} layer",
                              f"pass speculate={mode.proposer.__name__}({mode.heads[0].__name__}.of(model)) (both from "
                              f"{mode.proposer.__module__}), or speculate={mode.name!r} alone to read it from the "
                              "model's checkpoint")
    if not isinstance(draft, mode.heads):
        raise InvalidArgument(f"speculate={mode.name!r} needs a {mode.name} head",
                              f"train one for the model (multidecode train-drafter --kind {mode.name}), which a "
                              f"MultiDecoder then finds; to decode, pass speculate={mode.proposer.__name__}"
                              f"({mode.heads[0].__name__}.load(folder)), both from {mode.proposer.__module__}")
    return mode.proposer(draft)


def auto_with_heads(draft) -> Mixture:
    """"auto"'s proposer, drafting too with the learned heads `draft` lists (if it is a list)."""
    return auto_proposer(heads=draft if isinstance(draft, (list, tuple)) else ())


PROPOSERS = (
    ProposerMode("lookup", PromptLookup, "prompt lookup"),
    ProposerMode("suffix", SuffixProposer, "what this process saw before"),
    ProposerMode("lookahead", Lookahead, "Jacobi window"),
    ProposerMode("draft", DraftModel, "a draft model", make=draft_model_proposer, takes_draft=True,
                 needs_draft=True),
    ProposerMode("medusa", Medusa, "Medusa heads trained by train-drafter", heads=(MedusaHeads,)),
    ProposerMode("eagle", Eagle, "an EAGLE head trained by train-drafter", heads=(EagleHead, Eagle3Head)),
    ProposerMode("mtp", Mtp, "the multi-token-prediction layer in the model's checkpoint", heads=(MtpHead,),
                 shipped_with_model=True),
    ProposerMode("auto", Mixture, "lookup, suffix and any learned heads, only where the measured cost says it pays",
                 make=auto_with_heads, takes_draft=True),
)
"""Every speculation mode by name: a new proposer is a module in `proposers/` and a row here."""
PROPOSER_MODES = {mode.name: mode for mode in PROPOSERS}
MODES = tuple(PROPOSER_MODES)
LEARNED = tuple(mode.name for mode in PROPOSERS if mode.learned)
"""The modes that draft with a learned head."""
SHIPPED_WITH_MODEL = tuple(mode.name for mode in PROPOSERS if mode.shipped_with_model)
"""The learned modes whose head comes in the model's own checkpoint, not from a folder of its own."""
FOLDER_HEADS = tuple(name for name in LEARNED if name not in SHIPPED_WITH_MODEL)
"""The learned modes whose head is a folder of its own (`--draft-head`, what train-drafter writes)."""


def folder_mode(folder: str | Path, unread: str | None = FOLDER_HEADS[0]) -> str | None:
    """The learned mode a head's folder is for: the first of `FOLDER_HEADS` whose head class
    `reads` its config.json. A folder without a readable config (or one that is not a JSON object)
    is `unread`'s: by default the first such mode's, whose loading then says what is wrong."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return unread
    if not isinstance(config, dict):
        return unread
    return next((name for name in FOLDER_HEADS if PROPOSER_MODES[name].heads[0].reads(config)), unread)
MODES_HELP = ", ".join(f"{mode.name} ({mode.summary})" for mode in PROPOSERS) + " or off"
"""The modes as the command line's --speculate help lists them."""


def speculation_mode(value) -> str | None:
    """A mode a user wrote (`speculate=`, --speculate, a request's "speculate") as its canonical
    name in `MODES`, or None for no speculation (None, False, "off" or "none"; any case, spaces
    around). Raises `InvalidArgument` naming the choices for anything else."""
    if value is None or value is False:
        return None
    if not isinstance(value, str):
        if hasattr(value, "config") and callable(getattr(value, "forward", None)):  # a model: its repr is its layers
            raise InvalidArgument(f"speculate= got a model ({type(value).__name__}), not a mode or a proposer",
                                  "a model drafts as DraftModel(model) (self_draft(model, layers) too), or give it "
                                  "as the decoder's draft=model with speculate='draft'")
        shown = repr(value) if len(repr(value)) <= 80 else f"a {type(value).__name__}"
        raise InvalidArgument(f"speculate={shown} is neither a mode's name nor a proposer",
                              f"use one of {', '.join(MODES)}, off, or a proposer of your own: a subclass of "
                              "multidecode.Proposer (its propose and observe)")
    mode = value.strip().lower()
    if mode in OFF:
        return None
    if mode not in PROPOSER_MODES:
        raise InvalidArgument(f"unknown speculation mode {mode!r}", f"use one of {', '.join(MODES)}, or off")
    return mode


def build_speculation(speculate, dtype: torch.dtype, *, budget: int | None = None, draft=None,
                      exact: bool = False) -> Speculation | None:
    """`speculate` (see the module notes) as a `Speculation` with a fresh proposer, or None for none.

    budget: overrides the draft budget of a named mode or proposer (for "auto", the most nodes a
    branch may propose). draft: what a named mode drafts with: the draft model (or `DraftModel`
    proposer) of "draft", the head of a learned mode (`MedusaHeads`, `EagleHead`, `MtpHead`), and
    for "auto" a list of learned heads it then drafts with too, where they pay. exact: whether
    the model's forwards are batch-invariant (`multidecode.exact`): then speculation is exact in
    every dtype. Raises `InvalidArgument` for an unknown mode, a bad budget, "draft" without a
    draft model, or explicit speculation in a dtype where it cannot be exact.
    """
    if budget is not None:
        check_positive("the draft budget", budget)
    if isinstance(speculate, SpeculationSettings):
        return speculate.build(dtype, draft=draft, exact=exact)
    if isinstance(speculate, Speculation):
        spec = speculate
    elif isinstance(speculate, Proposer):
        spec = Speculation(speculate, budget or speculate.default_budget or DEFAULT_BUDGET)
    elif (mode := speculation_mode(speculate)) is None:
        return None
    elif mode == "auto":
        spec = Speculation(PROPOSER_MODES[mode].build(draft), None, budget or AUTO_MAX_DRAFT)
    else:  # a named mode runs as its proposer given as an object does
        return build_speculation(PROPOSER_MODES[mode].build(draft), dtype, budget=budget, exact=exact)
    if exact or dtype in EXACT_DTYPES:
        return spec
    if spec.auto:
        return None  # "auto" does not speculate where it cannot be exact
    raise inexact(spec.name, dtype)


def inexact(name: str, dtype: torch.dtype, spelling: Spelling | None = None) -> InvalidArgument:
    """The error for explicit speculation (`name`) in a dtype where it cannot be exact, its fix
    worded as `spelling` says (Python's by default)."""
    spelling = spelling or PYTHON
    return InvalidArgument(
        f"speculation ({name}) cannot be exact in {str(dtype).removeprefix('torch.')} (the dtype the model computes "
        "in) on the model's own kernels: masked forwards take other kernels there, so near-ties may break differently "
        "than in plain decoding", f"{spelling.exact_fix}, or use {spelling.setting('auto')} (which then does not "
                                  "speculate)")


def auto_proposer(store=None, heads: Sequence = ()) -> Mixture:
    """What "auto" drafts with: prompt lookup and the suffix store (`store`, default the shared
    one), lookahead where the hardware makes its window nearly free (`Mixture.fit`, done when a
    run starts and the cost curve is known), and the learned `heads` the model has, as fallbacks
    for the branches the others have no guess for. The cost model keeps the nodes of each that
    pay, by the acceptance each has had."""
    return Mixture([PromptLookup(), SuffixProposer(store=store)], name="auto", lookahead=True,
                   fallbacks=[PROPOSER_MODES[learned_kind(head)].build(head) for head in heads])


def learned_kind(head) -> str:
    """The mode name of a learned head ("medusa", "eagle", "mtp")."""
    return next(mode.name for mode in PROPOSERS if isinstance(head, mode.heads))


# ---------------------------------------------------------------------- settings by name
@dataclass(frozen=True)
class Spelling:
    """How error messages name the settings: as Python arguments or as command-line options."""

    mode: str = "speculate={!r}"
    current: str = "speculate is {!r}"
    budget: str = "budget"  # by default as `SpeculationSettings` names its fields
    lookahead: str = "lookahead"
    draft_model: str = "draft_model"
    skip_layers: str = "skip_layers"
    head: str = "head"
    assign: str = "{}={!r}"
    exact_fix: str = "load the model with exact attention (the default of `load`), or in float32"

    def example(self, name: str, value: str) -> str:
        """How to write the setting `name` (one of the fields) at `value`: lookahead='7,5,7', --lookahead 7,5,7."""
        return self.assign.format(name, value)

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
    model (`MultiDecoder(draft=...)`). head: the folder of a learned head (implies its kind,
    one of `FOLDER_HEADS`, read from its config: `folder_mode`); without it the head is looked
    up for the model (`load_heads`).
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
        turned_off = mode is not None and speculation_mode(mode) is None  # "off" said, not left out
        mode = speculation_mode(mode)
        if draft_model is not None and skip_layers is not None:
            raise InvalidArgument(f"{spelling.draft_model} and {spelling.skip_layers} both name a draft",
                                  "keep one: a second model, or the target with layers skipped")
        drafting = draft_model is not None or skip_layers is not None
        if turned_off and (drafting or head is not None):
            given = spelling.head if head is not None else spelling.draft_model if draft_model else spelling.skip_layers
            raise InvalidArgument(f"{given} names a draft, but {spelling.is_set(None)}",
                                  f"drop {given}, or drop the setting that turns speculation off")
        if drafting and mode in (None, "auto"):
            mode = "draft"
        if head is not None and mode in (None, "auto"):
            mode = folder_mode(head)  # the head's own kind: an EAGLE head's folder means "eagle"
        if head is not None and (mode not in LEARNED or mode in SHIPPED_WITH_MODEL):
            raise InvalidArgument(f"{spelling.head} names a learned head, but {spelling.is_set(mode)}"
                                  + (" (whose layers come in the model's own checkpoint)" if mode in LEARNED else ""),
                                  "use " + " or ".join(spelling.setting(name) for name in FOLDER_HEADS))
        if head is not None and (kind := folder_mode(head, unread=None)) not in (None, mode):
            raise InvalidArgument(f"{spelling.head} {head} holds a {kind} head, but {spelling.is_set(mode)}",
                                  f"use {spelling.setting(kind)}, or leave the mode out: the head's folder says its kind")
        if budget is not None:
            check_positive(spelling.budget, budget)
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
    def needs_draft(self) -> bool:
        """Whether the mode cannot run without a draft model (`ProposerMode.needs_draft`)."""
        return self.mode is not None and PROPOSER_MODES[self.mode].needs_draft

    @property
    def own_draft(self) -> bool:
        """Whether these settings name their own draft (a model to load, or a self-draft)."""
        return self.draft_model is not None or self.skip_layers is not None

    def with_mode(self, mode: str | None) -> SpeculationSettings:
        """The details that apply under another mode (a server request picking a mode of its own)."""
        mode = speculation_mode(mode)
        if mode is None:
            return SpeculationSettings()
        drafts = PROPOSER_MODES[mode].needs_draft
        return SpeculationSettings.parse(mode, budget=self.budget,
                                         lookahead=self.lookahead if mode == "lookahead" else None,
                                         draft_model=self.draft_model if drafts else None,
                                         skip_layers=self.skip_layers if drafts else None,
                                         head=self.head if mode in FOLDER_HEADS else None)

    def check(self, dtype: torch.dtype | None = None, *, draft=None, exact: bool = False,
              spelling: Spelling = PYTHON) -> None:
        """Refuse, before anything loads, what cannot run: explicit speculation in a dtype where
        it cannot be exact (unless the model's forwards are `exact`; no dtype: not known yet),
        and "draft" without a draft model."""
        if self.needs_draft and not self.own_draft and draft is None:
            raise InvalidArgument(f"{spelling.setting(self.mode)} needs a draft model",
                                  f"add {spelling.draft_model}, or {spelling.example(spelling.skip_layers, 'auto')} to "
                                  "draft with the model itself")
        if self.mode not in (None, "auto") and dtype is not None and dtype not in EXACT_DTYPES and not exact:
            raise inexact(self.mode, dtype, spelling)

    def build(self, dtype: torch.dtype, *, draft=None, exact: bool = False) -> Speculation | None:
        """A `Speculation` with a fresh proposer (see `build_speculation`); draft: the draft model for
        "draft" (from `load_draft` where these settings name their own)."""
        if self.mode is None:
            return None
        if self.mode == "lookahead" and self.lookahead is not None:
            window, ngram, guesses = self.lookahead
            return build_speculation(Lookahead(window=window, ngram=ngram, guesses=guesses), dtype,
                                     budget=self.budget, exact=exact)
        return build_speculation(self.mode, dtype, budget=self.budget, draft=draft, exact=exact)


def load_draft(settings: SpeculationSettings, model, tokenizer):
    """The draft model `settings` name, made for the target `model`: the model `draft_model`
    names, loaded in the target's dtype and on its device (its tokenizer must be the target's),
    or the target with `skip_layers` skipped (sharing its weights; "auto" chooses them first,
    see `choose_draft_layers`)."""
    if settings.draft_model is not None:
        device = weights_device(model)
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
    head_class = PROPOSER_MODES[kind].heads[0]
    if PROPOSER_MODES[kind].shipped_with_model:
        return head_class.of(model)
    if settings.head is not None:
        return head_class.load(settings.head).bind(model)
    for folder in (head_dir(model, kind), shipped_head_dir(model, kind)):
        if (folder / "config.json").exists():
            return head_class.load(folder).bind(model)
    raise InvalidArgument(f"no {kind} head was trained for this model ({shape_key(model)})",
                          f"train one: multidecode train-drafter --model M --kind {kind} "
                          "(or name a head's folder: --draft-head DIR on ask, generate, complete, vote, batch, explain and serve; "
                          f"SpeculationSettings.parse('{kind}', head=DIR) in Python)")


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
    """'W,N,G' (or three ints) as (window, n-gram size, guesses), checked as `Lookahead` checks them."""
    try:
        parts = value.split(",") if isinstance(value, str) else list(value)
        window, ngram, guesses = (int(part) for part in parts)
    except (ValueError, TypeError):
        raise InvalidArgument(f"{spelling.lookahead} {value!r} is not three integers W,N,G",
                              f"write e.g. {spelling.example(spelling.lookahead, '7,5,7')}") from None
    if (problem := window_problem(window, ngram, guesses)) is not None:
        raise InvalidArgument(f"{spelling.lookahead} {value}: {problem}",
                              f"write e.g. {spelling.example(spelling.lookahead, '7,5,7')}")
    if (window + guesses) * (ngram - 1) > MAX_LOOKAHEAD_NODES:  # built before any memory check could see it
        raise InvalidArgument(f"{spelling.lookahead} {value}: (W + G) x (N - 1) = {(window + guesses) * (ngram - 1)} "
                              f"tokens a step, past {MAX_LOOKAHEAD_NODES}",
                              f"lookahead pays at a few dozen tokens a step: write e.g. {spelling.example(spelling.lookahead, '7,5,7')}")
    return window, ngram, guesses


def skip_layer_list(value: str | Sequence[int], spelling: Spelling = PYTHON) -> tuple[int, ...] | str:
    """'4,6,8-12' (or a list of ints) as (4, 6, 8, 9, 10, 11, 12); "auto" stays "auto"."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if not isinstance(value, str):
        if not value:
            raise InvalidArgument(f"{spelling.skip_layers} names no layer, so the draft would be the target itself",
                                  f"name the layers to skip, e.g. {spelling.example(spelling.skip_layers, '4,6,8-12')}, or auto")
        if all(is_int(v) for v in value):
            return tuple(int(v) for v in value)
        value = ",".join(map(str, value))
    try:
        ranges = [(int(first), int(last) if dash else int(first))  # "8-" is no range
                  for first, dash, last in (part.strip().partition("-") for part in value.split(","))]
    except ValueError:
        raise InvalidArgument(f"{spelling.skip_layers} {value!r} is not a list of layer numbers",
                              f"write e.g. {spelling.example(spelling.skip_layers, '4,6,8-12')}, or auto") from None
    for first, last in ranges:
        if last < first:
            raise InvalidArgument(f"{spelling.skip_layers} {value!r} has a range that runs backwards ({first}-{last})",
                                  f"write the lower layer first: {last}-{first}")
    return tuple(layer for first, last in ranges for layer in range(first, last + 1))

