"""`MultiDecoder`: a model and its tokenizer, with the user-facing strategies as methods.

Every method builds a forest over one fresh `Engine` and decodes it; none prints. `stream_*`
methods yield `TokenEvent`s as tokens are produced; the others collect them into results.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .decoding import Branch, CompactionPolicy, TokenEvent, check_fits, check_positive, open_branches, run_branches
from .engine import Engine
from .errors import InvalidInput
from .models import check_supported, load_model_and_tokenizer
from .prompts import question_message, render_prompt, share_prefix, tokenize_prompt
from .sampling import BranchSampler, SamplingParams
from .stopping import BranchOutput, StopRule, eos_ids_of

SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


@dataclass(frozen=True)
class Answer:
    """One question's answer. prompt_ids is the whole root-to-branch prompt it was generated from."""

    question: str
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str


def per_branch_sampling(n: int, sampling: dict) -> list[SamplingParams]:
    """Expand sampling settings (each a value for all branches, or a list of n) into n params.

    A single `seed` s gives branch i the seed s + i; a list gives each branch its own.
    """
    unknown = set(sampling) - set(SAMPLING_KEYS)
    if unknown:
        raise InvalidInput(f"unknown sampling setting(s): {', '.join(sorted(unknown))}",
                           f"use {', '.join(SAMPLING_KEYS)}")
    columns: dict[str, list] = {}
    for key, value in sampling.items():
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise InvalidInput(f"{key} has {len(value)} values for {n} branches", "give one value, or one per branch")
            columns[key] = list(value)
        elif key == "seed" and value is not None:
            columns[key] = [value + i for i in range(n)]
        else:
            columns[key] = [value] * n
    sampled = {k: v for k, v in columns.items() if k != "do_sample"}
    if "do_sample" not in columns:
        # Asking for a temperature, top-k/p, min-p or a seed means sampling.
        columns["do_sample"] = [
            any(k in ("temperature", "top_k", "top_p", "min_p", "seed") and v[i] is not None for k, v in sampled.items())
            for i in range(n)
        ]
    params = []
    for i in range(n):
        kwargs = {k: v[i] for k, v in columns.items() if v[i] is not None}
        params.append(SamplingParams(**kwargs))
    return params


@dataclass
class _Run:
    """A forest being decoded: its engine, branches and event stream."""

    engine: Engine
    branches: list[Branch]
    events: Iterator[TokenEvent]
    prompts: list[list[int]] = field(default_factory=list)


class MultiDecoder:
    """A causal LM and its tokenizer, decoded as forests over one shared KV cache.

    model: any transformers causal LM loaded with eager or sdpa attention.
    """

    def __init__(self, model, tokenizer, *, compaction: CompactionPolicy | None = None) -> None:
        check_supported(model)
        self.model = model
        self.tokenizer = tokenizer
        self.compaction = compaction or CompactionPolicy()

    @property
    def eos_ids(self) -> frozenset[int]:
        return eos_ids_of(self.model, None)

    # ------------------------------------------------------------------ the shared machinery
    def _start(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: Sequence[SamplingParams],
        stop: Sequence[str] = (),
        eos_token_id=None,
    ) -> _Run:
        """Decode whole prompts as one forest: their common prefix once, then one branch each."""
        check_positive("max_new_tokens", max_new_tokens)
        shared = share_prefix(prompts)
        engine = Engine(self.model)
        check_fits(engine, [len(p) for p in shared.prompt_ids], max_new_tokens)
        engine.reserve(len(shared.prefix_ids) + sum(map(len, shared.suffix_ids)) + len(prompts) * max_new_tokens)
        rule = StopRule(max_new_tokens, eos_ids_of(self.model, eos_token_id), tuple(stop or ()))
        leaves, logits = open_branches(engine, shared.prefix_ids, shared.suffix_ids)
        branches = [
            Branch(i, leaf, BranchSampler(sampling[i], shared.prompt_ids[i]), BranchOutput(rule, self.tokenizer),
                   len(shared.prompt_ids[i]))
            for i, leaf in enumerate(leaves)
        ]
        events = run_branches(engine, branches, logits, compaction=self.compaction)
        return _Run(engine, branches, events, shared.prompt_ids)

    # ------------------------------------------------------------------ many questions, one document
    def question_prompts(self, document: str, questions: Sequence[str], *, instruction=None) -> list[list[int]]:
        """The whole prompt ids each question would be asked with alone."""
        _check_document(document)
        _check_questions(questions)
        kwargs = {} if instruction is None else {"instruction": instruction}
        return [
            tokenize_prompt(self.tokenizer, render_prompt(self.tokenizer, question_message(document, q, **kwargs)))
            for q in questions
        ]

    def stream(
        self,
        document: str,
        questions: Sequence[str],
        *,
        max_new_tokens: int = 48,
        stop: Sequence[str] = (),
        instruction: str | None = None,
        **sampling,
    ) -> Iterator[TokenEvent]:
        """`TokenEvent`s (branch = question index) as all questions are answered in one forest.

        Inputs are checked and the prompts prefilled before this returns; tokens come as you iterate.
        """
        return self._start_questions(document, questions, max_new_tokens, stop, instruction, sampling).events

    def ask(
        self,
        document: str,
        questions: Sequence[str],
        *,
        max_new_tokens: int = 48,
        stop: Sequence[str] = (),
        instruction: str | None = None,
        **sampling,
    ) -> list[Answer]:
        """Answer every question about `document` in one MultiDecode pass.

        Greedy by default; each answer equals greedy generation from its `.prompt_ids` alone.
        Sampling settings (`do_sample`, `temperature`, `top_k`, `top_p`, `min_p`,
        `repetition_penalty`, `seed`) take one value or one per question.
        """
        run = self._start_questions(document, questions, max_new_tokens, stop, instruction, sampling)
        for _ in run.events:
            pass
        return [
            Answer(q, b.output.text, b.output.token_ids, run.prompts[i], b.output.finish_reason or "length")
            for i, (q, b) in enumerate(zip(questions, run.branches))
        ]

    def _start_questions(self, document, questions, max_new_tokens, stop, instruction, sampling) -> _Run:
        prompts = self.question_prompts(document, questions, instruction=instruction)
        return self._start(
            prompts, max_new_tokens=max_new_tokens, sampling=per_branch_sampling(len(prompts), sampling), stop=stop
        )


def _check_document(document: str) -> None:
    if not isinstance(document, str):
        raise InvalidInput(f"the document must be text, got {type(document).__name__}")
    if not document.strip():
        raise InvalidInput("the document is empty", "pass a document with some text in it")


def _check_questions(questions: Sequence[str]) -> None:
    if isinstance(questions, str):
        raise InvalidInput("questions must be a list of strings, got one string", "wrap it in a list: [question]")
    if not questions:
        raise InvalidInput("there are no questions", "ask at least one question")
    for i, q in enumerate(questions):
        if not isinstance(q, str) or not q.strip():
            raise InvalidInput(f"question {i + 1} is empty", "remove it or write the question")


def load(model: str | None = None, *, dtype=None, device=None) -> MultiDecoder:
    """Load a model by name (nothing for the embedded SmolLM2-135M-Instruct) as a `MultiDecoder`.

    model: None, a local Hugging Face folder, a local .gguf file, or a hub id.
    dtype: float32 (default), bfloat16 or float16; device: "cpu", "cuda", ... (default: cuda if any).
    """
    lm, tokenizer = load_model_and_tokenizer(model, dtype=dtype, device=device)
    return MultiDecoder(lm, tokenizer)
