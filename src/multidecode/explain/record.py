"""Running a decoding and recording one of its steps, through the scheduler's observer hook.

The step is recorded in the observer callback, after the works settled and before rejected nodes
are dropped (`scheduler.StepTrace`): every fed node still has its slot, parent and position then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import data
from ..branches import BranchGroup, BranchRun, DecodeStats, start_prompts
from ..cost import CostCurve
from ..data import sample_excerpt
from ..errors import InvalidArgument, InvalidInput, is_int
from ..forest import ROOT
from ..models.converted import model_display_name
from ..prompts import check_document, check_questions
from ..sampling_params import per_branch_sampling
from ..scheduler import Scheduler, StepTrace, new_scheduler
from ..speculation import Speculation, build_speculation
from ..stopping import node_texts
from ..strategies import ask as ask_strategy
from .draw import draw
from .step import FedNode, Lane, StepCounts, StepView

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFAULT_QUESTIONS = 3
"""Questions of the sample transcript asked by default (a picture with more lanes gets crowded)."""

EXPLAIN_BUDGET = 4
"""Draft nodes per branch per step by default: enough for a tree, few enough to read."""

@dataclass
class Explanation:
    """A step of a real run, drawn: `figure` (a matplotlib Figure), `summary` (JSON-ready),
    `view` (the recorded step), `steps` (every step in numbers), `stats` (the run's)."""

    view: StepView
    steps: list[StepCounts]
    stats: DecodeStats
    summary: dict
    figure: Figure = field(repr=False)


def sample_questions(count: int = DEFAULT_QUESTIONS) -> list[str]:
    """The first `count` questions about the sample transcript."""
    return data.sample_questions()[:count]


def explain(decoder, *, document: str | None = None, questions: Sequence[str] | None = None,
            max_new_tokens: int = 32, speculate="lookup", draft_budget: int | None = EXPLAIN_BUDGET,
            step: int | None = None, cost: CostCurve | None = None, model_label: str | None = None,
            figsize: tuple[float, float] = (14.0, 7.0), dpi: int = 120) -> Explanation:
    """Answer `questions` about `document` (default: an excerpt of the sample transcript and three
    of its questions) with speculation, as `ask` does, and draw one step.

    decoder: a `MultiDecoder` (its model, tokenizer, compaction policy and cost curve are used).
    speculate, draft_budget: as `speculation.build_speculation` takes them; the run must speculate.
    step: the step to draw (2 or later); default: the one that shows verification best: drafts on
        at least two branches, some accepted and some rejected, and of such steps the one with the
        most accepted (the earliest of equals).
    cost: the cost curve "auto" uses (default: the decoder's, else measured once and kept).
    """
    document = sample_excerpt() if document is None else document
    questions = sample_questions() if questions is None else questions
    check_document(document)
    check_questions(questions)
    questions = list(questions)

    def begin(scheduler: Scheduler, spec: Speculation) -> BranchRun:
        return ask_strategy.start(scheduler, decoder.tokenizer, document, questions,
                                  max_new_tokens=max_new_tokens, speculate=spec)

    return _explain(decoder.model, begin, compaction=decoder.compaction, cost=cost or decoder.cost,
                    tokenizer=decoder.tokenizer, labels=questions, speculate=speculate,
                    draft_budget=draft_budget, step=step, model_label=model_label, figsize=figsize, dpi=dpi,
                    what=f"ask ({len(questions)} question{'s' * (len(questions) != 1)} about one document)")


def explain_prompts(model, prompts: Sequence[Sequence[int]], *, tokenizer=None, labels: Sequence[str] | None = None,
                    max_new_tokens: int = 32, speculate="lookup", draft_budget: int | None = EXPLAIN_BUDGET,
                    step: int | None = None, cost: CostCurve | None = None, eos_token_id=None,
                    model_label: str | None = None, figsize: tuple[float, float] = (14.0, 7.0),
                    dpi: int = 120) -> Explanation:
    """`explain` for whole prompts (token ids) on any causal LM: greedy branches, their common run
    of ids shared. tokenizer: for the tokens' text (default: the ids); labels: one per prompt."""

    def begin(scheduler: Scheduler, spec: Speculation) -> BranchRun:
        return start_prompts(scheduler, prompts, max_new_tokens=max_new_tokens,
                             sampling=per_branch_sampling(len(prompts), {}), tokenizer=tokenizer,
                             eos_token_id=eos_token_id, speculate=spec)

    return _explain(model, begin, compaction=None, cost=cost, tokenizer=tokenizer, labels=labels,
                    speculate=speculate, draft_budget=draft_budget, step=step, model_label=model_label,
                    figsize=figsize, dpi=dpi, what="decode")


def _explain(model, begin, *, compaction, cost, tokenizer, labels, speculate, draft_budget, step, model_label,
             figsize, dpi, what: str) -> Explanation:
    """Run `begin(scheduler, speculation)` to the end on a new scheduler that records every step."""
    if step is not None and (not is_int(step) or step < 2):
        raise InvalidArgument(f"step must be an integer of 2 or more, got {step!r}",
                              "step 1 feeds the prompts; pick a later step, or leave it unset to choose one")
    recorder = _Recorder(tokenizer, labels, step)
    scheduler = new_scheduler(model, compaction=compaction, cost=cost, observer=recorder)
    recorder.scheduler = scheduler
    spec = build_speculation(speculate, scheduler.engine.dtype, budget=draft_budget, exact=scheduler.engine.exact)
    if spec is None:
        raise InvalidArgument("explain draws a speculative step, but this run would not speculate",
                              "use speculate='lookup' (or 'auto' in float32)")
    run = begin(scheduler, spec).finish()
    view = recorder.view
    total = len(recorder.counts)
    if step is not None and view is None:
        raise InvalidArgument(f"the run took {total} step{'s' * (total != 1)}, so there is no step {step}",
                              f"pick a step from 2 to {total}" if total >= 2 else "raise max_new_tokens")
    if step is None and (view is None or not any(lane.drafts for lane in view.lanes)):
        raise InvalidInput(f"no step of this run fed a draft token ({total} step{'s' * (total != 1)}, speculate={spec.name})",
                           "ask about text the answers quote or raise max_new_tokens"
                           + (", or use speculate='lookup' (auto drafts only where it pays)" if spec.auto else ""))
    view.steps = total
    label = model_label or model_display_name(scheduler.engine.model)
    summary = summarize(view, run.stats, model=label, speculate=spec)
    title = _title(view, label, spec, what)
    figure = draw(view, title=title, figsize=figsize, dpi=dpi)
    return Explanation(view, recorder.counts, run.stats, summary, figure)


class _Recorder:
    """The observer: counts every step and copies out the chosen one (see the module notes)."""

    def __init__(self, tokenizer, labels, step: int | None) -> None:
        self.tokenizer, self.labels, self.step = tokenizer, labels, step
        self.scheduler: Scheduler | None = None  # set once the scheduler exists
        self.counts: list[StepCounts] = []
        self.view: StepView | None = None
        self._best: tuple[int, ...] = (-1,)

    def __call__(self, trace: StepTrace) -> None:
        group = next(w for w in self.scheduler.works if isinstance(w, BranchGroup))
        if trace.step == 1:  # the prompts: only the run's own counts say which nodes are drafts
            drafts, accepted = group.stats.draft_budgets[-1], group.stats.accepted
            self.counts.append(StepCounts(1, len(trace.nodes), drafts, accepted, drafts - accepted, 0))
            return
        lanes = _lanes(trace, group)
        # Not every fed node below a head is a draft: side nodes (lookahead's window, which "auto"
        # feeds where it is nearly free) are fed and taken back unverified. The group's own record
        # of this step's draft nodes tells them apart, so the counts agree with the run's stats.
        drafts = group.draft_nodes
        drafted = sum(node in drafts for node in trace.nodes)
        rejected = sum(node in drafts for node in trace.rejected)
        counts = StepCounts(trace.step, len(trace.nodes), drafted, drafted - rejected, rejected,
                            sum(any(node in drafts for node in b) for b in lanes.values()))
        self.counts.append(counts)
        if self.step is not None:
            if trace.step == self.step:
                self.view = _view(trace, group, lanes, self.tokenizer, self.labels)
            return
        score = _score(counts, live=len(lanes))
        if score > self._best:
            self._best = score
            self.view = _view(trace, group, lanes, self.tokenizer, self.labels)


def _score(counts: StepCounts, *, live: int) -> tuple[int, ...]:
    """How well a step shows verification: drafts on at least two branches (or all live ones), some
    accepted and some rejected, then the most accepted; a step must beat the earlier ones to be
    chosen, so of equals the first wins."""
    return (int(counts.drafts > 0), int(counts.accepted > 0) + int(counts.rejected > 0),
            int(counts.branches_with_drafts >= min(2, live)), counts.accepted)


def _lanes(trace: StepTrace, group: BranchGroup) -> dict[int, list[int]]:
    """Branch index -> the nodes it fed in this decode step, in feed order (its head first).

    A head is a fed node whose parent was cached before; a branch's leaf (moved by settling to the
    end of its accepted path) leads up to it.
    """
    forest = trace.forest
    fed = set(trace.nodes)
    top: dict[int, int] = {}
    for node in trace.nodes:  # parents come before children
        parent = forest.parents[node]
        top[node] = top[parent] if parent in fed else node
    branch_of_head = {top[b.leaf]: b.index for b in group.branches if b.leaf in fed}
    lanes: dict[int, list[int]] = {}
    for node in trace.nodes:
        lanes.setdefault(branch_of_head[top[node]], []).append(node)
    return dict(sorted(lanes.items()))


def _view(trace: StepTrace, group: BranchGroup, lanes: dict[int, list[int]], tokenizer, labels) -> StepView:
    """Copy the step out of the forest (it changes as soon as the callback returns)."""
    forest = trace.forest
    rejected = set(trace.rejected)
    drafts = group.draft_nodes

    def status(node: int, depth: int) -> str:
        """A fed node's part: the head, a draft the target verified, or a side node (fed for its logits only)."""
        if depth == 0:
            return "head"
        if node not in drafts:
            return "side"
        return "rejected" if node in rejected else "accepted"

    order = {"accepted": 0, "rejected": 1, "side": 2}
    prefix_length = len(group.prefix_ids)
    out: list[Lane] = []
    for index, nodes in lanes.items():
        branch = group.branches[index]
        head = nodes[0]
        path = forest.path_tokens(head)  # prompt, answer so far, head
        children: dict[int, list[int]] = {}
        for node in nodes[1:]:
            children.setdefault(forest.parents[node], []).append(node)
        ordered: list[tuple[int, int]] = []  # (node, depth), depth-first, accepted child first
        stack = [(head, 0)]
        while stack:
            node, depth = stack.pop()
            ordered.append((node, depth))
            kids = sorted(children.get(node, []), key=lambda n: order[status(n, depth + 1)])
            stack.extend((kid, depth + 1) for kid in reversed(kids))
        texts = node_texts(tokenizer, forest, [node for node, _ in ordered])  # a split character shown whole
        fed = [FedNode(node, forest.tokens[node], text, forest.parents[node], forest.positions[node],
                       forest.slot_of[node], depth, status(node, depth)) for (node, depth), text in zip(ordered, texts)]
        tail = path[prefix_length:branch.prompt_length]
        answer = path[branch.prompt_length:-1]
        label = labels[index] if labels is not None and index < len(labels) else f"branch {index + 1}"
        next_token, next_text = _next_token(tokenizer, branch.output.token_ids, len(answer), fed)
        out.append(Lane(index, label, tail, token_text(tokenizer, tail), answer, token_text(tokenizer, answer), fed,
                        next_token, next_text, branch.output.finished))
    rows = [n for lane in out for n in lane.nodes]
    visible = torch.zeros(len(rows), forest.num_slots, dtype=torch.bool)  # [rows, slots]
    for i, row in enumerate(rows):
        node = row.node
        while node != ROOT:
            visible[i, forest.slot_of[node]] = True
            node = forest.parents[node]
    slot_branch: list[int | None] = [None] * forest.num_slots
    for b in group.branches:
        if b.leaf is None:
            continue
        for depth, node in enumerate(forest.path(b.leaf)):
            slot = forest.slot_of[node]
            if slot is not None:
                slot_branch[slot] = -1 if depth < prefix_length else b.index
    for lane in out:  # drafts (rejected ones too) belong to their branch
        for n in lane.nodes:
            slot_branch[n.slot] = lane.branch
    return StepView(trace.step, prefix_length, token_text(tokenizer, group.prefix_ids), forest.num_slots, out,
                    visible, slot_branch)


def _next_token(tokenizer, token_ids: Sequence[int], answered: int, fed: Sequence[FedNode]) -> tuple[int | None, str]:
    """The target's next token after a lane's accepted drafts, and its text: the branch's last,
    where it got more tokens this step than it accepted (`answered`: its answer before the step,
    less the head); (None, "") where it ended on a draft it accepted."""
    if len(token_ids) - answered - 1 > sum(n.status == "accepted" for n in fed):
        return token_ids[-1], token_text(tokenizer, token_ids[-1:])
    return None, ""

def token_text(tokenizer, ids: Sequence[int]) -> str:
    """The text of `ids` as the tokenizer writes it (special tokens kept); ids without one."""
    if tokenizer is None:
        return " ".join(map(str, ids))
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=False)
    except TypeError:
        return tokenizer.decode(list(ids))


def summarize(view: StepView, stats: DecodeStats, *, model: str, speculate: Speculation) -> dict:
    """A JSON-ready account of the step (and of the run it came from)."""
    branches = []
    for lane in view.lanes:
        head = lane.nodes[0]
        branches.append({
            "branch": lane.branch,
            "label": lane.label,
            "head": {"token_id": head.token, "text": head.text, "position": head.position, "slot": head.slot},
            "draft_size": len(lane.drafts),
            "accepted": len(lane.accepted),
            "rejected": len(lane.rejected),
            "side_nodes": len(lane.side),
            "accepted_text": "".join(n.text for n in lane.accepted),
            "next_token": {"token_id": lane.next_token, "text": lane.next_text},  # null id: it ended on a draft
            "positions": [min(n.position for n in lane.nodes), max(n.position for n in lane.nodes)],
            "prompt_tail_tokens": len(lane.tail),
            "answer_tokens_before": len(lane.answer),
            "finished": lane.finished,
        })
    rows = view.rows
    return {
        "model": model,
        "speculate": speculate.name,
        "draft_budget": speculate.size,
        "step": view.step,
        "steps": view.steps,
        "cache_slots": view.num_slots,
        "prefix_tokens": view.prefix_length,
        "fed": len(rows),
        "drafted": sum(r.status in ("accepted", "rejected") for r in rows),
        "accepted": sum(r.status == "accepted" for r in rows),
        "rejected": sum(r.status == "rejected" for r in rows),
        "side_nodes": sum(r.status == "side" for r in rows),
        "branches": branches,
        "run": stats.as_dict(),
    }


def _title(view: StepView, model: str, spec: Speculation, what: str) -> str:
    """Two lines: what ran and which step; what the step fed and what came of it."""
    rows = view.rows
    accepted = sum(r.status == "accepted" for r in rows)
    rejected = sum(r.status == "rejected" for r in rows)
    budget = "chosen by cost" if spec.auto else f"at most {spec.size} per branch"
    side = sum(r.status == "side" for r in rows)
    lanes, gained = len(view.lanes), sum(lane.gained for lane in view.lanes)
    return (f"One verification step of {what}, speculate={spec.name}, on {model}: step {view.step} of {view.steps}\n"
            f"{lanes} branch{'es' * (lanes != 1)} in one forward, {accepted + rejected} draft tokens ({budget})"
            + (f" and {side} side nodes (fed for their logits only)" if side else "")
            + f": {accepted} accepted, {rejected} rejected, so {gained} token{'s' * (gained != 1)} emitted")


__all__ = ["Explanation", "explain", "explain_prompts", "sample_excerpt", "sample_questions", "summarize", "token_text"]
