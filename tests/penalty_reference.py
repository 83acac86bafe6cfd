"""The oracle of the penalty tests: plain sequential greedy decoding, forwarding the whole sequence
each step, with the definitions applied by hand in their order: repetition penalty over prompt and
output (transformers'), presence and frequency penalties over the generated tokens only
(OpenAI's), then the logit bias."""

from __future__ import annotations

from collections import Counter

import torch

from multidecode.sampling_params import SamplingParams


def reference(model, prompt: list[int], params: SamplingParams, steps: int, eos=()) -> list[int]:
    """Sequential greedy decoding with the definitions applied by hand, one token at a time, up to
    `steps` tokens or an eos (kept)."""
    ids, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()  # [vocab]
        if params.repetition_penalty:
            for t in set(ids):
                logits[t] = logits[t] * params.repetition_penalty if logits[t] < 0 else logits[t] / params.repetition_penalty
        for t, count in Counter(out).items():  # generated tokens only
            logits[t] -= (params.presence_penalty or 0.0) * (count > 0) + (params.frequency_penalty or 0.0) * count
        for t, bias in params.logit_bias or ():
            logits[t] += bias
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out
