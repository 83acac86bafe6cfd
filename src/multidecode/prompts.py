"""Prompts for many questions about one document, and where they may be split.

Each question gets the full prompt it would get alone: the model's chat template (when it has one)
around a user message holding the document and the question. Those prompts share a long start.

**Where to split.** Tokenizers merge across boundaries, so tokenizing "document" and "question"
separately can give other ids than tokenizing the whole prompt. We never tokenize parts: every
prompt is tokenized whole, and the shared prefix is the longest run of *ids* common to all of
them. Each branch's path (prefix + its own suffix) is then exactly its whole-prompt ids, which is
what makes `ask` equal to generating from each prompt alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import InvalidArgument, InvalidInput

DEFAULT_INSTRUCTION = "Answer in one short sentence."


def check_text(value, what: str, hint: str) -> None:
    """Refuse a document, question or prompt that is not text or is blank."""
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be text, got {type(value).__name__}")
    if not value.strip():
        raise InvalidInput(f"{what} is empty", hint)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidInput(f"{what} is not valid Unicode text (a lone surrogate at character {err.start})",
                           "pass text decoded as UTF-8") from err


def check_document(document: str) -> None:
    check_text(document, "the document", "pass a document with some text in it")


def check_questions(questions: Sequence[str]) -> None:
    if isinstance(questions, str):
        raise InvalidInput("questions must be a list of strings, got one string", "wrap it in a list: [question]")
    if not questions:
        raise InvalidInput("there are no questions", "ask at least one question")
    for i, q in enumerate(questions):
        check_text(q, f"question {i + 1}", "remove it or write the question")


@dataclass(frozen=True)
class SharedPrompts:
    """Several prompts as one shared prefix plus one suffix each.

    prefix_ids + suffix_ids[i] == prompt_ids[i] for every i.
    """

    prefix_ids: list[int]
    suffix_ids: list[list[int]]
    prompt_ids: list[list[int]]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def require_tokenizer(tokenizer) -> None:
    """Refuse text where there is no tokenizer to read it (a decoder built without one)."""
    if tokenizer is None:
        raise InvalidArgument("this decoder has no tokenizer, so it cannot read text",
                              "pass token ids instead, or build it with one: MultiDecoder(model, tokenizer)")


def render_prompt(tokenizer, user_message: str, *, system: str | None = None) -> str:
    """The text a chat model sees for one user turn (chat template when available)."""
    if has_chat_template(tokenizer):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user_message})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head = f"{system}\n\n" if system else ""
    return f"{head}{user_message}\nAnswer:"


def question_message(document: str, question: str, instruction: str | None = DEFAULT_INSTRUCTION) -> str:
    """The user message for one question: the document first, so every prompt starts alike."""
    tail = f"\n{instruction}" if instruction else ""
    return f"Here is a document.\n\n{document.strip()}\n\nQuestion: {question.strip()}{tail}"


def tokenize_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a whole rendered prompt. Chat-templated text carries its own special tokens."""
    require_tokenizer(tokenizer)
    special = not has_chat_template(tokenizer)
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def share_prefix(prompt_ids: Sequence[Sequence[int]]) -> SharedPrompts:
    """Split whole-prompt ids into their longest common prefix and the rest of each."""
    prompts = [list(p) for p in prompt_ids]
    n = common_prefix_length(prompts)
    return SharedPrompts(prompts[0][:n], [p[n:] for p in prompts], prompts)


def common_prefix_length(prompts: Sequence[Sequence[int]], *, leave: int = 0) -> int:
    """How many leading ids all `prompts` share, stopping `leave` ids short of the shortest."""
    shortest = min(len(p) for p in prompts)
    n = 0
    while n < shortest - leave and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n
