"""Independent branches on the scheduler: the work most strategies share.

A **branch** is a prompt path in the forest (a shared prefix plus its own suffix) that grows as
tokens are chosen for it. Its **head** is its newest token: chosen and emitted, not yet fed. Each
step a `BranchGroup` feeds every live branch's head under the branch's **leaf** (its last cached
node), with a draft tree under the head when the run speculates; `verify.walk` then emits the
target's tokens and accepts the draft nodes that match them, and the rest are taken back. A
branch so gains one token per step without speculation, and one plus the accepted drafts with it.
Finished branches are no longer fed; once enough of the cache belongs only to finished branches,
the scheduler compacts it.

A driver that paces prefill (the runtime, so that streams already decoding keep their pace)
gives a group a budget of prompt tokens per step (`BranchGroup.pace_prompt`): a prompt over it
is fed in pieces of its shared prefix, each a chain under the last piece's last node, which is
how a cached prefix is continued; the logits come with the last piece, exactly as if the prompt
had been fed whole.

This is the branch half of a step (the scheduler is the other): `admit` checks inputs and adds a
`BranchGroup` to a scheduler, `start` also feeds its prompts, and a `BranchRun` yields its
`TokenEvent`s as the scheduler steps. The entry points that build a scheduler for a model
(`decode`, `MultiDecoder`) are in `api`; the strategies build on `start`.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .constraints import FORCED, FORCED_LIMIT, Compiled, GrammarState, allowed_nodes, compile_for_branches, per_branch
from .cost import AcceptanceTracker
from .engine import Engine, FeedResult
from .errors import InvalidArgument, InvalidInput, PromptTooLong, as_list, check_positive, is_int
from .forest import ROOT, local_parent
from .memory import ENVIRONMENT, Need, budget_bytes, check_budget, most_branches, setting_text
from .models.vetting import positions_note
from .prompts import share_prefix
from .proposers import UNDER_LEAF, BranchContext, DraftTree
from .proposers.mixture import Mixture
from .sampling import BranchSampler
from .sampling_params import SamplingParams, check_vocabulary
from .scheduler import Feed, Scheduler, Settled, Work
from .speculation import Speculation, build_speculation
from .stopping import LENGTH, BranchOutput, StopRule, eos_ids_of, stop_strings_of
from .verify import walk


@dataclass(frozen=True)
class TokenEvent:
    """One token produced by one branch.

    text is the text delta this token made certain ("" without a tokenizer, or while held back);
    finish_reason is None while the branch goes on, else "stop" or "length". When the run asks
    for log-probabilities, logprob is the token's under the model's raw distribution and
    top_logprobs the likeliest (token id, log-probability) pairs there, best first. offset: the
    characters of the branch's text before this token, as decoded, whether or not it was handed
    out yet (text held back for a stop string counts), so a token's place in the text is known
    while its own text is still held.
    """

    branch: int
    token_id: int
    text: str
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    offset: int = 0


@dataclass
class Branch:
    """A growing branch: where it ends in the forest, how it samples, and what it has produced."""

    index: int
    sampler: BranchSampler
    output: BranchOutput
    context: BranchContext
    leaf: int | None = None  # its last cached node (None until its prompt is fed)
    head: int | None = None  # its newest token, emitted but not yet fed
    logprobs: list[float] | None = None  # each token's log-probability, where the run asks for them
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None  # and the likeliest at its step

    @property
    def prompt_length(self) -> int:
        return self.context.prompt_length

    @property
    def seed(self) -> int | None:
        """The seed this branch draws with (None when it is greedy)."""
        return self.sampler.params.seed if self.sampler.params.do_sample else None

    @property
    def matched(self) -> bool | None:
        """Whether an output held to a constraint matches it whole (None without one): its grammar
        complete, and its text not cut by a stop string. Not when max_new_tokens came first."""
        grammar = self.sampler.grammar
        if grammar is None:
            return None
        return grammar.matched and not self.output.cut_by_stop_string

    @property
    def cut_short(self) -> bool:
        """Held to a constraint, and ended by max_new_tokens before matching it whole."""
        return self.matched is False and self.output.finish_reason == LENGTH

    @property
    def parsed(self):
        """The JSON value of an output held to a JSON schema or object, where it matched it whole
        (`matched`): so it always satisfies the schema. None otherwise: no JSON constraint, or cut
        at max_new_tokens or by a stop string (even where the part left parses: "100" of an
        integer that had to reach 1000000)."""
        if not self.matched:
            return None
        return self.sampler.grammar.compiled.constraint.parse(self.output.text)


@dataclass
class DecodeStats:
    """What a run did: forwards it took part in, tokens it emitted, drafts fed and accepted.

    forward_passes counts the model calls of the steps this run took part in (one per step, more
    when a prefill ran chains apart), whoever drove the scheduler; draft_budgets holds, per step,
    the draft nodes fed.
    """

    steps: int = 0
    forward_passes: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_budgets: list[int] = field(default_factory=list)
    speculate: str | None = None
    forced: int = 0  # of the drafts fed, the tokens a grammar forced (jump-forward)

    @classmethod
    def total(cls, parts: Sequence[DecodeStats]) -> DecodeStats:
        """The stats of runs one after the other (the waves of one request)."""
        return cls(sum(p.steps for p in parts), sum(p.forward_passes for p in parts), sum(p.tokens for p in parts),
                   sum(p.drafted for p in parts), sum(p.accepted for p in parts),
                   [b for p in parts for b in p.draft_budgets], parts[0].speculate if parts else None,
                   sum(p.forced for p in parts))

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def as_dict(self) -> dict:
        budgets = self.draft_budgets
        return {
            "speculate": self.speculate,
            "steps": self.steps,
            "forward_passes": self.forward_passes,
            "tokens": self.tokens,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "drafted": self.drafted,
            "forced": self.forced,
            "accepted": self.accepted,
            "acceptance": None if self.acceptance is None else round(self.acceptance, 4),
            "mean_draft_budget": round(sum(budgets) / len(budgets), 3) if budgets else 0.0,
            "steps_speculating": sum(1 for b in budgets if b),
        }


# ---------------------------------------------------------------------- checks
def token_ids(ids, vocab_size: int | None, what: str = "a prompt") -> list[int]:
    """`ids` (a sequence or 1-d tensor of ints) as a list, each checked against the vocabulary
    (vocab_size None: ints, whatever their range)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise InvalidInput(f"{what} must be a 1-d sequence of token ids, got a tensor of shape "
                               f"{tuple(ids.shape)}", "pass one list of ints per prompt")
        ids = ids.tolist()
    elif hasattr(ids, "tolist") and hasattr(ids, "dtype"):  # a NumPy array of ids
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(is_int(t) for t in ids):
        raise InvalidInput(f"{what} must be a sequence of token ids (ints), got {_preview(ids)}",
                           "tokenize text first, and pass one list of ints per prompt")
    bad = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
    if bad:
        raise InvalidInput(f"{what} has token id {bad[0]}, outside the model's vocabulary of "
                           f"{vocab_size}", "tokenize with this model's tokenizer")
    return [int(t) for t in ids]


def _preview(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fits(engine: Engine, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
    """Refuse prompts that, with their new tokens, need more positions than the model has. The
    last new token is never fed (nor a draft past it), so a prompt of P tokens takes
    P + max_new_tokens - 1 positions, as with transformers' `generate`."""
    limit = engine.max_positions
    if limit is None:
        return
    longest, note = max(prompt_lengths), positions_note(engine.model.config)
    if longest > limit:
        raise PromptTooLong(
            f"the prompt is {longest} tokens long but the model takes at most {limit} positions{note}",
            "shorten the document (or prompt), or split it into chunks: margins (`multidecode margins`) reads a "
            "long document chunk by chunk",
        )
    if longest + max_new_tokens - 1 > limit:
        raise PromptTooLong(
            f"the prompt is {longest} tokens and max_new_tokens is {max_new_tokens}: {longest + max_new_tokens - 1} "
            f"positions (the last new token is never fed back), more than the model's {limit}{note}",
            f"lower max_new_tokens to {limit - longest + 1} or shorten the document (or prompt)",
            fits=limit - longest + 1,
        )


def memory_need(engine: Engine, prefix_length: int, suffix_lengths: Sequence[int], max_new_tokens: int,
                draft: int) -> Need:
    """The bytes branches `prefix + suffixes[i]` will add to `engine` (see `memory`)."""
    return engine.need(prompt_slots=prefix_length + sum(suffix_lengths), branches=len(suffix_lengths),
                       branch_slots=max_new_tokens + draft, rows_per_branch=1 + draft)


def check_memory(engine: Engine, prefix_length: int, suffix_lengths: Sequence[int], max_new_tokens: int,
                 draft: int, budget: int | None = None, *, asked: int | None = None, fewer: str = "split the work",
                 new_tokens: str = "max_new_tokens") -> None:
    """Refuse branches whose bytes the machine does not have (`budget`: None for what it has
    now, see `memory.budget_bytes`), saying how many would fit. asked: how many branches the
    caller wanted, where it checks one to learn that not even one fits (waves). fewer, new_tokens:
    the fix in the caller's words, for fewer branches (`{fit}`: how many fit) and for shorter ones."""
    budget = budget_bytes(engine.device) if budget is None else budget
    need = memory_need(engine, prefix_length, suffix_lengths, max_new_tokens, draft)
    if need.total <= budget:
        return
    longest = sorted(suffix_lengths, reverse=True)  # any `fit` of them fit: the longest `fit` do
    fit = most_branches(lambda w: memory_need(engine, prefix_length, longest[:w], max_new_tokens, draft).total
                        <= budget, len(suffix_lengths))
    undrafted = not fit and draft and memory_need(engine, prefix_length, longest[:1], max_new_tokens, 0).total <= budget
    at_once = f"any {fit:,} of these branches fit at once" if fit > 1 else "one of these branches fits at a time"
    hint = (f"{at_once}: {fewer.format(fit=fit)}" if fit else
            f"lower the draft budget or turn speculation off (each branch holds {draft:,} draft tokens a step)"
            if undrafted else
            f"lower {new_tokens} or shorten the prompts")
    count = len(suffix_lengths)
    branches = f"{count:,} branch" if count == 1 else f"{count:,} branches"
    if asked is not None and asked > count:
        branches = f"even {branches} of the {asked:,} asked for"
    check_budget(need, budget, what=f"decoding {branches} of up to {max_new_tokens} new tokens",
                 hint=f"{hint}, or set {ENVIRONMENT}={setting_text(need.least_setting())} (or more) if that much "
                      "memory is free")


# ---------------------------------------------------------------------- the work
class BranchGroup(Work):
    """Independent branches `prefix_ids + suffixes[i]`, decoded together (see the module notes).

    The first step feeds the prompts: the prefix once, each suffix under it (an empty suffix
    branches at the prefix's end; with no prefix each suffix is its own root). Every later step
    feeds each live branch's head. When speculating, each branch's draft tree hangs under its
    head, or under its prompt's last token in the first step.

    under, cached: the prompts may continue a path already in the forest: `under` is its last
    node and `cached` its tokens (a server's prefix cache); every prompt is then
    `cached + prefix_ids + suffixes[i]`. prompt_owner: who keeps the prompt nodes (None: this
    work). logprobs: how many top log-probabilities each `TokenEvent` carries (None: no
    log-probabilities at all). constraints: each branch's compiled constraint (None: free; see
    `constraints`). A driver may feed the prompts in pieces (`pace_prompt`).
    """

    def __init__(self, prefix_ids: list[int], suffixes: list[list[int]], *, rule: StopRule,
                 sampling: Sequence[SamplingParams], tokenizer=None, speculation: Speculation | None = None,
                 vocab_size: int | None = None, under: int = ROOT, cached: Sequence[int] = (),
                 prompt_owner: object | None = None, logprobs: int | None = None,
                 constraints: Sequence[Compiled | None] = ()) -> None:
        self.prefix_ids, self.suffixes = prefix_ids, suffixes
        self.vocab_size = vocab_size
        self.under, self.prompt_owner, self.logprobs = under, prompt_owner, logprobs
        self.prompts = [list(cached) + prefix_ids + s for s in suffixes]
        self.prompt_ends: list[int] = []  # each prompt's last node, once fed
        self.draft_nodes: set[int] = set()
        self.speculation = speculation
        self.tracker = AcceptanceTracker() if speculation is not None and speculation.auto else None
        grammars = [c.start() if c is not None else None for c in constraints] or [None] * len(self.prompts)
        self.branches = [
            Branch(i, BranchSampler(sampling[i], prompt, grammars[i]), BranchOutput(rule, tokenizer),
                   BranchContext(list(prompt), len(prompt), sampling=sampling[i]))
            for i, prompt in enumerate(self.prompts)
        ]
        self.events: deque[TokenEvent] = deque()
        self.stats = DecodeStats(speculate=None if speculation is None else speculation.name)
        self.done = False
        self._started = False
        self.prompt_piece: list[int] = []  # the prompt nodes the last step fed as a piece of the prefix
        self._piece: int | None = None  # prefix tokens the next step feeds as a piece (None: the whole rest)
        self._feeding_piece = False  # whether this step's feed is such a piece
        self._piece_states: list[torch.Tensor] = []  # what the pieces fed give a drafter that reads the prompt
        self._feed = Feed()  # this step's feed, and what its nodes are:
        self._heads: dict[int, int] = {}  # branch -> feed index of the node whose logits pick its next token
        self._draft_nodes: dict[int, tuple[int, int]] = {}  # feed index -> (branch, candidate of its draft)
        self._side_nodes: dict[int, tuple[int, int]] = {}  # feed index -> (branch, side node of its draft)
        self._drafts: dict[int, DraftTree] = {}  # branch -> its draft this step

    # ------------------------------------------------------------------ pacing the prompt
    @property
    def started(self) -> bool:
        """Whether its prompts are all fed: from here on every step gives each live branch a token."""
        return self._started

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to feed (0 once started)."""
        return 0 if self._started else len(self.prefix_ids) + sum(map(len, self.suffixes))

    def pace_prompt(self, budget: int | None) -> int:
        """Let the next step feed at most `budget` prompt tokens (None: all that is left, the
        default); returns how many it will feed.

        A prompt over the budget is fed in pieces of its shared prefix. The last piece (at least
        the prefix's last token, and every suffix: they carry the logits) is never split, so it
        goes whole once no more of the prefix can be cut off, over a budget that is not 0.
        """
        left = self.prompt_left
        splittable = len(self.prefix_ids) - 1
        if budget is None or left <= budget or (budget > 0 and splittable < 1):
            self._piece = None
            return left
        self._piece = min(budget, max(splittable, 0))
        return self._piece

    # ------------------------------------------------------------------ planning
    def plan(self) -> Feed:
        self._heads, self._draft_nodes, self._side_nodes, self._drafts = {}, {}, {}, {}
        self.prompt_piece = []
        piece, self._piece = self._piece, None  # a budget holds for one step
        self._feeding_piece = not self._started and piece is not None
        if self._feeding_piece:
            self._feed = self._piece_feed(piece)
            return self._feed
        self._feed = self._decode_feed() if self._started else self._prompt_feed()
        if self.speculation is not None:  # a learned drafter reads the target's hidden states
            self._feed.hidden_layers = tuple(self.speculation.proposer.layers)
            # one that reads the whole prompt gets the states of every prompt node fed
            self._feed.hidden_everywhere = not self._started and self.speculation.proposer.reads_prompt
        return self._feed

    def _piece_feed(self, tokens: int) -> Feed:
        """The next `tokens` of the shared prefix as one chain under the last piece (no logits),
        with their hidden states for a drafter that reads the whole prompt."""
        feed = Feed()
        at = self.under
        for token in self.prefix_ids[:tokens]:
            at = Feed.ref(feed.add(token, at, logits=False, owner=self.prompt_owner))
        spec = self.speculation
        if spec is not None and spec.proposer.reads_prompt and tokens:
            feed.hidden_layers, feed.hidden_everywhere = tuple(spec.proposer.layers), True
        return feed

    def _prompt_feed(self) -> Feed:
        feed, ends = prompt_feed(self.prefix_ids, self.suffixes, under=self.under, owner=self.prompt_owner)
        for b, end in zip(self.branches, ends):
            self._heads[b.index] = end
        # One branch's prompt is one chain; a draft chain continues it in the same plain forward,
        # while siblings would cost a second forward: there, draft the main guess only.
        self._add_drafts(feed, chain_only=len(self.branches) == 1)
        return feed

    def _decode_feed(self) -> Feed:
        self._piece_states = []  # the prompt's pieces went to the drafter with its last part
        feed = Feed()
        for b in self.branches:
            if not b.output.finished:
                self._heads[b.index] = feed.add(b.head, b.leaf)
        self._add_drafts(feed)
        return feed

    def _add_drafts(self, feed: Feed, *, chain_only: bool = False) -> None:
        """Hang each live branch's draft tree for this step under its head (`self._heads`): its
        proposer's, less what its grammar forbids, with the tokens its grammar forces first."""
        spec = self.speculation
        # A step emits the accepted drafts and one token more: no deeper than what is left.
        room = {b: self.branches[b].output.rule.max_new_tokens - len(self.branches[b].output.token_ids) - 1
                for b in self._heads}
        asking = [b for b in self._heads if room[b] >= 1]
        if not asking or (spec is None and not any(self.branches[b].sampler.grammar for b in asking)):
            return
        proposed = [DraftTree() for _ in asking] if spec is None else \
            spec.proposer.propose_many([self.branches[b].context for b in asking], spec.size)
        if len(proposed) != len(asking):
            raise InvalidArgument(f"proposer {spec.proposer.name!r} returned {len(proposed)} drafts for "
                                  f"{len(asking)} branches", "return one DraftTree per context from propose_many()")
        for b, draft in zip(asking, proposed):
            grammar = self.branches[b].sampler.grammar
            if spec is not None:
                draft = self._sized(b, pruned(checked_draft(draft, spec, self.vocab_size), grammar), room[b])
            if grammar is not None and grammar.jump_forward:
                draft = with_forced(draft, grammar.forced(min(room[b], FORCED_LIMIT)))
            if chain_only:
                draft = draft.first_chain()
            if self.tracker is not None:
                self.tracker.record_proposal(b, len(self.branches[b].output.token_ids), draft)
            if len(draft) or draft.side_tokens:
                self._drafts[b] = draft
                self._hang(feed, b, draft)

    def _sized(self, branch: int, draft: DraftTree, room: int) -> DraftTree:
        """A proposer's draft cut to the budget, and to the `room` left before max_new_tokens."""
        spec = self.speculation
        if self.tracker is not None and not draft.dists and len(draft) > spec.size:
            return self._likeliest(branch, draft.truncate(len(draft), room), spec.size)
        return draft.truncate(spec.size, room)

    def _likeliest(self, branch: int, draft: DraftTree, size: int) -> DraftTree:
        """The `size` nodes with the best estimated chances (a node's is never above its
        parent's, so they form a subtree): with "auto", what a mixture of proposers offers is
        cut by what has been accepted, not by the order the proposers guessed in."""
        chances = self.tracker.node_chances(branch, draft)
        return draft.keep(sorted(range(len(draft)), key=lambda i: (-chances[i], i))[:size])

    def _hang(self, feed: Feed, branch: int, draft: DraftTree) -> None:
        """Add one branch's draft (candidates, then side nodes) to the feed under its head."""
        head = self._heads[branch]
        chances = self.tracker.node_chances(branch, draft) if self.tracker is not None else [None] * len(draft)
        at: list[int] = []
        for n, (token, parent, chance) in enumerate(zip(draft.tokens, draft.parents, chances)):
            if draft.kinds[n] == FORCED and chance is not None:
                chance = 1.0  # the grammar allows nothing else: certain, whatever the tracker says
            at.append(feed.add(token, Feed.ref(head if parent == UNDER_LEAF else at[parent]), chance=chance))
            self._draft_nodes[at[-1]] = (branch, n)
        side: list[int] = []
        for n, (token, parent) in enumerate(zip(draft.side_tokens, draft.side_parents)):
            side.append(feed.add(token, Feed.ref(head if parent == UNDER_LEAF else side[parent])))
            self._side_nodes[side[-1]] = (branch, n)

    # ------------------------------------------------------------------ settling
    def settle(self, fed: Sequence[int], result: FeedResult[list[int]]) -> Settled:
        if self._feeding_piece:
            return self._settle_piece(result)
        logits = result.logits  # [rows, vocab]
        node_of = dict(zip(fed, result.nodes))  # feed index -> node id
        if not self._started:
            self.prompt_ends = [node_of[self._heads[b.index]] for b in self.branches]
        self._started = True
        self.stats.forward_passes = self.forward_passes
        row_of = {i: r for r, i in enumerate(i for i in fed if self._feed.logits[i])}  # feed index -> logits row
        node_at_row = {r: node_of[i] for i, r in row_of.items()}
        fed_drafts = {i: bn for i, bn in self._draft_nodes.items() if i in node_of}
        self.draft_nodes = {node_of[i] for i in fed_drafts}  # this step's draft nodes (for observers)
        draft_row = {bn: row_of[i] for i, bn in fed_drafts.items()}  # (branch, draft node) -> row
        children: dict[int, dict[int, dict[int, int]]] = {}  # branch -> row -> token -> child row
        for (branch, n), row in draft_row.items():
            draft = self._drafts[branch]
            parent = draft.parents[n]
            parent_row = row_of[self._heads[branch]] if parent == UNDER_LEAF else draft_row[branch, parent]
            children.setdefault(branch, {}).setdefault(parent_row, {})[draft.tokens[n]] = row
        drawn: dict[int, dict[int, tuple[list[int], torch.Tensor]]] = {}  # branch -> row -> (candidates, q)
        against_q = self.speculation is not None and self.speculation.against_q  # else draw, then match
        for branch, draft in self._drafts.items() if against_q else ():
            for parent, q in draft.dists.items():
                row = row_of[self._heads[branch]] if parent == UNDER_LEAF else draft_row.get((branch, parent))
                if row is not None:  # candidates under an unfed node are never reached
                    drawn.setdefault(branch, {})[row] = ([draft.tokens[i] for i in draft.siblings(parent)], q)
        order = sorted(self._heads)
        finished_before = sum(b.output.finished for b in self.branches)
        paths = walk(logits, [row_of[self._heads[b]] for b in order], [children.get(b, {}) for b in order],
                     [self.branches[b].sampler for b in order],
                     lambda j, token, row: self._emit(order[j], token, logits, row),
                     [drawn.get(b, {}) for b in order])

        accepted: set[int] = set()
        for j, path in zip(order, paths):
            branch = self.branches[j]
            branch.leaf = node_at_row[path[-1]]
            branch.head = branch.output.token_ids[-1]
            accepted.update(node_at_row[r] for r in path)
            if result.hidden is not None:  # what the next draft reads
                self._keep_features(j, path, result.hidden, fed)
            if j in self._drafts:
                self._observe(j, path, {row: n for (b, n), row in draft_row.items() if b == j}, logits, row_of)
            if self.tracker is not None:
                self.tracker.score_proposals(j, branch.output.token_ids, branch.output.finished)
            if branch.output.finished and self.speculation is not None:
                self.speculation.proposer.release(branch.context)
        rejected = [node_of[i] for i in fed_drafts if node_of[i] not in accepted]
        rejected += [node_of[i] for i in self._side_nodes]
        self.stats.steps += 1
        self.stats.draft_budgets.append(len(fed_drafts))
        self.done = all(b.output.finished for b in self.branches)
        return Settled(rejected, dead=sum(b.output.finished for b in self.branches) > finished_before)

    def _observe(self, index: int, path: list[int], node_at: dict[int, int], logits: torch.Tensor,
                 row_of: dict[int, int]) -> None:
        """Count a branch's draft (`node_at`: logits row -> draft node, for the nodes fed) and show
        its proposer what was accepted (`path`: logits rows, the head first)."""
        draft = self._drafts[index]
        if self.speculation is not None:
            side_rows = [row_of[i] for i, (b, _) in self._side_nodes.items() if b == index]
            side_logits = logits[side_rows] if side_rows else None  # [side nodes, vocab]
            self.speculation.proposer.observe(self.branches[index].context, draft, [node_at[r] for r in path[1:]],
                                              side_logits=side_logits)
        self.stats.drafted += len(node_at)
        self.stats.forced += sum(draft.kinds[n] == FORCED for n in node_at.values())
        self.stats.accepted += len(path) - 1

    def _settle_piece(self, result: FeedResult[list[int]]) -> Settled:
        """A piece of the prefix is in the cache: the rest of the prompt hangs under its last node."""
        self.prompt_piece = list(result.nodes)
        self.under = result.nodes[-1]
        self.prefix_ids = self.prefix_ids[len(result.nodes):]
        if result.hidden is not None:  # [piece nodes, layers, hidden]
            self._piece_states.append(result.hidden)
        self.stats.forward_passes = self.forward_passes
        return Settled()

    def _keep_features(self, branch: int, path: list[int], hidden: torch.Tensor, fed: Sequence[int]) -> None:
        """Give the branch's proposer the target's states along the path its step settled (`path`:
        logits rows), after those of the prompt nodes fed before it where the step fed them all.
        hidden: this work's share, a row per logits row, or per node fed when it asked for
        `hidden_everywhere` ([rows, layers, hidden])."""
        if self._feed.hidden_everywhere:  # the path's rows are its nodes' places in `fed`
            place = {i: k for k, i in enumerate(fed)}  # feed index -> place in fed
            logits_places = [k for k, i in enumerate(fed) if self._feed.logits[i]]  # logits row -> place in fed
            path = self._prompt_rows(branch, place) + [logits_places[row] for row in path]
        features = hidden[path]  # [path nodes, layers, hidden]
        if self._feed.hidden_everywhere and self._piece_states:  # the prompt's earlier pieces come first
            features = torch.cat([*self._piece_states, features])
        context = self.branches[branch].context
        context.features, context.feature_layers = features, self._feed.hidden_layers

    def _prompt_rows(self, branch: int, position: dict[int, int]) -> list[int]:
        """The rows (positions in this step's fed nodes) of the prompt nodes fed before branch's
        head, root first: its path within this feed (a cached prefix was not fed, so not here)."""
        rows, at = [], self._heads[branch]
        while (parent := local_parent(self._feed.parents[at])) is not None:
            at = parent
            rows.append(position[at])
        return rows[::-1]

    def _emit(self, index: int, token: int, logits: torch.Tensor, row: int) -> bool:
        branch = self.branches[index]
        offset = branch.output.decoded_chars
        delta = branch.output.accept(token)
        branch.context.tokens.append(token)
        self.stats.tokens += 1
        logprob, top = None, ()
        if self.logprobs is not None:
            logprob, top = token_logprobs(logits[row], token, self.logprobs)
            if branch.logprobs is None:
                branch.logprobs, branch.top_logprobs = [], []
            branch.logprobs.append(logprob)
            branch.top_logprobs.append(top)
        self.events.append(TokenEvent(index, token, delta, branch.output.finish_reason, logprob, top, offset))
        grammar = branch.sampler.grammar
        if grammar is not None and grammar.complete and not branch.output.finished and self.logprobs is None:
            # Its grammar is complete: its mask allows the eos token alone, which any choice takes,
            # so it comes now instead of after one more forward.
            eos = grammar.compiled.eos_id
            branch.sampler.observe(eos)
            return self._emit(index, eos, logits, row)
        return not branch.output.finished

    def live(self) -> list[int]:
        if not self._started:  # its prompt, as far as it is fed
            return [self.under] if self.under != ROOT else []
        return [b.leaf for b in self.branches if not b.output.finished]


LOGPROB_FLOOR = -9999.0
"""The least log-probability reported (OpenAI's value for a token with no chance)."""


def token_logprobs(row: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` under the raw distribution of logits `row` ([vocab]), and
    the `top` likeliest (token id, log-probability) pairs, best first, tied ones by id (the order
    greedy's arg-max picks them in; `torch.topk` leaves ties in any order). A token the model gives
    no chance at all (a grammar's eos where the logit is -inf) gets `LOGPROB_FLOOR`, as OpenAI
    writes it: -inf is no JSON number."""
    logprobs = torch.log_softmax(row.float(), dim=-1).clamp(min=LOGPROB_FLOOR)  # [vocab]
    if not top:
        return float(logprobs[token]), ()
    least = torch.topk(logprobs, top).values[-1]  # the top-th best value: every token at or above it is a candidate
    ids = torch.nonzero(logprobs >= least).flatten().tolist()
    values = logprobs[ids].tolist()
    pairs = sorted(zip(ids, values), key=lambda pair: (-pair[1], pair[0]))[:top]
    return float(logprobs[token]), tuple(pairs)


def pruned(draft: DraftTree, grammar: GrammarState | None) -> DraftTree:
    """`draft` without the candidates `grammar` forbids (see `constraints.allowed_nodes`)."""
    if grammar is None or not len(draft):
        return draft
    kept = allowed_nodes(grammar, draft.tokens, draft.parents, drawn=tuple(draft.dists))
    return draft if len(kept) == len(draft) else draft.keep(kept)


def with_forced(draft: DraftTree, forced: Sequence[int]) -> DraftTree:
    """The tokens a grammar forces as a chain of certain candidates under the head (kind
    `FORCED`), `draft` merged into it (a guess of the same tokens becomes the forced node). A
    draft drawn from a distribution is not merged (its siblings must stay the draws): the chain
    alone then."""
    if not forced:
        return draft
    out, at = DraftTree(), UNDER_LEAF
    for token in forced:
        at = out.add(token, at, kind=FORCED, prior=1.0)
    if not draft.dists:
        new_index = {UNDER_LEAF: UNDER_LEAF}
        for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
            found = out.child(new_index[parent], token)
            new_index[i] = found if found is not None else out.add(token, new_index[parent], kind=draft.kinds[i],
                                                                   prior=draft.priors[i])
    out.side_tokens, out.side_parents = list(draft.side_tokens), list(draft.side_parents)
    return out


def checked_draft(draft, spec: Speculation, vocab_size: int | None) -> DraftTree:
    """A proposer's answer, refused with a message naming the proposer unless it is a well-formed
    `DraftTree` (`DraftTree.problem`) of token ids the model knows (a bad id would otherwise fail
    deep inside the forward)."""
    if not isinstance(draft, DraftTree):
        raise InvalidArgument(f"proposer {spec.proposer.name!r} returned {type(draft).__name__}, not a DraftTree",
                              "return a multidecode.proposers.DraftTree from propose()")
    if (problem := draft.problem()) is not None:
        raise InvalidArgument(f"proposer {spec.proposer.name!r} returned a malformed DraftTree: {problem}",
                              "build drafts with DraftTree.add (or add_path), which keeps parents before children")
    tokens = draft.tokens + draft.side_tokens
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in tokens):
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise InvalidArgument(f"proposer {spec.proposer.name!r} drafted token id {bad}, outside the model's "
                              f"vocabulary of {vocab_size}", "draft with this model's tokenizer")
    return draft


def prompt_feed(prefix_ids: Sequence[int], suffixes: Sequence[Sequence[int]], *, under: int = ROOT,
                owner: object | None = None) -> tuple[Feed, list[int]]:
    """The prompts `prefix_ids + suffixes[i]` as one feed: the prefix once, each suffix under it
    (an empty suffix ends at the prefix's last token; with no prefix each suffix hangs under
    `under`, a root by default). owner: see `Feed.owners`.
    Returns the feed, with logits at each prompt's last node, and that node's index per prompt."""
    feed = Feed()
    end = None  # feed index of the prefix's last token
    for token in prefix_ids:
        end = feed.add(token, under if end is None else Feed.ref(end), logits=False, owner=owner)
    ends = []
    for suffix in suffixes:
        at = end
        for token in suffix:
            at = feed.add(token, under if at is None else Feed.ref(at), logits=False, owner=owner)
        if at is None:
            raise InvalidInput("a branch has no tokens and there is no prefix to continue", "give every branch a prompt")
        feed.logits[at] = True
        ends.append(at)
    return feed, ends


# ---------------------------------------------------------------------- runs
@dataclass
class BranchRun:
    """Branches being decoded as one group on a scheduler: iterate `events`; each branch's
    `output` fills in; `stats` counts forwards, tokens and drafts."""

    scheduler: Scheduler
    group: BranchGroup

    @property
    def engine(self) -> Engine:
        return self.scheduler.engine

    @property
    def branches(self) -> list[Branch]:
        return self.group.branches

    @property
    def prompts(self) -> list[list[int]]:
        return self.group.prompts

    @property
    def stats(self) -> DecodeStats:
        return self.group.stats

    @property
    def sampling(self) -> list[SamplingParams]:
        """Each branch's sampling settings (its seed), by index."""
        return [b.sampler.params for b in self.group.branches]

    @property
    def events(self) -> Iterator[TokenEvent]:
        return self._events()

    def _events(self) -> Iterator[TokenEvent]:
        group = self.group
        while True:
            while group.events:
                yield group.events.popleft()
            if group.done:
                self._raise_failure()
                return
            self.step()

    def step(self) -> None:
        """One scheduler step (every work on the scheduler advances); raises the error this run's
        branches ended with, where one did (a grammar its parser gave up on: `Work.failure`)."""
        self.scheduler.step()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self.group.failure is not None:
            raise self.group.failure

    def finish(self) -> BranchRun:
        """Drain the events (when only the final outputs are wanted)."""
        for _ in self.events:
            pass
        return self


def start(scheduler: Scheduler, prefix_ids: Sequence[int], suffixes: Sequence[Sequence[int]], **settings) -> BranchRun:
    """Admit branches `prefix_ids + suffixes[i]` to `scheduler` and feed their prompts.

    Inputs are checked and the prompts prefilled before this returns (the first tokens are chosen
    too and wait in the events); the rest comes as `events` is iterated. Settings as for `admit`.
    """
    run = admit(scheduler, prefix_ids, suffixes, **settings)
    run.step()
    return run


def admit(
    scheduler: Scheduler,
    prefix_ids: Sequence[int],
    suffixes: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sequence[SamplingParams],
    tokenizer=None,
    stop: Sequence[str] = (),
    eos_token_id=None,
    speculate=None,
    under: int = ROOT,
    cached: Sequence[int] = (),
    prompt_owner: object | None = None,
    logprobs: int | None = None,
    memory_budget: int | None = None,
    constraint=None,
) -> BranchRun:
    """Check the inputs and admit branches `prefix_ids + suffixes[i]` to `scheduler`; nothing is
    fed until the scheduler steps. speculate: see `speculation`; under, cached, prompt_owner,
    logprobs: see `BranchGroup`; memory_budget: the bytes the branches must fit in (None: what
    the machine has now); constraint: a `constraints.Constraint` for every branch, or a list of
    one per branch (None: free), compiled for `tokenizer` here, before anything is fed.
    """
    check_positive("max_new_tokens", max_new_tokens)
    engine = scheduler.engine
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= engine.vocab_size):
        raise InvalidArgument(f"logprobs must be a whole number from 0 to the vocabulary's {engine.vocab_size}, "
                              f"or None, got {logprobs!r}", "e.g. logprobs=5: each token's log-probability "
                              "and the five likeliest at its step")
    if isinstance(suffixes, torch.Tensor):
        suffixes = list(suffixes)
    if not suffixes:
        raise InvalidInput("there are no branches to decode", "pass at least one branch")
    spec = build_speculation(speculate, engine.dtype, exact=engine.exact)
    if spec is not None:
        if spec.auto and isinstance(spec.proposer, Mixture):
            spec.proposer.fit(scheduler.cost_curve(), len(suffixes), spec.size)
        spec.proposer.check(engine.model)
    prefix_ids = token_ids(prefix_ids, engine.vocab_size, "the prefix")
    suffixes = [token_ids(s, engine.vocab_size, f"branch {i}") for i, s in enumerate(suffixes)]
    check_vocabulary(sampling, engine.vocab_size)
    if not prefix_ids and not all(suffixes):
        raise InvalidInput("a branch has no tokens and there is no prefix to continue", "give every branch a prompt")
    check_fits(engine, [len(cached) + len(prefix_ids) + len(s) for s in suffixes], max_new_tokens)
    draft = 0 if spec is None else spec.size
    check_memory(engine, len(prefix_ids), [len(s) for s in suffixes], max_new_tokens, draft, memory_budget)
    rule = StopRule(max_new_tokens, eos_ids_of(engine.model, eos_token_id), stop_strings_of(stop))
    compiled = compile_for_branches(per_branch(len(suffixes), constraint), tokenizer, vocab_size=engine.vocab_size,
                                    eos_ids=rule.eos_ids)
    group = BranchGroup(prefix_ids, suffixes, rule=rule, sampling=sampling, tokenizer=tokenizer, speculation=spec,
                        vocab_size=engine.vocab_size, under=under, cached=cached, prompt_owner=prompt_owner,
                        logprobs=logprobs, constraints=compiled)
    engine.reserve(engine.forest.num_slots + len(prefix_ids) + sum(map(len, suffixes))
                   + len(suffixes) * (max_new_tokens + draft))
    return BranchRun(scheduler, scheduler.admit(group))


ADMIT_SETTINGS = tuple(name for name, p in inspect.signature(admit).parameters.items() if p.kind is p.KEYWORD_ONLY)
"""The settings `admit` (and so `start`) takes by name."""


def start_prompts(scheduler: Scheduler, prompts: Sequence[Sequence[int]], **settings) -> BranchRun:
    """`start` for whole prompts: their longest common run of ids is the shared prefix, so
    branch i's path is exactly `prompts[i]`. Settings as for `start`."""
    prompts = as_list(prompts)
    if not prompts:
        raise InvalidInput("there are no prompts to decode", "pass at least one prompt")
    vocab_size = scheduler.engine.vocab_size
    shared = share_prefix([token_ids(p, vocab_size, f"prompt {i}") for i, p in enumerate(prompts)])
    return start(scheduler, shared.prefix_ids, shared.suffix_ids, **settings)


__all__ = ["Branch", "BranchGroup", "BranchRun", "DecodeStats", "TokenEvent", "admit", "check_memory", "memory_need",
           "start", "start_prompts"]
