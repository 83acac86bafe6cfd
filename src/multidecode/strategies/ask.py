"""Many questions about one document, answered in one pass (the seed's motivating example).

Each question gets the whole prompt it would get alone (chat template around the document and
the question). The prompts' common run of ids (the document) is prefilled once; each question's
remaining ids form one branch; all branches are decoded together.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..branches import BranchRun, TokenEvent, start_prompts
from ..errors import InvalidArgument, as_list
from ..prompts import check_document, check_questions, question_message, render_prompt, tokenize_prompt
from ..sampling_params import per_branch_sampling
from ..scheduler import Scheduler


@dataclass(frozen=True)
class Answer:
    """One question's answer. prompt_ids is the whole root-to-branch prompt it was generated from;
    stats describes the whole run it came from (forwards, tokens, drafts; see `DecodeStats`)."""

    question: str
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict, compare=False, repr=False)
    parsed: object = None  # held to a JSON schema or object: the text's JSON value (None: cut short)
    seed: int | None = None  # the seed its branch drew with (question i: seed + i; None when greedy)
    matched: bool | None = None  # held to a constraint: whether the text matches it whole (None: free)


def question_prompts(tokenizer, document: str, questions: Sequence[str], *, instruction: str | None = None) -> list[list[int]]:
    """The whole prompt ids each question would be asked with alone."""
    questions = as_list(questions)
    check_document(document)
    check_questions(questions)
    if instruction is not None and not isinstance(instruction, str):
        raise InvalidArgument(f"instruction must be text, got {type(instruction).__name__}",
                              "pass the words said before each question, or None for the default")
    kwargs = {} if instruction is None else {"instruction": instruction}
    return [tokenize_prompt(tokenizer, render_prompt(tokenizer, question_message(document, q, **kwargs)))
            for q in questions]


def start(scheduler: Scheduler, tokenizer, document: str, questions: Sequence[str], *, max_new_tokens: int,
          stop: Sequence[str] = (), instruction: str | None = None, speculate=None, constraint=None,
          eos_token_id=None, **sampling) -> BranchRun:
    """Admit one branch per question to `scheduler` and prefill them (see `branches.start`).
    constraint: one `constraints.Constraint` for every answer, or a list of one per question;
    eos_token_id: the ids that end an answer (default: the model's)."""
    prompts = question_prompts(tokenizer, document, questions, instruction=instruction)
    return start_prompts(scheduler, prompts, max_new_tokens=max_new_tokens,
                         sampling=per_branch_sampling(len(prompts), sampling), tokenizer=tokenizer, stop=stop,
                         speculate=speculate, constraint=constraint, eos_token_id=eos_token_id)


def stream(scheduler: Scheduler, tokenizer, document: str, questions: Sequence[str], **settings) -> Iterator[TokenEvent]:
    return start(scheduler, tokenizer, document, questions, **settings).events


def answers(run: BranchRun, questions: Sequence[str]) -> list[Answer]:
    return answers_of(questions, run.branches, run.prompts, run.stats.as_dict())


def answers_of(questions: Sequence[str], branches, prompts: Sequence[list[int]], stats: dict) -> list[Answer]:
    """Each question's `Answer` from its finished branch (wherever the branches ran)."""
    return [Answer(q, b.output.text, b.output.token_ids, prompts[i], b.output.finish_reason, stats, b.parsed, b.seed,
                   b.matched)
            for i, (q, b) in enumerate(zip(questions, branches))]


def ask(scheduler: Scheduler, tokenizer, document: str, questions: Sequence[str], **settings) -> list[Answer]:
    questions = as_list(questions)  # read once: the prompts and the answers both name them
    return answers(start(scheduler, tokenizer, document, questions, **settings).finish(), questions)
