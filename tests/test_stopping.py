"""Stopping rules and streamed text, without a model.

A byte-level fake tokenizer (token id = one UTF-8 byte) makes multi-byte characters span several
tokens, which is where incremental decoding goes wrong if it is careless.
"""

from __future__ import annotations

import pytest

from multidecode.errors import InvalidArgument
from multidecode.stopping import (
    CHARACTER_TOKENS,
    LENGTH,
    STOP,
    BranchOutput,
    StopRule,
    added_texts,
    eos_ids_of,
    stop_strings_of,
)

EOS = 0


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return bytes(i for i in ids if not (skip_special_tokens and i == EOS)).decode("utf-8", errors="replace")

    def batch_decode(self, rows, **how) -> list[str]:
        return [self.decode(ids, **how) for ids in rows]


def feed(text: str, *, stop=(), max_new_tokens: int = 100, eos_at: int | None = None):
    """Accept `text` byte by byte (an eos after `eos_at` bytes, if given) until the branch
    finishes; returns (output, the deltas streamed)."""
    ids = list(text.encode("utf-8"))
    if eos_at is not None:
        ids.insert(eos_at, EOS)
    out = BranchOutput(StopRule(max_new_tokens, frozenset([EOS]), stop_strings_of(stop)), ByteTokenizer())
    deltas = []
    for token in ids:
        deltas.append(out.accept(token))
        if out.finished:
            break
    return out, deltas


def test_eos_stops_and_is_kept_in_the_ids_but_not_the_text():
    out, deltas = feed("hello world", eos_at=5)
    assert out.finish_reason == STOP
    assert out.token_ids == list(b"hello") + [EOS]
    assert out.text == "hello" == "".join(deltas)


def test_max_new_tokens_ends_with_length():
    out, _ = feed("hello world", max_new_tokens=4)
    assert (out.finish_reason, out.text, len(out.token_ids)) == (LENGTH, "hell", 4)


def test_a_stop_string_cuts_the_text_and_the_stream_never_shows_what_is_cut():
    out, deltas = feed("The answer is 42. Next question", stop=[". N"])
    assert out.finish_reason == STOP
    assert out.text == "The answer is 42"
    assert "".join(deltas) == out.text
    # The ids keep every token generated, up to the one that completed the stop string.
    assert bytes(out.token_ids).decode() == "The answer is 42. N"


def test_text_that_only_starts_like_a_stop_string_is_held_back_then_released():
    out, deltas = feed("a. b. No", stop=[". N"])
    assert out.text == "a. b"
    assert "".join(deltas) == "a. b"
    # ". " after "a" was held back while it could still become ". N", then released with "b".
    assert deltas[1:3] == ["", ""] and deltas[3] == ". b"


def test_one_string_is_one_stop_string_not_a_set_of_characters():
    assert stop_strings_of("n+") == ("n+",)
    out, _ = feed("one + n+ two", stop="n+")
    assert out.text == "one + "


def test_the_earliest_of_several_stop_strings_wins():
    out, _ = feed("alpha beta gamma", stop=["gamma", "beta"])
    assert out.text == "alpha "


def test_multi_byte_characters_are_never_split_across_deltas():
    text = "café → 東京 ✓"
    out, deltas = feed(text)
    assert not out.finished and out.text == text
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [3], b"x"])
def test_bad_stop_strings_are_refused(bad):
    with pytest.raises(InvalidArgument):
        stop_strings_of(bad)


def test_eos_ids_accept_an_int_or_a_list_and_nothing_else():
    assert eos_ids_of(None, 5) == {5}
    assert eos_ids_of(None, [5, 7]) == {5, 7}
    assert eos_ids_of(None, []) == frozenset()
    for bad in ("12", [1.5], 2.0):
        with pytest.raises(InvalidArgument):
            eos_ids_of(None, bad)


def test_a_finished_branch_takes_no_more_tokens():
    out, _ = feed("ab", max_new_tokens=1)
    with pytest.raises(RuntimeError):
        out.accept(ord("c"))


class ChunkTokenizer:
    """Tokens of any bytes (as a byte-level BPE vocabulary holds: a space and a character's first
    bytes, one character's end and the next one's start); with `fallback`, a run of bytes that
    does not decode is one U+FFFD per token, as a SentencePiece byte-fallback decoder gives it."""

    def __init__(self, text: str, cuts: list[int], *, fallback: bool = False) -> None:
        data = text.encode("utf-8")
        self.chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        self.fallback = fallback

    def batch_decode(self, rows, **how) -> list[str]:
        return [self.decode(ids) for ids in rows]

    def decode(self, ids) -> str:
        if not self.fallback:
            return b"".join(self.chunks[i] for i in ids).decode("utf-8", errors="replace")
        text, run = "", []  # byte tokens (chunks no character of their own) decode by runs
        for i in [*ids, None]:
            if i is not None and not _whole(self.chunks[i]):
                run.append(self.chunks[i])
                continue
            try:
                text += b"".join(run).decode("utf-8")
            except UnicodeDecodeError:
                text += "\ufffd" * len(run)
            run = []
            text += "" if i is None else self.chunks[i].decode("utf-8")
        return text


def _whole(chunk: bytes) -> bool:
    try:
        chunk.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


TEXT = "Café 日本語 🎉, a 𝄞 b"


@pytest.mark.parametrize("tokenizer", ["bytes", "byte-level BPE", "chunks", "byte fallback"])
def test_a_forest_nodes_texts_join_into_each_paths_text(tokenizer):
    """Each node's text read from its few ancestors joins, along a path, into the path's text, and
    no node shows a piece of a character (U+FFFD), as the live page showed them when each token was
    decoded alone: for one byte a token, for a trained BPE, for tokens that hold a space and a
    character's first bytes or one character's end and the next one's start (whose whole part
    was lost), and for a byte-fallback decoder (whose characters after another cut one were lost)."""
    if tokenizer == "bytes":
        tok, encode = ByteTokenizer(), lambda text: list(text.encode("utf-8"))
    elif tokenizer == "byte-level BPE":
        from local_models import tiny_tokenizer

        tok = tiny_tokenizer()
        encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    else:
        cuts = list(range(1, len(TEXT.encode("utf-8")))) if tokenizer == "byte fallback" else [3, 5, 7, 10, 13, 15, 19]
        tok = ChunkTokenizer(TEXT, cuts, fallback=tokenizer == "byte fallback")
        encode = lambda text: list(range(len(tok.chunks))) if text == TEXT else None
    for text in (TEXT, "Café 日本語 🎉 done") if tokenizer in ("bytes", "byte-level BPE") else (TEXT,):
        path = encode(text)
        windows = [path[max(0, i - CHARACTER_TOKENS):i + 1] for i in range(len(path))]
        texts = added_texts(tok, windows)
        assert "".join(texts) == text, texts
        assert not any("\ufffd" in t for t in texts), texts
