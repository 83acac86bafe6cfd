"""Parallel completions: n continuations of one prompt from one prefill.

The prompt is prefilled once; n branches start from its last node and are sampled side by side,
each with its own seeded generator. With `seed=s`, completion i uses seed `s + i` and equals the
n=1 run with that seed. Without a seed, a random base seed is drawn and reported, so every
completion can still be reproduced. When n branches would not fit in memory at once (their
visibility rows grow with n squared, see `multidecode.memory`), they run in waves of as many as
fit, each completion still drawn with its own seed: the same completions, only later.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from ..branches import (
    Branch,
    BranchRun,
    DecodeStats,
    TokenEvent,
    check_fits,
    check_memory,
    memory_need,
    start_prompts,
    token_ids,
)
from ..branches import start as start_branches
from ..constraints import per_branch
from ..engine import Engine
from ..errors import InvalidArgument, InvalidInput, check_positive
from ..memory import budget_bytes, most_branches
from ..prompts import has_chat_template, render_prompt, require_tokenizer, tokenize_prompt
from ..sampling_params import SamplingParams, check_vocabulary, per_branch_sampling
from ..scheduler import Scheduler
from ..speculation import Speculation, build_speculation


@dataclass(frozen=True)
class Completion:
    """One completion. seed is the seed its branch drew with (None when greedy); stats describes
    the whole run it came from (forwards, tokens per forward, drafts; see `DecodeStats`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    seed: int | None
    prompt_ids: list[int]
    stats: dict = field(default_factory=dict, compare=False, repr=False)
    parsed: object = None  # held to a JSON schema or object: the text's JSON value (None: cut short)
    matched: bool | None = None  # held to a constraint: whether the text matches it whole (None: free)
    logprobs: list[float] | None = None  # with logprobs=k: each token's log-probability (see `TokenEvent`)
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None  # and the k likeliest (id, log-prob) at its step

    @property
    def logprob(self) -> float | None:
        """The completion's log-probability under the model (its tokens' summed; None without logprobs=):
        to rank completions by, or, divided by its length, to compare ones of different lengths."""
        return None if self.logprobs is None else sum(self.logprobs)


def prompt_ids(tokenizer, prompt: str | Sequence[int], *, chat: bool | None = None) -> list[int]:
    """Token ids of a prompt: text (through the chat template when the tokenizer has one, unless
    chat=False) or ids given directly."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidInput("the prompt is empty", "pass some text to complete")
        require_tokenizer(tokenizer)
        if chat is not None and not isinstance(chat, bool):
            raise InvalidArgument(f"chat must be True, False or None, got {chat!r}",
                                  "None (the default) uses the chat template where the tokenizer has one")
        use_chat = has_chat_template(tokenizer) if chat is None else chat
        if use_chat and not has_chat_template(tokenizer):
            raise InvalidInput("this tokenizer has no chat template", "pass chat=False (--no-chat) to complete raw text")
        if use_chat:
            return tokenize_prompt(tokenizer, render_prompt(tokenizer, prompt))
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    ids = token_ids(prompt, None, "a prompt that is not text")
    if not ids:
        raise InvalidInput("the prompt has no tokens", "pass some token ids or text")
    return ids


def sampled_settings(sampling: dict) -> dict:
    """Sampling on by default (a random base seed is drawn where none is given: see
    `sampling_params.per_branch_sampling`)."""
    return {"do_sample": True, **sampling}


# ---------------------------------------------------------------------- waves
def wave_size(engine: Engine, prompt_length: int, n: int, max_new_tokens: int, draft: int,
              budget: int | None = None) -> int:
    """How many of n branches of one prompt fit in `budget` bytes at once (None: what the
    machine has now; n when all of them do); refuses (`NotEnoughMemory`) when not even one does."""
    budget = budget_bytes(engine.device) if budget is None else budget

    def fits(width: int) -> bool:
        return memory_need(engine, prompt_length, [0] * width, max_new_tokens, draft).total <= budget

    if fits(n):
        return n
    size = most_branches(fits, n)
    if not size:
        check_memory(engine, prompt_length, [0], max_new_tokens, draft, budget, asked=n)
    return size


class Waves:
    """n branches of one prompt decoded at most `size` at a time, for when all of them at once
    would not fit in memory (see `memory`). Each wave is a `BranchRun` on the same scheduler; the
    prompt is fed once and kept for the later waves, which hang under it (its last token fed
    again, for its logits). Branch i keeps its own sampling settings and seed, so its tokens are
    the ones it gets in one forest; `events`, `branches` and `prompts` use global indices.
    Waves start lazily, as `events` is iterated.

    budget: the bytes every wave is checked against (default: what the machine has when the first
    starts). One budget for all: the memory a wave frees stays with this process (its allocator
    keeps it for the next wave), so the machine's free memory, measured again, would read lower
    than what the next wave really has."""

    def __init__(self, scheduler: Scheduler, prompt: Sequence[int], sampling: Sequence[SamplingParams], size: int,
                 *, budget: int | None = None, **settings) -> None:
        self.scheduler, self.prompt, self.sampling, self.size = scheduler, list(prompt), list(sampling), size
        budget = budget_bytes(scheduler.engine.device) if budget is None else budget
        self.settings = {**settings, "memory_budget": budget}
        self.runs: list[tuple[int, BranchRun]] = []  # (index of its first branch, run), in order
        self._keeper = object()  # owns the prompt's nodes, so no wave's compaction frees them
        self._next(0)

    def _next(self, offset: int) -> BranchRun:
        sampling = self.sampling[offset : offset + self.size]
        settings = dict(self.settings)
        if isinstance(settings.get("constraint"), (list, tuple)):  # one per completion: this wave's
            settings["constraint"] = settings["constraint"][offset : offset + self.size]
        if not self.runs:
            spec = self.settings.get("speculate")
            # room for every wave: the prompt, its last token fed again, a wave's branches
            self.scheduler.engine.reserve(len(self.prompt) + 1 + self.size * (
                self.settings["max_new_tokens"] + (spec.size if isinstance(spec, Speculation) else 0)))
            run = start_branches(self.scheduler, self.prompt, [[]] * len(sampling), sampling=sampling,
                                 prompt_owner=self._keeper, **settings)
        else:
            self.scheduler.free_retired()  # the wave before's slots, before this one's need is counted
            end = self.runs[0][1].group.prompt_ends[0]
            run = start_branches(self.scheduler, self.prompt[-1:], [[]] * len(sampling), sampling=sampling,
                                 under=self.scheduler.engine.forest.parents[end], cached=self.prompt[:-1],
                                 **settings)
        self.runs.append((offset, run))
        return run

    @property
    def engine(self) -> Engine:
        return self.scheduler.engine

    @property
    def branches(self) -> list[Branch]:
        return [replace(b, index=offset + b.index) for offset, run in self.runs for b in run.branches]

    @functools.cached_property
    def prompts(self) -> list[list[int]]:
        return [list(self.prompt) for _ in self.sampling]  # made once: n lists

    @property
    def stats(self) -> DecodeStats:
        return DecodeStats.total([run.stats for _, run in self.runs])

    @property
    def events(self) -> Iterator[TokenEvent]:
        offset, run = self.runs[0]
        while True:
            for event in run.events:
                yield replace(event, branch=offset + event.branch)
            offset += self.size
            if offset >= len(self.sampling):
                return
            run = self._next(offset)

    def finish(self) -> Waves:
        for _ in self.events:
            pass
        return self


# ---------------------------------------------------------------------- completions
def start(scheduler: Scheduler, tokenizer, prompt: str | Sequence[int], *, n: int = 1, max_new_tokens: int = 64,
          stop: Sequence[str] = (), chat: bool | None = None, sample: bool = True, speculate=None,
          eos_token_id=None, constraint=None, logprobs: int | None = None, **sampling) -> BranchRun | Waves:
    """Admit n branches of one prompt to `scheduler` and prefill it once; when the n branches
    would not fit in memory at once, they run in `Waves` of as many as fit.

    sample: sample by default (a random base seed when none is given); False keeps the given
    settings as they are (greedy unless they ask for sampling), as `generate` does. constraint:
    a `constraints.Constraint` every completion follows (or a list of n). logprobs: each token's
    log-probability and the `logprobs` likeliest at its step, in the events and the completions.
    """
    check_positive("n", n)
    check_positive("max_new_tokens", max_new_tokens)  # here too: the waves' memory check reads it first
    ids = prompt_ids(tokenizer, prompt, chat=chat)
    params = per_branch_sampling(n, sampled_settings(sampling) if sample else sampling)
    engine = scheduler.engine
    check_vocabulary(params, engine.vocab_size)  # the checks of `branches.start`, in its order,
    check_fits(engine, [len(ids)], max_new_tokens)  # before the memory the waves would take
    spec = build_speculation(speculate, engine.dtype, exact=engine.exact)
    settings = {"max_new_tokens": max_new_tokens, "tokenizer": tokenizer, "stop": stop, "eos_token_id": eos_token_id,
                "speculate": spec, "constraint": constraint, "logprobs": logprobs}
    budget = budget_bytes(engine.device)
    size = wave_size(engine, len(ids), n, max_new_tokens, 0 if spec is None else spec.size, budget=budget)
    if size < n:  # too many to hold at once: in waves, each completion still drawn with its own seed
        settings["constraint"] = per_branch(n, constraint) if isinstance(constraint, (list, tuple)) else constraint
        return Waves(scheduler, ids, params, size, budget=budget, **settings)
    return start_prompts(scheduler, [ids] * n, sampling=params, memory_budget=budget, **settings)


def stream(scheduler: Scheduler, tokenizer, prompt, **settings) -> Iterator[TokenEvent]:
    return start(scheduler, tokenizer, prompt, **settings).events


def completions(run: BranchRun | Waves) -> list[Completion]:
    stats, prompts = run.stats.as_dict(), run.prompts  # each once: `Waves.prompts` builds n lists
    return [
        Completion(b.index, b.output.text, b.output.token_ids, b.output.finish_reason, b.seed, prompts[b.index], stats,
                   b.parsed, b.matched, b.logprobs, b.top_logprobs)
        for b in run.branches
    ]


def complete(scheduler: Scheduler, tokenizer, prompt, **settings) -> list[Completion]:
    return completions(start(scheduler, tokenizer, prompt, **settings).finish())
