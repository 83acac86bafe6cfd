"""One recorded verification step, as data: what the picture of a step is drawn from.

Terms (those of `branches` and `verify`, plus the picture's own; see `multidecode.explain`):
a **lane** is one branch of the step: its prompt tail, its answer so far, and the nodes it fed
(its **head**, then its draft tree), each **accepted** or **rejected**; the `StepView` holds the
lanes and, per fed node, which cache slots it sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FedNode:
    """One node fed in the step. parent: its parent's node id (for a head, the branch's last
    cached node); depth: 0 for the head, 1 for its children, ...; status: "head", "accepted",
    "rejected" or "side" (a proposer's side node, such as lookahead's Jacobi window: fed for its
    logits only, never verified and always taken back, so it is no draft token)."""

    node: int
    token: int
    text: str
    parent: int
    position: int
    slot: int
    depth: int
    status: str


@dataclass
class Lane:
    """One branch in the step: what it held before (its own prompt tail, its answer so far), the
    nodes it fed (head first, then its draft tree depth-first), and the target's next token (None
    where the branch ended on a draft it accepted: the token it ended on was fed as that draft)."""

    branch: int
    label: str
    tail: list[int]
    tail_text: str
    answer: list[int]
    answer_text: str
    nodes: list[FedNode]
    next_token: int | None
    next_text: str
    finished: bool

    @property
    def drafts(self) -> list[FedNode]:
        """The draft nodes, verified by the target (side nodes are not drafts: the run does not count them)."""
        return [n for n in self.nodes if n.status in ("accepted", "rejected")]

    @property
    def accepted(self) -> list[FedNode]:
        return [n for n in self.nodes if n.status == "accepted"]

    @property
    def gained(self) -> int:
        """The tokens the branch got this step: its accepted drafts, and the target's next token."""
        return len(self.accepted) + (self.next_token is not None)

    @property
    def rejected(self) -> list[FedNode]:
        return [n for n in self.nodes if n.status == "rejected"]

    @property
    def side(self) -> list[FedNode]:
        return [n for n in self.nodes if n.status == "side"]


@dataclass(frozen=True)
class StepCounts:
    """One step in numbers: rows fed, draft nodes among them, and their fate (side nodes are fed
    rows, but no drafts). For step 1 (the prompts) the draft counts are the run's own and
    branches_with_drafts is not counted (0)."""

    step: int
    rows: int
    drafts: int
    accepted: int
    rejected: int
    branches_with_drafts: int


@dataclass
class StepView:
    """Everything the picture of one step needs, copied out of the forest at that step.

    visible: [rows, num_slots] bool, row i for `rows[i]`: True at the slot of the node and of each
    of its ancestors. slot_branch[s]: the branch whose own nodes hold slot s, -1 for the shared
    prefix, None for a slot no branch of this run holds.
    """

    step: int
    prefix_length: int
    prefix_text: str
    num_slots: int
    lanes: list[Lane]
    visible: torch.Tensor
    slot_branch: list[int | None]
    steps: int = 0  # how many steps the whole run took (set when it ends)

    @property
    def rows(self) -> list[FedNode]:
        return [n for lane in self.lanes for n in lane.nodes]


__all__ = ["FedNode", "Lane", "StepCounts", "StepView"]
