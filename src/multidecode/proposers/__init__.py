"""Proposers: where draft tokens come from, for speculative decoding inside every branch.

`base` holds the interface every proposer implements (`Proposer`: `propose` a `DraftTree` for a
`BranchContext`, `observe` what the target accepted) and defines the terms; each proposer is a
module of its own (`lookup`, `suffix`, `lookahead`, `draft`, `self_draft`, `medusa`, `eagle`,
`eagle3`, `mtp`, `mixture`); `drafting` holds what the proposers that run a network of their own
share, and `heads` a learned head's files and its target's fingerprint. Which proposer a
`speculate=` name means is one row of `speculation.PROPOSERS`.
"""

from .base import UNDER_LEAF, BranchContext, DraftTree, Proposer

__all__ = ["UNDER_LEAF", "BranchContext", "DraftTree", "Proposer"]
