"""multidecode: many generations from one unmodified causal LM, in one pass over one shared KV cache.

MultiDecode gives every token a position id equal to its depth in a tree and an attention mask
that lets it see only itself and its ancestors. A forest of sequences then shares one KV cache, and
one forward pass yields the exact next-token prediction of every leaf, as if each root-to-leaf path
had been run alone.

Entry points:
- `decode(model, prefix_ids, branch_ids, ...)`: token-level, any transformers causal LM.
- `load(model=None)` -> `MultiDecoder`: text-level strategies (`generate`, `ask`, `stream`,
  `complete`, `vote`, `beam_search`, `margins`) on the embedded SmolLM2-135M-Instruct or any
  local/hub model.
- `speculate=` on every decoding entry point: draft trees verified inside every branch
  (`Speculation`, `SpeculationSettings`, `Proposer`, `DraftTree`, `PromptLookup`,
  `SuffixProposer`, `Lookahead`, `DraftModel`, `self_draft`); see `speculation`.
"""

import logging

from .api import MultiDecoder, decode, load
from .branches import TokenEvent
from .errors import (
    CacheUnwritable,
    InvalidArgument,
    InvalidInput,
    ModelNotFound,
    MultiDecodeError,
    PromptTooLong,
    UnsupportedModel,
)
from .proposers import BranchContext, DraftTree, Proposer
from .proposers.draft import DraftModel
from .proposers.lookahead import Lookahead
from .proposers.lookup import PromptLookup
from .proposers.self_draft import self_draft
from .proposers.suffix import SuffixProposer
from .sampling import SamplingParams
from .scheduler import CompactionPolicy
from .speculation import Speculation, SpeculationSettings
from .strategies.ask import Answer
from .strategies.beam import Beam
from .strategies.complete import Completion
from .strategies.vote import Trace, Vote, extract_answer
from .version import __version__

__all__ = [
    "Answer",
    "Beam",
    "BranchContext",
    "CacheUnwritable",
    "CompactionPolicy",
    "Completion",
    "DraftModel",
    "DraftTree",
    "InvalidArgument",
    "InvalidInput",
    "Lookahead",
    "ModelNotFound",
    "MultiDecodeError",
    "MultiDecoder",
    "PromptLookup",
    "PromptTooLong",
    "Proposer",
    "SamplingParams",
    "Speculation",
    "SpeculationSettings",
    "SuffixProposer",
    "TokenEvent",
    "Trace",
    "UnsupportedModel",
    "Vote",
    "__version__",
    "decode",
    "extract_answer",
    "load",
    "self_draft",
]

# A library logs, never prints: without this, Python writes its warnings to stderr by itself.
logging.getLogger(__name__).addHandler(logging.NullHandler())
