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
- `json_schema=`, `regex=`, `grammar=` or `constraint=` (a `Constraint`): structured output in
  every branch; see `constraints`.
"""

import importlib
import importlib.util
import logging

from .version import __version__

_EXPORTS = {
    "MultiDecoder": "api", "decode": "api", "load": "api",
    "TokenEvent": "branches",
    "Constraint": "constraints",
    "CacheUnwritable": "errors", "InvalidArgument": "errors", "InvalidInput": "errors",
    "ModelNotFound": "errors", "MultiDecodeError": "errors", "NotEnoughMemory": "errors", "OutputUnwritable": "errors",
    "MissingExtra": "errors", "NotBitExact": "errors", "PromptTooLong": "errors", "UnsupportedModel": "errors",
    "BranchContext": "proposers", "DraftTree": "proposers", "Proposer": "proposers",
    "DraftModel": "proposers.draft",
    "Lookahead": "proposers.lookahead",
    "PromptLookup": "proposers.lookup",
    "self_draft": "proposers.self_draft",
    "SuffixProposer": "proposers.suffix",
    "SamplingParams": "sampling_params",
    "CompactionPolicy": "scheduler",
    "Speculation": "speculation", "SpeculationSettings": "speculation",
    "Answer": "strategies.ask",
    "Beam": "strategies.beam",
    "Completion": "strategies.complete",
    "Trace": "strategies.vote", "Vote": "strategies.vote", "extract_answer": "strategies.vote",
}
"""The names the package exports -> the module that defines each. They are imported on first
use (PEP 562): `import multidecode` alone costs milliseconds, not the seconds torch and
transformers take, which only what needs a model pays."""

__all__ = ["__version__"]
__all__ += list(_EXPORTS)


def __getattr__(name: str):
    """An exported name, imported from its module on first use (and kept); or a submodule, as
    `multidecode.<submodule>` was reachable when the package imported everything eagerly."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


# A library logs, never prints: without this, Python writes its warnings to stderr by itself.
logging.getLogger(__name__).addHandler(logging.NullHandler())
