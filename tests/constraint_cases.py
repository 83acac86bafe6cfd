"""Constrained decoding's references, shared by the structured-output tests: the plain
constrained loop (the model on the whole sequence, llguidance's own mask, choose), a finished
output checked against its constraint, and what a constraint allows first."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import torch

from multidecode.constraints import Constraint, compile_constraint


def allowed(matcher, vocab: int) -> torch.Tensor:
    """[vocab] bool: the tokens llguidance's `matcher` allows next (its own bitmask, unpacked)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return torch.from_numpy(bits[:vocab].astype(bool))


def eos_of(decoder) -> int:
    return decoder.tokenizer.eos_token_id


def prompt_of(decoder, text: str) -> list[int]:
    return decoder.tokenizer(text)["input_ids"]


def reference(decoder, prompt: list[int], constraint: Constraint, *, max_new_tokens: int, seed: int | None = None,
              temperature: float = 1.0) -> list[int]:
    """The plain constrained loop: the model on the whole sequence, llguidance's mask, arg-max (or a
    draw from the row's own seeded generator, as a sampled branch draws)."""
    vocab = decoder.model.get_input_embeddings().num_embeddings
    compiled = compile_constraint(constraint, decoder.tokenizer, vocab_size=vocab, eos_id=eos_of(decoder))
    matcher = compiled.matcher.deep_copy()
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    ids, out = list(prompt), []
    for _ in range(max_new_tokens):
        with torch.inference_mode():
            logits = decoder.model(torch.tensor([ids])).logits[0, -1].float()  # [V]
        logits = logits.masked_fill(~allowed(matcher, vocab), -float("inf"))
        if generator is None:
            token = int(logits.argmax())
        else:
            scores = logits / temperature if temperature != 1.0 else logits
            token = int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
        out.append(token)
        ids.append(token)
        if token == eos_of(decoder):
            break
        assert matcher.consume_token(token)
    return out


def check_output(constraint: Constraint, text: str, finish_reason: str) -> None:
    """A finished output matches its constraint whole (a JSON one parses and validates)."""
    if finish_reason != "stop":
        return
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(constraint.text))
    elif constraint.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.text, text), text


def allowed_texts(decoder, constraint: Constraint) -> list[str]:
    """What each token the constraint allows first decodes to (a lone byte of a longer character
    decodes to U+FFFD)."""
    vocab = decoder.model.get_input_embeddings().num_embeddings
    compiled = compile_constraint(constraint, decoder.tokenizer, vocab_size=vocab, eos_id=eos_of(decoder))
    return [decoder.tokenizer.decode([int(i)]) for i in allowed(compiled.matcher, vocab).nonzero().flatten()]
