"""What each kind of learned head learns from the target's features, and how it is measured.

A **trainee** is a head and the data it learns from, as `distill.train_loop` drives it: `module`
(what is trained and checkpointed), `loss(generator)` (one seeded batch), `evaluate()` (on the
held-out answers) and the counts that size an epoch.

- `MedusaTrainee`: head k, at position t, learns the target's distribution at t + 1 + k (the
  token k + 2 ahead) by soft cross-entropy over the draft vocabulary, weighted `DECAY ** k`.
- `EagleTrainee`: the head reads the pairs (f_t, x_{t+1}) of a whole sequence in order, its
  prompt's and then its answer's (positions from 0, as it runs on a branch that `reads_prompt`),
  and learns at each both the next feature f_{t+1} (smooth L1, EAGLE's regression) and the
  target's distribution after it (soft cross-entropy, weight `EAGLE_CLASS`); it is measured on
  the answers' pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import InvalidInput
from ..proposers.eagle import EagleHead
from ..proposers.medusa import MedusaHeads
from .features import Features

DECAY = 0.8
"""Medusa head k's loss weighs DECAY ** k (the Medusa recipe: far heads matter less, and learn less)."""
EVAL_POSITIONS = 4096
"""Held-out positions a Medusa evaluation reads."""
EAGLE_CLASS = 0.5
"""The weight of the EAGLE head's cross-entropy beside its feature regression (EAGLE-1 used 0.1;
on a small target what is accepted is the token, so it weighs more here)."""
EAGLE_SEQUENCES = 8
"""Answers per EAGLE training step."""


def soft_cross_entropy(logq: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum p log q: logq [R, V'] log-probabilities, ids [R, TOP] draft-vocabulary
    indices of the target's likeliest tokens (-1: outside it, dropped), probs [R, TOP] theirs."""
    probs = probs * (ids >= 0)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-6)
    return -(probs * logq.gather(-1, ids.clamp(min=0))).sum(-1).mean()


def draft_index(token_ids: torch.Tensor, vocab_size: int, ids: torch.Tensor) -> torch.Tensor:
    """Target token ids -> their index in the draft vocabulary `token_ids` (-1 outside it)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[token_ids.cpu()] = torch.arange(len(token_ids))
    return index[ids]


def check_enough(train_items: int) -> None:
    """Refuse a run left with nothing to learn from once the held-out prompts are set apart."""
    if train_items == 0:
        raise InvalidInput("too few prompts to train on: every answer is held out for the acceptance check, or too short",
                           "use more prompts (a larger --limit, or none) or a larger --max-new-tokens")


class MedusaTrainee:
    """Medusa heads over the target's features (see the module notes)."""

    def __init__(self, heads: MedusaHeads, data: Features, batch_positions: int) -> None:
        self.head = self.module = heads
        self.data, self.batch = data, batch_positions
        self.device = heads.shared.device
        self.draft_ids = draft_index(heads.token_ids, heads.vocab_size, data.top_ids)  # [N, TOP]
        positions = torch.arange(len(data.last))
        self.train = ((~data.holdout) & (positions < data.last)).nonzero().flatten()
        check_enough(len(self.train))
        self.steps_per_epoch = len(self.train) / self.batch
        self.positions_per_step = self.batch

    def loss(self, generator: torch.Generator) -> torch.Tensor:
        rows = self.train[torch.randint(len(self.train), (self.batch,), generator=generator)]
        logq = self.head(self.data.features[rows].to(self.device)).log_softmax(-1)  # [B, K, V']
        total = logq.new_zeros(())
        for k in range(self.head.num_heads):
            later = rows + 1 + k
            valid = later <= self.data.last[rows]  # [B]
            if valid.any():
                target = later[valid]
                total = total + DECAY**k * soft_cross_entropy(
                    logq[valid.to(self.device), k], self.draft_ids[target].to(self.device),
                    self.data.top_probs[target].to(self.device))
        return total

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Each head's top-1 agreement with the target's greedy token on held-out answers, and the
        mean accepted length of a chain of the heads' top-1 guesses."""
        data, K = self.data, self.head.num_heads
        rows = (data.holdout & data.answer & (torch.arange(len(data.last)) + K < data.last)).nonzero().flatten()
        rows = rows[:EVAL_POSITIONS]
        if not len(rows):
            return {}
        guess = self.head.token_ids.cpu()[self.head(data.features[rows].to(self.device)).argmax(-1).cpu()]  # [R, K]
        truth = torch.stack([data.top_ids[rows + 1 + k, 0] for k in range(K)], 1)  # [R, K]
        right = guess == truth
        return {"mean_accepted": round(float(right.long().cumprod(1).sum(1).float().mean()), 3),
                "head_top1": [round(float(v), 3) for v in right.float().mean(0)]}


class EagleTrainee:
    """An EAGLE head over the target's prompts and answers (see the module notes)."""

    def __init__(self, head: EagleHead, data: Features) -> None:
        self.head = head
        self.module = head  # fc and the layer train; the tied rows of the target do not
        self.data = data
        self.device = head.fc.weight.device
        self.draft_ids = draft_index(head.token_ids, head.vocab_size, data.top_ids)  # [N, TOP]
        # (the sequence's first position, its answer's, one past its last)
        self.train = [(b, a, e) for (a, e, held), b in zip(data.starts, data.begins) if not held and e - a > 1]
        self.held = [(b, a, e) for (a, e, held), b in zip(data.starts, data.begins) if held and e - a > 1]
        check_enough(len(self.train))
        pairs = sum(e - b - 1 for b, a, e in self.train)
        self.steps_per_epoch = len(self.train) / EAGLE_SEQUENCES
        self.positions_per_step = max(1, pairs // max(1, len(self.train))) * EAGLE_SEQUENCES

    def _batch(self, spans: list[tuple[int, int, int]], answers_only: bool):
        """Padded pairs of whole sequences: inputs [B, T, hidden], mask [B, T], each pair's target
        row (the position after it) [B, T] (-1 on padding), and the pairs scored [B, T] (all, or
        with `answers_only` the answers')."""
        longest = max(e - b - 1 for b, a, e in spans)
        inputs = torch.zeros(len(spans), longest, self.head.hidden_size, device=self.device)
        targets = torch.full((len(spans), longest), -1, dtype=torch.long)
        for i, (b, a, e) in enumerate(spans):
            rows = torch.arange(b, e - 1)  # pairs (f_t, x_{t+1}) for t in the prompt, then the answer
            inputs[i, : len(rows)] = self.head.inputs(self.data.features[rows].to(self.device),
                                                      self.data.tokens[rows + 1])
            targets[i, : len(rows)] = rows + 1
        scored = targets > torch.tensor([a if answers_only else b for b, a, e in spans])[:, None]
        return inputs, targets >= 0, targets, scored

    def _forward(self, spans: list[tuple[int, int, int]], *, answers_only: bool = False):
        inputs, mask, targets, scored = self._batch(spans, answers_only)
        out = self.head.model(inputs_embeds=inputs, attention_mask=mask.long().to(self.device),
                              output_hidden_states=True, use_cache=False)
        at = scored.to(self.device)
        return out.hidden_states[-1][at], out.logits[at], targets[scored]

    def loss(self, generator: torch.Generator) -> torch.Tensor:
        chosen = torch.randint(len(self.train), (EAGLE_SEQUENCES,), generator=generator).tolist()
        predicted, logits, rows = self._forward([self.train[i] for i in chosen])  # [R, hidden], [R, V'], [R]
        regression = F.smooth_l1_loss(predicted, self.data.features[rows].to(self.device))
        classes = soft_cross_entropy(logits.float().log_softmax(-1), self.draft_ids[rows].to(self.device),
                                     self.data.top_probs[rows].to(self.device))
        return regression + EAGLE_CLASS * classes

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The head's top-1 agreement with the target's greedy token at depth 1 (true features
        before it) on held-out answers."""
        if not self.held:
            return {}
        _, logits, rows = self._forward(self.held[:EAGLE_SEQUENCES * 4], answers_only=True)
        guess = self.head.token_ids.cpu()[logits.argmax(-1).cpu()]
        return {"head_top1": [round(float((guess == self.data.top_ids[rows, 0]).float().mean()), 3)]}
