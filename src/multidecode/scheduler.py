"""The step-wise scheduler: every strategy's work, advanced together, one feed per step.

A **work** is anything that owns nodes in the forest and wants some of them fed each step: a
group of independent branches (`branches.BranchGroup`: ask, complete, vote, margins, decode,
generate), a beam search, a scoring pass. The scheduler holds one long-lived `Engine` and the
works admitted to it, and each `step`:

1. asks every work for its **feed**: the nodes it wants in the next forward. Some are
   *required* (a prompt, each branch's newest token, the beams' next tokens); some are
   *optional* draft nodes that carry their estimated chance of being accepted;
2. keeps the optional nodes that pay for their rows, by the measured cost of a forward on this
   hardware (`cost.choose_draft_count`), when any work asks for that;
3. runs everything in one `Engine.feed` (the only door to `model.forward`);
4. hands each work its share of the feed's result (a `FeedResult` of its nodes, their logits and
   the hidden states it asked for) to **settle**: emit tokens, accept or reject drafts, pick
   beams. Rejected nodes are taken back (`Engine.drop`) in one pass over the cache tail;
5. compacts a work's dead slots when enough of the cache is dead, acting on that work's own
   nodes only (its **owner**), and retires finished works. A retired work's slots are freed
   before the next step that feeds anything (so the cache of a finished one-off run can still be
   inspected, and a long-lived scheduler does not keep dead work).

A work whose own `plan` or `settle` raises a `MultiDecodeError` (what its input caused: a grammar
its parser gave up on mid-decode, a proposer's malformed draft) ends alone: the error becomes its
`failure`, it is done and retired, and the step goes on for the others. So one request's bad
input never fails another that shares its forward; a bug (any other exception) or a failed
forward still ends the step for all.

Works may be admitted between any two steps, so new requests can join a running forest. The
scheduler knows nothing about sampling, drafts or beams beyond what a `Feed` says, and the
engine knows nothing about works.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .cost import choose_draft_count, cost_curve
from .engine import Engine, FeedResult
from .errors import MultiDecodeError
from .forest import ROOT, Forest, local_parent


@dataclass
class Feed:
    """The nodes one work wants in the next forward, parents before children.

    parents[i]: a node id already in the forest, `ROOT`, or `-(j + 2)` for node j of this feed.
    logits[i]: whether node i's next-token logits are needed.
    chances[i]: None for a required node; for an optional draft node, its estimated chance of
        being accepted (never above its parent's, so the most likely nodes form a subtree).
    owners[i]: None for the work's own node; else the owner node i is kept under instead (a
        server's prefix cache keeps prompt nodes past the request that fed them).
    hidden_layers: the layers whose hidden states the work wants at its logits nodes (a learned
        drafter reads them, see `Engine.feed`), in its share's `hidden` (see `Work.settle`).
    hidden_everywhere: those states at every node fed instead (a drafter that reads the whole
        prompt).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)
    chances: list[float | None] = field(default_factory=list)
    owners: list[object | None] = field(default_factory=list)
    root_position: int = 0
    hidden_layers: tuple[int, ...] = ()
    hidden_everywhere: bool = False

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, *, logits: bool = True, chance: float | None = None,
            owner: object | None = None) -> int:
        """Append a node; returns its index in this feed (refer to it as a parent by `ref`)."""
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.logits.append(logits)
        self.chances.append(chance)
        self.owners.append(owner)
        return len(self.tokens) - 1

    @staticmethod
    def ref(index: int) -> int:
        """How a later node of the same feed names node `index` as its parent."""
        return -(index + 2)


@dataclass
class Settled:
    """What a work reports after a step: the nodes it rejects, and whether part of what it holds
    in the cache died (a branch finished, a beam was dropped), so compaction may pay."""

    rejected: list[int] = field(default_factory=list)
    dead: bool = False


class Work:
    """Base class of scheduled work (see the module notes).

    Subclasses implement `plan`, `settle` and `live`, and set `done` when finished. The scheduler
    sets `owner` on admission (an id that marks the work's nodes in the forest; a plain int, so
    the forest never keeps a finished work alive) and counts in `forward_passes` the model calls
    of every step the work took part in.
    """

    done: bool = False
    owner: int = -1
    forward_passes: int = 0
    failure: MultiDecodeError | None = None  # what ended it alone (see the module notes), else None

    def plan(self) -> Feed | None:
        """The nodes to feed this step (None or an empty feed: nothing this step)."""
        raise NotImplementedError

    def settle(self, fed: Sequence[int], result: FeedResult[list[int]]) -> Settled:
        """After the forward, this work's share of what it computed: `fed[j]` is the index in this
        step's feed of the j-th node fed (optional nodes may have been left out), `result.nodes[j]`
        its node id; `result.logits` holds one row per fed node whose logits were asked for, in
        order ([rows, vocab]). `result.hidden` holds the states of the feed's `hidden_layers`, in
        its order, at those rows ([rows, len(hidden_layers), hidden size]), or with
        `hidden_everywhere` at every node fed ([len(fed), ...]); None when it asked for none."""
        raise NotImplementedError

    def live(self) -> Sequence[int]:
        """Nodes whose paths must stay cached (the leaves future feeds will hang under)."""
        raise NotImplementedError


@dataclass(frozen=True)
class CompactionPolicy:
    """When to drop a work's dead slots from the cache.

    Compact once at least `min_slots` slots and `min_fraction` of the cache belong only to a
    work's finished branches; `every` forces a compaction every that many of the work's steps
    (tests use it).
    """

    min_fraction: float = 0.25
    min_slots: int = 32
    every: int | None = None

    def due(self, step: int, dead: int, total: int) -> bool:
        if self.every is not None and step % self.every == 0:
            return dead > 0
        return dead >= self.min_slots and dead >= self.min_fraction * total


HISTORY = 4096
"""How many of the latest steps `Scheduler.history` keeps (a long-lived server steps forever)."""


@dataclass
class StepRecord:
    """One step as it ran: rows fed, of which optional draft rows, and how many were offered."""

    rows: int
    drafts: int
    offered: int


@dataclass
class StepTrace:
    """What an observer sees of one step, after the works settled and before rejected nodes are
    taken back: the nodes fed (in feed order), which of them are rejected, and the forest itself
    (read-only: every fed node still has its slot, its parent and its position)."""

    step: int
    nodes: list[int]
    rejected: list[int]
    forest: Forest


class Scheduler:
    """Runs works over one engine, one feed per step (see the module notes).

    compaction: when a work's dead slots leave the cache (default: a quarter of it dead).
    cost: the cost curve used to choose optional nodes (`cost.CostCurve`); measured or loaded
        from disk on first need when not given.
    observer: called with a `StepTrace` after every step's works settle (to draw or log the
        forest as it grows); it must not change the forest.
    """

    def __init__(self, engine: Engine, *, compaction: CompactionPolicy | None = None, cost=None,
                 observer: Callable[[StepTrace], None] | None = None) -> None:
        self.engine = engine
        self.compaction = compaction or CompactionPolicy()
        self.cost = cost
        self.observer = observer
        self.works: list[Work] = []
        self.steps = 0  # steps that fed anything
        self.history: deque[StepRecord] = deque(maxlen=HISTORY)  # the latest steps
        self._steps: dict[int, int] = {}  # owner -> steps the work took part in
        self._dirty: set[int] = set()  # owners of works with dead slots not yet compacted
        self._retired: list[int] = []  # owners whose slots are freed before the next feed
        self._owners = itertools.count()

    @property
    def idle(self) -> bool:
        return not self.works

    def cost_curve(self):
        """The cost curve: the one given, else measured (or loaded from disk) now, once."""
        if self.cost is None:
            self.cost = cost_curve(self.engine.model)
        return self.cost

    def admit(self, work: Work) -> Work:
        """Add a work; it takes part from the next step on."""
        work.owner = next(self._owners)
        self.works.append(work)
        return work

    def run(self, work: Work | None = None) -> None:
        """Step until `work` (or every work) is done; raises the `failure` a work ended with."""
        while (not work.done) if work is not None else self.works:
            stepped = [work] if work is not None else list(self.works)
            self.step()
            if (failure := next((w.failure for w in stepped if w.failure is not None), None)) is not None:
                raise failure

    def step(self) -> None:
        """One forward for every work that wants one, then settle, roll back, compact, retire."""
        plans = [(w, _alone(w, w.plan)) for w in list(self.works) if not w.done]
        plans = [(w, f) for w, f in plans if f is not None and len(f)]
        if plans:
            self.free_retired()
            kept = self._choose(plans)
            self._feed(plans, kept)
        for work in [w for w in self.works if w.done]:
            self.retire(work)

    def free_retired(self) -> int:
        """Free the slots of retired works now (a step that feeds anything does it anyway; an
        idle server does it to shrink back). Returns the slots freed."""
        freed = sum(self.engine.compact([], owner=owner) for owner in self._retired)
        self._retired.clear()
        return freed

    def retire(self, work: Work) -> None:
        """Remove a work; the slots it owns are freed before the next feed."""
        self.works.remove(work)
        self._steps.pop(work.owner, None)
        self._dirty.discard(work.owner)
        self._retired.append(work.owner)

    # ------------------------------------------------------------------ one step
    def _choose(self, plans: list[tuple[Work, Feed]]) -> list[list[int]]:
        """Which nodes of each feed to feed: all required ones, and the optional ones worth their rows."""
        required = sum(c is None for _, f in plans for c in f.chances)
        expected = sum(1 for _, f in plans for c, wants in zip(f.chances, f.logits) if c is None and wants)
        offered = [(chance, w, i) for w, (work, f) in enumerate(plans) for i, chance in enumerate(f.chances)
                   if chance is not None]
        take: set[tuple[int, int]] = set()
        if offered:
            # best first; equal chances keep feed order, so parents come before their children
            ranked = sorted(offered, key=lambda x: -x[0])
            count = choose_draft_count(self.cost_curve(), required=required, expected=expected,
                                       chances=[c for c, _, _ in ranked], context=self.engine.forest.num_slots)
            take = {(w, i) for _, w, i in ranked[:count]}
        kept = []
        for w, (_, feed) in enumerate(plans):
            chosen, index = [], {}
            for i, (chance, parent) in enumerate(zip(feed.chances, feed.parents)):
                if chance is not None:
                    local = local_parent(parent)
                    if (w, i) not in take or (local is not None and local not in index):
                        continue  # left out, or its parent was
                index[i] = len(chosen)
                chosen.append(i)
            kept.append(chosen)
        drafts = sum(1 for w, (_, f) in enumerate(plans) for i in kept[w] if f.chances[i] is not None)
        self.steps += 1
        self.history.append(StepRecord(sum(map(len, kept)), drafts, len(offered)))
        return kept

    def _feed(self, plans: list[tuple[Work, Feed]], kept: list[list[int]]) -> None:
        """Run the step's one feed (each work's kept nodes, in work order) and settle every work."""
        tokens, parents, logits_for, owners = [], [], [], []
        spans = []
        root_positions = {f.root_position for _, f in plans}
        if len(root_positions) > 1:
            raise ValueError("works fed together must share one root position")
        for (work, feed), chosen in zip(plans, kept):
            start = len(tokens)
            index = {i: start + j for j, i in enumerate(chosen)}
            for i in chosen:
                parent, local = feed.parents[i], local_parent(feed.parents[i])
                parents.append(parent if local is None else Feed.ref(index[local]))
                tokens.append(feed.tokens[i])
                owners.append(work.owner if feed.owners[i] is None else feed.owners[i])
                if feed.logits[i]:
                    logits_for.append(len(tokens) - 1)
            spans.append((start, len(tokens)))
        calls = self.engine.stats.forward_passes
        states_at = [states_wanted(feed, span, logits_for) for (_, feed), span in zip(plans, spans)]
        layers = sorted({layer for _, f in plans for layer in f.hidden_layers})
        result = self.engine.feed(tokens, parents, logits_for=logits_for, root_position=root_positions.pop(),
                                  owners=owners, hidden_layers=layers, hidden_for=[i for at in states_at for i in at])
        calls = self.engine.stats.forward_passes - calls
        rejected: list[int] = []
        shares = shares_of(result, [feed for _, feed in plans], spans, logits_for, states_at, layers)
        for (work, _), chosen, share in zip(plans, kept, shares):
            work.forward_passes += calls
            settled = _alone(work, work.settle, chosen, share) or Settled()
            rejected.extend(settled.rejected)
            self._steps[work.owner] = self._steps.get(work.owner, 0) + 1
            if settled.dead:
                self._dirty.add(work.owner)
        if self.observer is not None:
            self.observer(StepTrace(self.steps, list(result.nodes), list(rejected), self.engine.forest))
        self.engine.drop(rejected)
        for work, _ in plans:
            self._compact_if_due(work)

    def _compact_if_due(self, work: Work) -> None:
        if work.done or work.owner not in self._dirty:
            return
        step = self._steps.get(work.owner, 0)
        if self.engine.compact_if_due(list(work.live()), lambda dead, total: self.compaction.due(step, dead, total),
                                      owner=work.owner):
            self._dirty.discard(work.owner)


def _alone(work: Work, call: Callable, *args):
    """`call(*args)` for `work`; a `MultiDecodeError` it raises ends that work alone (its
    `failure`, done) and gives None, so the step goes on for the other works."""
    try:
        return call(*args)
    except MultiDecodeError as error:
        work.failure, work.done = error, True
        return None


def states_wanted(feed: Feed, span: tuple[int, int], logits_for: Sequence[int]) -> list[int]:
    """The nodes of a step (indices into its whole feed) whose hidden states one work reads, its
    nodes being `span` of it: none, its logits nodes, or with `hidden_everywhere` all it fed."""
    if not feed.hidden_layers:
        return []
    if feed.hidden_everywhere:
        return list(range(*span))
    return within(logits_for, span)


def within(indices: Sequence[int], span: tuple[int, int]) -> list[int]:
    """The ascending `indices` that fall in `span` (start, end)."""
    return list(indices[bisect_left(indices, span[0]) : bisect_left(indices, span[1])])


def shares_of(result: FeedResult[list[int]], feeds: Sequence[Feed], spans: Sequence[tuple[int, int]],
              logits_for: Sequence[int], states_at: Sequence[list[int]], layers: list[int]) -> list[FeedResult[list[int]]]:
    """Each work's share of a step's result: its nodes (`spans`), its logits rows, and the hidden
    states of its own `hidden_layers` (out of the step's `layers`) at its `states_at` nodes. The
    works' nodes, logits rows and state rows each follow work order, so every share is a slice."""
    shares, row, state_row = [], 0, 0
    for feed, (start, end), at in zip(feeds, spans, states_at):
        rows = len(within(logits_for, (start, end)))
        hidden = None
        if at:  # [len(at), the work's layers, hidden size]
            hidden = result.hidden[state_row : state_row + len(at), [layers.index(k) for k in feed.hidden_layers]]
        shares.append(FeedResult(result.nodes[start:end], result.logits[row : row + rows], hidden))
        row, state_row = row + rows, state_row + len(at)
    return shares


def new_scheduler(model, *, engine: Engine | None = None, compaction: CompactionPolicy | None = None,
                  apart: bool | None = None, cost=None, observer: Callable[[StepTrace], None] | None = None) -> Scheduler:
    """A scheduler over `engine` (a fresh `Engine(model)` by default). apart: see `Engine`;
    cost: the cost curve "auto" speculation uses (default: measured once and kept on disk);
    observer: see `Scheduler`."""
    return Scheduler(engine or Engine(model, apart=apart), compaction=compaction, cost=cost, observer=observer)


__all__ = ["ROOT", "CompactionPolicy", "Feed", "Scheduler", "Settled", "StepRecord", "StepTrace", "Work", "new_scheduler"]
