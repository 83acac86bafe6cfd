"""Beam search with the beams as branches of one tree over one shared KV cache.

The prompt is prefilled once. Every step scores the continuations of all running beams, keeps
the best `num_beams` of them, and feeds their tokens *as children of their source beams' leaves*
in one forward pass. Two beams that share a history share its nodes, so the prompt and every
common stretch of generated tokens are stored once, never copied per beam (transformers keeps
one cache row per beam and reorders, i.e. copies, the whole cache at every step). Beams that are
dropped stop being fed at once; their slots are compacted out of the cache when enough of it is
dead (`CompactionPolicy`). Finished hypotheses need no cache: a finished beam is its leaf node
plus the one token that finished it.

The search follows transformers' `generate(num_beams=B, do_sample=False)` (version 5.x) rule for
rule, so its sequences and scores equal what `generate` returns for the same model and prompt:

- each step: log_softmax of the float32 logits of the running beams, plus each beam's running
  score; the top K = max(2, 1 + number of eos ids) * B of all B * vocab candidates;
- a candidate *hits* when its token is an eos id or the sequence reaches max_length
  (prompt + max_new_tokens). Hits among the first B candidates become finished hypotheses with
  score = (sum of log-probs) / (generated length, eos included) ** length_penalty; hits ranked
  B or later are dropped. The best B finished hypotheses are kept, merged as `generate` merges
  them every step (the kept B, then this step's K, ranked by one topk: equal scores, which a
  quantized model gives, rank alike);
- the next running beams are the first B candidates that did not hit, with their raw scores;
- the search stops at max_length, or once B hypotheses are finished and `early_stopping` is True,
  or (False / "never") when the best running beam can no longer beat the worst finished one by
  transformers' heuristic.

Scores agree with `generate` to about 1e-6 (log-probs computed over a different cache layout
sum in a different order), which is why tests compare sequences exactly and scores to 1e-5.
`generate` also applies the processors in the model's generation config (repetition_penalty,
no_repeat_ngram_size, ...); this search applies none, so the equality holds for configs that set
none (or when `generate` is given neutral values for them). For num_beams=1 `generate` runs greedy
search, and so does this: each step's one candidate is the arg-max of the logits (the lowest id
among equal ones, which bfloat16 and 4-bit logits often hold), and the search stops at the first
finished hypothesis, whatever `early_stopping` says (its score is still the beam score).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..branches import check_fits, check_memory, token_ids
from ..engine import Engine, EngineStats, FeedResult
from ..errors import InvalidArgument, InvalidInput, check_positive
from ..forest import ROOT
from ..scheduler import CompactionPolicy, Feed, Scheduler, Settled, Work, new_scheduler
from ..stopping import LENGTH, STOP, eos_ids_of
from .complete import prompt_ids


@dataclass(frozen=True)
class Beam:
    """One returned hypothesis, best first.

    token_ids: the generated ids (the eos that ended it included); score: transformers'
    `sequences_scores` value (sum of log-probs over the generated tokens divided by their number
    to the power length_penalty); finish_reason: "stop" (ended on eos) or "length".
    """

    index: int
    token_ids: list[int]
    score: float
    text: str
    finish_reason: str
    prompt_ids: list[int]


@dataclass
class BeamSearchRun:
    """A finished search: its beams (best first), the engine it ran on, and how many steps it took."""

    beams: list[Beam]
    engine: Engine
    steps: int
    prompt_ids: list[int]

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats


@dataclass
class _Hypothesis:
    score: torch.Tensor  # 0-dim float32, length-penalized
    leaf: int  # the node it grew from (the prompt's last node on the first step)
    token: int  # the token that finished it (never fed to the model)


def check_settings(num_beams, max_new_tokens, length_penalty, early_stopping, num_return_sequences) -> None:
    check_positive("num_beams", num_beams)
    check_positive("max_new_tokens", max_new_tokens)
    check_positive("num_return_sequences", num_return_sequences)
    if num_return_sequences > num_beams:
        raise InvalidArgument(
            f"num_return_sequences ({num_return_sequences}) is more than num_beams ({num_beams})",
            f"return at most {num_beams} sequences, or search with more beams",
        )
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or \
            not torch.isfinite(torch.tensor(float(length_penalty))):
        raise InvalidArgument(f"length_penalty must be a finite number, got {length_penalty!r}",
                              "use 1.0 (the default); > 0 favours longer sequences, < 0 shorter ones")
    if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
        raise InvalidArgument(f"early_stopping must be True, False or 'never', got {early_stopping!r}",
                              "as in transformers' GenerationConfig")


class BeamWork(Work):
    """One beam search as scheduler work: the prompt first, then each step the beams' next tokens
    under their source leaves; `settle` applies the selection rule (see the module notes)."""

    def __init__(self, prompt: list[int], *, num_beams: int, max_new_tokens: int, length_penalty: float,
                 early_stopping: bool | str, eos: frozenset[int]) -> None:
        self.prompt, self.eos = prompt, eos
        self.B, self.P = num_beams, len(prompt)
        self.K = max(2, 1 + len(eos)) * num_beams
        self.max_length = self.P + max_new_tokens
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.done = False
        self.start: int | None = None  # the prompt's last node
        self.leaves: list[int] = []
        # transformers starts with B copies of the prompt scored [0, -1e9, ...]; the copies share one
        # node here, and the -1e9 scores keep every first-step candidate on the first copy.
        self.scores = torch.full((num_beams,), -1e9, dtype=torch.float32)  # [B] each beam's summed log-prob
        self.scores[0] = 0.0
        # transformers' finished beams: B slots scored -1e9 until hypotheses fill them
        self.finished: list[_Hypothesis | None] = [None] * num_beams
        self.finished_scores = torch.full((num_beams,), -1e9, dtype=torch.float32)  # [B], best first
        self.cur_len, self.steps = self.P, 0
        self.parents: list[int] = []
        self.next_tokens: list[int] = []

    def plan(self) -> Feed:
        feed = Feed()
        if self.start is None:
            for i, token in enumerate(self.prompt):
                feed.add(token, ROOT if i == 0 else Feed.ref(i - 1), logits=i == self.P - 1)
        else:
            for token, parent in zip(self.next_tokens, self.parents):
                feed.add(token, parent)
        return feed

    def settle(self, fed, result: FeedResult[list[int]]) -> Settled:
        if self.start is None:
            self.start = result.nodes[-1]
            self.leaves = [self.start] * self.B
        else:
            self.leaves = list(result.nodes)
        B, K, P = self.B, self.K, self.P
        self.steps += 1
        # on the CPU, where the running scores live (a GPU's logits come over once per step)
        log_probs = torch.log_softmax(result.logits.to("cpu", torch.float32), dim=-1)  # [1 or B, V]
        vocab = log_probs.shape[-1]
        log_probs = log_probs.expand(B, vocab) if log_probs.shape[0] == 1 else log_probs  # [B, V]
        # The K best (beam, token) pairs over all beams: scores [B] + log_probs [B, V], flattened to
        # one row, as transformers selects them (the same call, so equal scores tie alike). One beam
        # is greedy search, as `generate` runs it: the arg-max of the logits, the lowest id among
        # equal ones (which bfloat16 and 4-bit logits often hold; topk returns either).
        scores = (log_probs + self.scores[:, None]).reshape(1, -1)  # [1, B * V]
        if B == 1:  # its one candidate: a hit ends the search, else it runs on
            top_index = result.logits[-1].float().argmax().view(1).cpu()  # [1]: the first of equal maxima
            top_scores = scores[0, top_index]  # [1]
        else:
            top_scores, top_index = torch.topk(scores, k=K)
            top_scores, top_index = top_scores[0], top_index[0]  # [K], [K]
        sources = (top_index // vocab).tolist()
        tokens = (top_index % vocab).tolist()
        at_max = self.cur_len + 1 >= self.max_length
        hits = [at_max or t in self.eos for t in tokens]

        self._merge_finished(top_scores, sources, tokens, hits)
        self.cur_len += 1
        if at_max:
            self.done = True
            return Settled()
        # the B best that did not end, chosen as transformers chooses them (ended ones pushed down by 1e9)
        running = top_scores + torch.tensor(hits, dtype=torch.float32) * -1.0e9  # [K]
        keep = torch.topk(running[None], k=B)[1][0].tolist()
        self.scores = top_scores[keep]
        self.parents = [self.leaves[sources[j]] for j in keep]
        self.next_tokens = [tokens[j] for j in keep]
        if None not in self.finished:
            if self.early_stopping is True or B == 1:
                self.done = True
                return Settled()
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_length = self.max_length - P
            else:
                best_length = self.cur_len - P
            if not bool(self.scores[0] / (best_length ** self.length_penalty) > self.finished_scores[-1]):
                self.done = True
                return Settled()
        # a beam left behind: its slots may be dead
        return Settled(dead=not set(self.leaves) <= set(self.parents))

    def _merge_finished(self, top_scores: torch.Tensor, sources: list[int], tokens: list[int], hits: list[bool]) -> None:
        """This step's hits among the first B candidates join the finished beams, as transformers'
        `_update_finished_beams` merges them: [kept B, K candidates (length-penalized; -1e9 added
        to those that did not finish)] ranked by one topk of B."""
        B, K = self.B, len(tokens)
        penalized = finished_scores(top_scores, self.cur_len + 1 - self.P, self.length_penalty)  # [K]
        finishing = [j < B and hits[j] for j in range(K)]
        candidates = penalized + torch.tensor([not f for f in finishing], dtype=torch.float32) * -1.0e9
        merged = torch.cat((self.finished_scores, candidates))[None]  # [1, B + K]
        keep = torch.topk(merged, k=B)[1][0].tolist()
        slots = self.finished + [_Hypothesis(penalized[j], self.leaves[sources[j]], tokens[j]) if finishing[j] else None
                                 for j in range(K)]
        self.finished, self.finished_scores = [slots[i] for i in keep], merged[0, keep]

    def live(self) -> list[int]:
        return sorted(set(self.parents))

    def beams(self, engine: Engine, tokenizer=None, count: int = 1) -> list[Beam]:
        """The best `count` finished hypotheses, best first (read from the forest, so before the
        work's slots are freed: its nodes stay in the tree as history)."""
        return [_beam(i, h, engine, self.start, self.prompt, self.eos, tokenizer)
                for i, h in enumerate([h for h in self.finished if h is not None][:count])]


def run_beam_search(
    model,
    prompt_ids: Sequence[int],
    *,
    num_beams: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
    eos_token_id: int | Sequence[int] | None = None,
    tokenizer=None,
    compaction: CompactionPolicy | None = None,
    engine: Engine | None = None,
    scheduler: Scheduler | None = None,
) -> BeamSearchRun:
    """Beam search from `prompt_ids` on `model`; equals `model.generate(num_beams=num_beams,
    do_sample=False, ...)` with the same settings (see the module notes).

    eos_token_id: the ids that end a beam (default: all of the model's generation config ids).
    tokenizer: used only to fill each `Beam.text`.
    compaction: when dropped beams' slots leave the cache (default: a quarter of it dead).
    engine, scheduler: run on this engine or scheduler (a fresh one by default); the engine's stats
        count this search. Compaction acts on the search's own nodes only.
    """
    check_settings(num_beams, max_new_tokens, length_penalty, early_stopping, num_return_sequences)
    scheduler = scheduler or new_scheduler(model, engine=engine, compaction=compaction)
    engine = scheduler.engine
    prompt = token_ids(prompt_ids, engine.vocab_size)
    if not prompt:
        raise InvalidInput("the prompt has no tokens", "pass some token ids or text")
    check_fits(engine, [len(prompt)], max_new_tokens)
    check_memory(engine, len(prompt), [0] * num_beams, max_new_tokens, 0,  # the beams as branches of the prompt
                 fewer="lower num_beams to {fit}")
    eos = eos_ids_of(engine.model, eos_token_id)
    engine.reserve(engine.forest.num_slots + len(prompt) + num_beams * (max_new_tokens - 1))
    work = BeamWork(prompt, num_beams=num_beams, max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                    early_stopping=early_stopping, eos=eos)
    scheduler.admit(work)
    scheduler.run(work)
    return BeamSearchRun(work.beams(engine, tokenizer, num_return_sequences), engine, work.steps, prompt)


def finished_scores(top_scores: torch.Tensor, generated: int, length_penalty: float) -> torch.Tensor:
    """transformers' score of a finished hypothesis: its summed log-probs over
    (generated tokens, eos included) ** length_penalty."""
    return top_scores / (generated ** length_penalty)


def _beam(index: int, hyp: _Hypothesis, engine: Engine, start: int, prompt: list[int], eos, tokenizer) -> Beam:
    forest = engine.forest
    generated: list[int] = []
    node = hyp.leaf
    while node != start:
        generated.append(forest.tokens[node])
        node = forest.parents[node]
    generated = generated[::-1] + [hyp.token]
    text = ""
    if tokenizer is not None:
        text = tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    reason = STOP if hyp.token in eos else LENGTH
    return Beam(index, generated, float(hyp.score), text, reason, list(prompt))


def search(scheduler: Scheduler, tokenizer, prompt: str | Sequence[int], *, num_beams: int, max_new_tokens: int,
           length_penalty: float = 1.0, early_stopping: bool | str = False, num_return_sequences: int = 1,
           chat: bool | None = None, eos_token_id: int | Sequence[int] | None = None) -> BeamSearchRun:
    """`run_beam_search` on `scheduler` for a text (chat-templated unless chat=False) or ids prompt."""
    check_settings(num_beams, max_new_tokens, length_penalty, early_stopping, num_return_sequences)
    ids = prompt_ids(tokenizer, prompt, chat=chat)
    return run_beam_search(scheduler.engine.model, ids, num_beams=num_beams, max_new_tokens=max_new_tokens,
                           length_penalty=length_penalty, early_stopping=early_stopping,
                           num_return_sequences=num_return_sequences, eos_token_id=eos_token_id,
                           tokenizer=tokenizer, scheduler=scheduler)


def beam_search(scheduler: Scheduler, tokenizer, prompt: str | Sequence[int], **settings) -> list[Beam]:
    """The `num_return_sequences` best hypotheses, best first (settings as for `search`)."""
    return search(scheduler, tokenizer, prompt, **settings).beams
