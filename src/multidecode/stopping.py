"""When a branch stops, and the text it has produced so far.

A branch stops on any of the model's end-of-sequence ids (the eos token is kept in its ids, as
`generate` keeps it), on `max_new_tokens`, or when its text contains a stop string (the text is cut
before the stop string; the ids keep every token generated).

Text is produced incrementally: each token yields the *delta* that became certain. A delta never
ends inside a multi-byte character, and text that could be the start of a stop string is held back
until it is known not to be one, so a streamed answer never shows text the final answer drops.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import InvalidArgument, is_int
from .forest import ROOT

STOP = "stop"  # an eos token or a stop string
LENGTH = "length"  # max_new_tokens reached


@dataclass(frozen=True)
class StopRule:
    """One branch's stopping conditions."""

    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()


def eos_ids_of(model, eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    """The eos ids to stop on: the argument if given, else all of the model's generation config ids."""
    given = eos_token_id is not None
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if is_int(eos_token_id) else eos_token_id
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable) or not all(is_int(t) for t in ids):
        raise InvalidArgument(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r}",
                              "pass an int, a list of ints, or [] to never stop early")
    if given and any(t < 0 for t in ids):
        raise InvalidArgument(f"eos_token_id must name token ids (0 or more), got {eos_token_id!r}",
                              "pass the ids of the model's end tokens, or [] to never stop early")
    return frozenset(int(t) for t in ids)


def stop_strings_of(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """Stop strings as a tuple; one string is one stop string, not a set of characters."""
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    for text in strings:
        if not isinstance(text, str) or not text:
            raise InvalidArgument(f"a stop string must be non-empty text, got {text!r}",
                                  "remove it, or give the text to stop at")
    return strings


class TextStream:
    """Turns token ids into text deltas, decoding only a short window each time."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the window whose text is already emitted
        self._read = 0  # end of that window

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is left (an incomplete character at the very end, say)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


CHARACTER_TOKENS = 4
"""The most tokens one character can be split over: UTF-8 takes at most 4 bytes, one a token at the least."""


def added_texts(tokenizer, windows: Sequence[Sequence[int]]) -> list[str]:
    """The text each window's last token adds to the tokens before it (`windows`: up to
    `CHARACTER_TOKENS` ancestors, then the token), such that the texts of a path's tokens join into
    its text, whatever the path (a forest's node knows only its ancestors, not the linear stream
    `TextStream` reads): a character split over tokens comes with the token that completes it, and
    a token that ends inside one shows what it holds before it. Each window starts at its first
    token whose text does not begin inside a character (a byte-fallback tokenizer turns a whole run
    of bytes into U+FFFD when one is cut). Special tokens are kept: this is for showing tokens."""
    def decode(rows):
        how = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
        if hasattr(tokenizer, "batch_decode"):
            return tokenizer.batch_decode(rows, **how)
        return [tokenizer.decode(row, **how) for row in rows]

    tails = iter(decode([list(w[s:]) for w in windows for s in range(len(w))]))  # every suffix of each
    trimmed, afters = [], []
    for window in windows:
        starts = [next(tails) for _ in window]
        first = next((s for s, text in enumerate(starts) if not text.startswith("\ufffd")), 0)
        trimmed.append(list(window[first:]))
        afters.append(starts[first])  # the trimmed window's text: decoded already
    texts = []
    for before, after in zip(decode([w[:-1] for w in trimmed]), afters):
        # past what the tokens before it showed (their text, less a character they left open, whose
        # U+FFFD differs from the character completed), less one it leaves open itself
        texts.append(after[len(os.path.commonprefix([before, after])):].rstrip("\ufffd"))
    return texts


def node_texts(tokenizer, forest, nodes: Sequence[int]) -> list[str]:
    """The text each of a forest's `nodes` adds to its path (`added_texts`, each read from its
    `CHARACTER_TOKENS` nearest ancestors); ids as text where there is no tokenizer."""
    if tokenizer is None:
        return [str(forest.tokens[n]) for n in nodes]
    windows = []
    for node in nodes:
        window, n = [], node
        while n != ROOT and len(window) <= CHARACTER_TOKENS:
            window.append(forest.tokens[n])
            n = forest.parents[n]
        windows.append(window[::-1])
    return added_texts(tokenizer, windows)


class BranchOutput:
    """The tokens and text of one branch as it grows, and why it stopped."""

    def __init__(self, rule: StopRule, tokenizer=None) -> None:
        self.rule = rule
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._stream = TextStream(tokenizer) if tokenizer is not None else None
        self._text = ""  # all text decoded so far
        self._emitted = 0  # how much of it has been handed out
        self._cut: int | None = None  # where a stop string begins

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cut_by_stop_string(self) -> bool:
        """Whether a stop string ended it (its text cut before the stop string)."""
        return self._cut is not None

    @property
    def text(self) -> str:
        return self._text[: self._cut] if self._cut is not None else self._text

    @property
    def decoded_chars(self) -> int:
        """Characters decoded so far, text held back for a stop string included."""
        return len(self._text)

    def accept(self, token: int) -> str:
        """Record one generated token; returns the text delta it makes certain."""
        if self.finished:
            raise RuntimeError("this branch has already finished")
        self.token_ids.append(token)
        if token in self.rule.eos_ids:
            self.finish_reason = STOP
        if self._stream is not None:
            self._text += self._stream.push(token)
            if self.rule.stop_strings:
                self._find_stop()
        if not self.finished and len(self.token_ids) >= self.rule.max_new_tokens:
            self.finish_reason = LENGTH
        if self.finished and self._stream is not None and self._cut is None:
            self._text += self._stream.flush()
            if self.rule.stop_strings:
                self._find_stop()
        return self._release()

    def _find_stop(self) -> None:
        # Search only where a new stop string can have appeared.
        longest = max(len(s) for s in self.rule.stop_strings)
        start = max(0, self._emitted - longest)
        hits = [i for s in self.rule.stop_strings if (i := self._text.find(s, start)) >= 0]
        if hits:
            self._cut = min(hits)
            self.finish_reason = STOP

    def _release(self) -> str:
        end = len(self.text)
        if not self.finished and self.rule.stop_strings:
            end = min(end, self._safe_end())
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _safe_end(self) -> int:
        """Text up to here cannot be part of a stop string that is still being written."""
        text = self._text
        end = len(text)
        for s in self.rule.stop_strings:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    end = min(end, len(text) - k)
                    break
        return end
