"""Decoding independent branches over one forest: the loop most strategies share.

A **branch** is a prompt path in the forest (a shared prefix plus its own suffix) that grows by
one token per step. Each step picks one token for every live branch, emits an event for it, and
feeds the tokens of the branches that go on as children of their leaves, in one forward pass.
Finished branches are no longer fed; once enough of the cache belongs only to finished branches,
it is compacted.

`decode` is the model-level entry point: with `do_sample=False`, branch i's ids equal what
`model.generate(prefix_ids + branch_ids[i], do_sample=False, ...)` returns after the prompt.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .engine import Engine
from .errors import InvalidArgument, InvalidInput, PromptTooLong, is_int
from .forest import ROOT
from .prompts import share_prefix
from .sampling import BranchSampler, SamplingParams, choose_tokens, per_branch_sampling
from .stopping import BranchOutput, StopRule, eos_ids_of, stop_strings_of


@dataclass(frozen=True)
class TokenEvent:
    """One token produced by one branch.

    text is the text delta this token made certain ("" without a tokenizer, or while held back);
    finish_reason is None while the branch goes on, else "stop" or "length".
    """

    branch: int
    token_id: int
    text: str
    finish_reason: str | None = None


@dataclass(frozen=True)
class CompactionPolicy:
    """When to drop finished branches' slots from the cache.

    Compact once at least `min_slots` slots and `min_fraction` of the cache belong only to finished
    branches; `every` forces a compaction every that many steps (tests use it).
    """

    min_fraction: float = 0.25
    min_slots: int = 32
    every: int | None = None

    def due(self, step: int, dead: int, total: int) -> bool:
        if self.every is not None and step % self.every == 0:
            return dead > 0
        return dead >= self.min_slots and dead >= self.min_fraction * total


@dataclass
class Branch:
    """A growing branch: where it ends in the forest, how it samples, and what it has produced."""

    index: int
    leaf: int
    sampler: BranchSampler
    output: BranchOutput
    prompt_length: int


def check_positive(name: str, value: int) -> None:
    if not is_int(value) or value < 1:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}", "use 1 or more")


def token_ids(ids, vocab_size: int, what: str = "a prompt") -> list[int]:
    """`ids` (a sequence or 1-d tensor of ints) as a list, each checked against the vocabulary."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise InvalidInput(f"{what} must be a 1-d sequence of token ids, got a tensor of shape "
                               f"{tuple(ids.shape)}", "pass one list of ints per prompt")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(is_int(t) for t in ids):
        raise InvalidInput(f"{what} must be a sequence of token ids (ints), got {_preview(ids)}",
                           "tokenize text first, and pass one list of ints per prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidInput(f"{what} has token id {bad[0]}, outside the model's vocabulary of "
                           f"{vocab_size}", "tokenize with this model's tokenizer")
    return [int(t) for t in ids]


def _preview(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fits(engine: Engine, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
    """Refuse prompts that, with their new tokens, need more positions than the model has."""
    limit = engine.max_positions
    if limit is None:
        return
    longest = max(prompt_lengths)
    if longest > limit:
        raise PromptTooLong(
            f"the prompt is {longest} tokens long but the model takes at most {limit} positions",
            "shorten the document or split it into chunks",
        )
    if longest + max_new_tokens > limit:
        raise PromptTooLong(
            f"the prompt is {longest} tokens and max_new_tokens is {max_new_tokens}, "
            f"more than the model's {limit} positions",
            f"lower max_new_tokens to {limit - longest} or shorten the document",
        )


def open_branches(
    engine: Engine, prefix_ids: Sequence[int], suffixes: Sequence[Sequence[int]], *, root_position: int = 0,
    apart: bool | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Prefill a shared prefix (model's causal path) and the branch suffixes: in one forest pass,
    or each in its own pass that sees only the prefix (`Engine.feed_apart`, cheaper for long
    suffixes). apart=None lets the engine choose (`Engine.prefers_apart`).

    Returns each branch's leaf node and its next-token logits [K, vocab]. With an empty prefix each
    suffix is its own root.
    """
    empty = [i for i, s in enumerate(suffixes) if not s]
    parent = ROOT
    prefix_logits = None
    if prefix_ids:
        nodes, prefix_logits = engine.feed_chain(prefix_ids, root_position=root_position, logits=bool(empty))
        parent = nodes[-1]
    elif empty:
        raise InvalidInput("a branch has no tokens and there is no prefix to continue", "give every branch a prompt")
    filled = [i for i, s in enumerate(suffixes) if s]
    if apart is None:
        apart = engine.prefers_apart([len(suffixes[i]) for i in filled], parent)
    if apart:
        chains, suffix_logits = engine.feed_apart([suffixes[i] for i in filled], parent, root_position=root_position)
    else:
        chains, suffix_logits = engine.feed_chains(
            [suffixes[i] for i in filled], [parent] * len(filled), root_position=root_position
        )
    leaves: list[int] = [parent] * len(suffixes)
    rows: list[torch.Tensor] = [None] * len(suffixes)  # type: ignore[list-item]
    for j, i in enumerate(filled):
        leaves[i], rows[i] = chains[j][-1], suffix_logits[j]
    for i in empty:
        rows[i] = prefix_logits[0]
    return leaves, torch.stack(rows)


def run_branches(
    engine: Engine, branches: list[Branch], logits: torch.Tensor, *, compaction: CompactionPolicy | None = None
) -> Iterator[TokenEvent]:
    """Decode `branches` step by step from their first logits ([K, vocab]), yielding events."""
    compaction = compaction or CompactionPolicy()
    live = [b for b in branches if not b.output.finished]
    rows = logits
    step = 0
    dead_since_compaction = False
    while live:
        step += 1
        tokens = choose_tokens(rows, [b.sampler for b in live])
        going: list[tuple[Branch, int]] = []
        for branch, token in zip(live, tokens):
            delta = branch.output.accept(token)
            yield TokenEvent(branch.index, token, delta, branch.output.finish_reason)
            if branch.output.finished:
                dead_since_compaction = True
            else:
                going.append((branch, token))
        if not going:
            return
        if dead_since_compaction and engine.compact_if_due(
            [b.leaf for b, _ in going], lambda dead, total: compaction.due(step, dead, total)
        ):
            dead_since_compaction = False
        nodes, rows = engine.feed(
            [t for _, t in going], [b.leaf for b, _ in going], logits_for=range(len(going))
        )
        for (branch, _), node in zip(going, nodes):
            branch.leaf = node
        live = [b for b, _ in going]


@dataclass
class PromptsRun:
    """Branches being decoded as one forest: iterate `events`; each branch's `output` fills in."""

    engine: Engine
    branches: list[Branch]
    events: Iterator[TokenEvent]
    prompts: list[list[int]] = field(default_factory=list)

    def finish(self) -> PromptsRun:
        """Drain the events (when only the final outputs are wanted)."""
        for _ in self.events:
            pass
        return self


def start_forest(
    model,
    prefix_ids: Sequence[int],
    suffixes: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sequence[SamplingParams],
    tokenizer=None,
    stop: Sequence[str] = (),
    eos_token_id=None,
    compaction: CompactionPolicy | None = None,
    engine: Engine | None = None,
    apart: bool | None = None,
) -> PromptsRun:
    """Prefill `prefix_ids` once and every branch `prefix_ids + suffixes[i]`, ready to decode.

    Inputs are checked and the prompts prefilled before this returns; tokens come as `events` is
    iterated. apart: prefill each suffix in its own pass (True), in one (False), or let the engine
    choose (None; see `open_branches`).
    """
    check_positive("max_new_tokens", max_new_tokens)
    if isinstance(suffixes, torch.Tensor):
        suffixes = list(suffixes)
    if not suffixes:
        raise InvalidInput("there are no branches to decode", "pass at least one branch")
    engine = engine or Engine(model)
    prefix_ids = token_ids(prefix_ids, engine.vocab_size, "the prefix")
    suffixes = [token_ids(s, engine.vocab_size, f"branch {i}") for i, s in enumerate(suffixes)]
    prompts = [prefix_ids + s for s in suffixes]
    check_fits(engine, [len(p) for p in prompts], max_new_tokens)
    engine.reserve(engine.forest.num_slots + len(prefix_ids) + sum(map(len, suffixes)) + len(suffixes) * max_new_tokens)
    rule = StopRule(max_new_tokens, eos_ids_of(model, eos_token_id), stop_strings_of(stop))
    leaves, logits = open_branches(engine, prefix_ids, suffixes, apart=apart)
    branches = [
        Branch(i, leaf, BranchSampler(sampling[i], prompts[i]), BranchOutput(rule, tokenizer), len(prompts[i]))
        for i, leaf in enumerate(leaves)
    ]
    return PromptsRun(engine, branches, run_branches(engine, branches, logits, compaction=compaction), prompts)


def decode_prompts(model, prompts: Sequence[Sequence[int]], **settings) -> PromptsRun:
    """`start_forest` for whole prompts: their longest common run of ids is the shared prefix, so
    branch i's path is exactly `prompts[i]`. Settings as for `start_forest`."""
    if not prompts:
        raise InvalidInput("there are no prompts to decode", "pass at least one prompt")
    vocab_size = model.get_input_embeddings().num_embeddings
    shared = share_prefix([token_ids(p, vocab_size, f"prompt {i}") for i, p in enumerate(prompts)])
    return start_forest(model, shared.prefix_ids, shared.suffix_ids, **settings)


def stream_decode(
    model, prefix_ids: Sequence[int], branch_ids: Sequence[Sequence[int]], **settings
) -> Iterator[TokenEvent]:
    """Yield events while decoding every branch `prefix_ids + branch_ids[i]` in one forest."""
    return start_forest(model, prefix_ids, branch_ids, **settings).events


def decode(
    model,
    prefix_ids: Sequence[int],
    branch_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> list[list[int]]:
    """Generate from `prefix_ids + branch_ids[i]` for every i at once; returns each branch's new ids.

    Greedy (do_sample=False) output equals per-branch `model.generate(..., do_sample=False)`,
    eos included, for a generation config that adds no logits processors of its own
    (`repetition_penalty`, `no_repeat_ngram_size`, `bad_words_ids`, ...): settings are never read
    from the model's generation config, only its eos ids. With sampling and a seed, branch i draws
    from its own generator seeded `seed + i`, so it does not depend on the other branches.
    """
    sampling = per_branch_sampling(
        len(branch_ids), dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    )
    out: list[list[int]] = [[] for _ in branch_ids]
    for event in stream_decode(
        model, prefix_ids, branch_ids, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_id=eos_token_id
    ):
        out[event.branch].append(event.token_id)
    return out
