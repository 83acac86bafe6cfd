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
- "auto": prompt lookup and the suffix store merged into one tree (`proposers.mixture`), with
  the draft nodes of each step chosen by the measured cost of a forward on this hardware and the
  acceptance each source has had so far (`cost`), so that it speculates only where that pays,
  and not at all where it does not;
- a `Proposer`: that proposer, at the default budget;
- a `Speculation`: all of it spelled out.

Speculation never changes what is generated: greedy output equals plain greedy decoding and a
seeded sampled run equals the same run without speculation (see `verify`). That holds in
float32, where the forest is exact; in bfloat16 or float16 a masked forward takes other kernels
and near-ties can break differently, so explicit speculation is refused there and "auto" does
not speculate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidArgument, check_positive
from .proposers import Proposer
from .proposers.draft import DraftModel
from .proposers.lookahead import Lookahead
from .proposers.lookup import PromptLookup
from .proposers.mixture import Mixture
from .proposers.suffix import SuffixProposer

DEFAULT_BUDGET = 8
"""Draft nodes per branch per step for a fixed-budget mode ("lookup", or a proposer object)."""

AUTO_MAX_DRAFT = 16
"""In "auto", the most draft nodes a branch proposes per step (the cost model keeps fewer)."""

MODES = ("lookup", "suffix", "lookahead", "draft", "auto")
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


def resolve(speculate, dtype: torch.dtype, *, budget: int | None = None, draft=None) -> Speculation | None:
    """`speculate` (see the module notes) as a `Speculation`, or None for none.

    budget: overrides the draft budget of a named mode or proposer (for "auto", the most nodes a
    branch may propose). draft: the draft model (or `DraftModel` proposer) of "draft". Raises
    `InvalidArgument` for an unknown mode, a bad budget, "draft" without a draft model, or explicit
    speculation in a dtype where it cannot be exact.
    """
    if budget is not None:
        check_positive("the draft budget", budget)
    if speculate is None or speculate is False:
        return None
    if isinstance(speculate, Speculation):
        spec = speculate
    elif isinstance(speculate, Proposer):
        spec = Speculation(speculate, budget or speculate.default_budget or DEFAULT_BUDGET)
    elif speculate == "auto":
        spec = Speculation(auto_proposer(), None, budget or AUTO_MAX_DRAFT)
    else:
        proposer = named_proposer(speculate, draft)
        spec = Speculation(proposer, budget or proposer.default_budget or DEFAULT_BUDGET)
    if dtype not in EXACT_DTYPES:
        if spec.auto:
            return None
        raise InvalidArgument(
            f"speculation ({spec.name}) cannot be exact in {str(dtype).removeprefix('torch.')}: masked forwards "
            "take other kernels there, so near-ties may break differently than in plain decoding",
            "load the model in float32, or use speculate='auto' (which then does not speculate)")
    return spec


def named_proposer(mode: str, draft=None) -> Proposer:
    """A fresh proposer for a named mode (`draft`: the draft model of "draft")."""
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
    raise InvalidArgument(f"unknown speculation mode {mode!r}", f"use one of {', '.join(MODES)}, a Proposer, or None")


def auto_proposer(store=None) -> Mixture:
    """What "auto" drafts with: prompt lookup and the suffix store (`store`, default the shared
    one), and lookahead where the hardware makes its window nearly free (`Mixture.fit`, done when
    a run starts and the cost curve is known)."""
    return Mixture([PromptLookup(), SuffixProposer(store=store)], name="auto", lookahead=True)
