"""A batch job's settings: everything its answers depend on, and their fingerprint.

A job's records carry the fingerprint of the settings they were made with, so that a job is never
resumed with other questions, another model or other sampling by mistake (`output.OutputFile`
checks it; `BatchJob` writes it).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..constraints import Constraint
from ..errors import InvalidArgument, InvalidInput, check_positive
from ..models.vetting import max_positions
from ..sampling_params import check_vocabulary, per_branch_sampling, without_neutral
from ..strategies.ask import check_questions


@dataclass(frozen=True)
class BatchSettings:
    """Everything a batch job's answers depend on.

    questions: asked of every document, before the line's own questions.
    model, precision: labels of the model the answers come from (any stable text, such as a resolved
    folder path or a hub id); they go into the fingerprint, so a job cannot be resumed with
    another model by mistake.
    sampling: keyword arguments for `MultiDecoder.ask` (temperature, top_k, top_p, min_p,
    repetition_penalty, presence_penalty, frequency_penalty, logit_bias, seed, do_sample).
    constraint: what every answer is held to (a `constraints.Constraint`: a JSON schema for the
    run, say; a line's own "json_schema" takes its place for that line).
    """

    questions: tuple[str, ...] = ()
    max_new_tokens: int = 48
    stop: tuple[str, ...] = ()
    sampling: Mapping[str, Any] = field(default_factory=dict)
    instruction: str | None = None
    model: str | None = None
    precision: str | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:  # one string is one question, one stop string (not its characters)
        object.__setattr__(self, "questions", (self.questions,) if isinstance(self.questions, str) else tuple(self.questions))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "sampling", dict(self.sampling))

    def check(self) -> None:
        """Refuse settings that would make every line fail (a job error, not a line error)."""
        check_positive("max_new_tokens", self.max_new_tokens)
        per_branch_sampling(1, dict(self.sampling))
        if self.questions:
            check_questions(list(self.questions))
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise InvalidInput("a stop string is empty", "remove it or give the text to stop at")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidArgument(f"constraint must be a multidecode Constraint, got {type(self.constraint).__name__}")

    def check_model(self, model) -> None:
        """Refuse what `model` would make every line fail with (a job error, before any line runs):
        a logit bias on a token id it does not have, more new tokens than it has positions."""
        check_vocabulary(per_branch_sampling(1, dict(self.sampling)), model.get_input_embeddings().num_embeddings,
                         whose="the job")
        positions = max_positions(model.config)
        if positions is not None and self.max_new_tokens >= positions:
            raise InvalidArgument(f"max_new_tokens is {self.max_new_tokens}, and the model has {positions:,} positions "
                                  "for a prompt and its answer: no line would fit",
                                  f"lower --max-new-tokens well below {positions:,}, leaving room for the documents")

    def as_dict(self) -> dict:
        return {"model": self.model, "precision": self.precision, "questions": list(self.questions),
                "max_new_tokens": self.max_new_tokens, "stop": list(self.stop),
                "sampling": {k: _as_json(v) for k, v in sorted(without_neutral(self.sampling).items())},
                "instruction": self.instruction,
                **constraint_entry(self.constraint)}

    @property
    def fingerprint(self) -> str:
        """12 hex digits of the SHA-256 of the settings as canonical JSON."""
        text = json.dumps(self.as_dict(), sort_keys=True, ensure_ascii=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _as_json(value):
    """A sampling setting as JSON keeps it (a logit bias's token ids become text keys, sorted)."""
    if isinstance(value, Mapping):
        return {str(k): v for k, v in sorted(value.items())}
    return value


def constraint_entry(constraint: Constraint | None) -> dict:
    """The constraint as the settings record it (nothing without one, so that the fingerprints of
    jobs without one stay what they were)."""
    if constraint is None:
        return {}
    return {"constraint": {"kind": constraint.kind, "text": constraint.text, "strict": constraint.strict}}


def model_identity(name: str | os.PathLike | None) -> str:
    """A stable label for a model name as `load` takes it: the embedded model, a resolved local
    path (so that a relative path from another folder is the same model), or a hub id."""
    if name is None:
        return "embedded:SmolLM2-135M-Instruct"
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else str(name)


__all__ = ["BatchSettings", "model_identity"]
