"""`ByteTokenizer`: a stand-in tokenizer for the tiny models of `tiny_models`, one id per character.

Enough for `MultiDecoder` and the benchmarks on a tiny random model: text in, ids out (bos first
unless told otherwise), ids back to text, no chat template. Ids 0-2 are pad, bos and eos; a
character becomes an id in 3..VOCAB-1.
"""

from __future__ import annotations

from tiny_models import EOS, VOCAB


class ByteTokenizer:
    """A minimal tokenizer for the tiny models: one id per character, bos first, no chat template."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = EOS

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [3 + ord(c) % (VOCAB - 3) for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:
        return "".join(chr(i) for i in ids if i >= 3)
