"""Medusa heads: small heads on the target's last hidden state, each guessing one token further ahead.

Medusa (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads", arXiv 2401.10774) adds K **heads** to a frozen target. Each reads h, the target's
last hidden state (after its final norm: what its LM head reads) at one position, and guesses a
token further ahead than the LM head does: `head k` computes

    r_k = h + SiLU(W_k h + b_k)        (a residual block; `num_layers` of them in a row)
    logits_k = P_k r_k                 (a projection onto the vocabulary)

Terms. When a branch's newest token x has just been chosen from the logits at node n, head k
reads the hidden state at n and guesses the token k + 1 places after x (head 0: the token right
after x). Their top candidates make one **draft tree** under x: a node's chance is the product of
the heads' probabilities along its path (the heads are read as independent), and the tree keeps
the likeliest nodes best first, so it is the candidates' product pruned by estimated chance. The
target verifies the tree in the same forward as every other branch's tokens (`verify`), so output
is exact whatever the heads guess.

The **projection** P_k is the head's own matrix in published heads; heads trained here share the
target's LM head instead and read only the rows of a **draft vocabulary** (the tokens the target
writes most, `token_ids`), so a head costs a few residual blocks and a product over a few thousand
rows, and is a few MB on disk. A sampled branch draws each candidate set from the heads' softmax,
warped by the branch's own settings, and hands that distribution to verification
(`DraftTree.dists`), which keeps the branch's output distribution exact.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgument
from ..models.packed import PackedLinear
from .base import UNDER_LEAF, BranchContext, DraftTree, Proposer
from .drafting import add_candidates, draft_distribution, draft_generator
from .heads import check_head_fits, load_checked, on_device_of, read_config, read_tensors, write_head

WEIGHTS = "medusa_lm_head"
"""The stem of a Medusa head's weights file, as the Medusa project names it."""


class ResBlock(nn.Module):
    """x + SiLU(W x + b): the block of a Medusa head (W starts at zero: the head starts as the LM head)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads (see the module notes).

    hidden_size, vocab_size: the target's. num_heads: K. num_layers: residual blocks per head.
    token_ids: the draft vocabulary ([V'] target token ids; None: the whole vocabulary).
    own_projection: each head has its own [V', hidden] projection (published Medusa heads), else
    the heads share the target's LM head rows of the draft vocabulary (`bind` reads them).
    target: the fingerprint of the model the heads were trained for (`heads.fingerprint`).
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, *, num_layers: int = 1,
                 token_ids: torch.Tensor | None = None, own_projection: bool = False, target: dict | None = None) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size, self.num_heads, self.num_layers = hidden_size, vocab_size, num_heads, num_layers
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])
                                    for _ in range(num_heads))
        self.register_buffer("token_ids", None if token_ids is None else token_ids.long())
        width = vocab_size if token_ids is None else len(token_ids)
        self.projections = (nn.ModuleList(nn.Linear(hidden_size, width, bias=False) for _ in range(num_heads))
                            if own_projection else None)
        self.shared: torch.Tensor | None = None  # [V', hidden] float32: the target's LM head rows (bound)
        self.target = target

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size if self.token_ids is None else len(self.token_ids)

    @staticmethod
    def reads(config: dict) -> bool:
        """Whether a head folder's config is in Medusa's layout (published heads and ours name `medusa_num_heads`)."""
        return "medusa_num_heads" in config

    def bind(self, model) -> MedusaHeads:
        """Check these heads fit `model` (and were trained for it), and read its LM head rows."""
        check_head_fits(model, self.hidden_size, self.vocab_size, self.target, "medusa", token_ids=self.token_ids)
        on_device_of(self, model)
        if self.projections is None and self.shared is None:
            ids = self.token_ids if self.token_ids is not None else torch.arange(self.vocab_size)
            self.shared = output_rows(model, ids)
        return self

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, hidden] (the target's last hidden states) -> logits [B, K, V'] float32."""
        x = features.float()
        states = torch.stack([block(x) for block in self.blocks], 1)  # [B, K, hidden]
        if self.projections is not None:
            return torch.stack([p(states[:, k]) for k, p in enumerate(self.projections)], 1).float()
        if self.shared is None:
            raise InvalidArgument("the Medusa heads share the target's LM head and are not bound to a model",
                                  "call heads.bind(model) (speculation does it when a run starts)")
        return states @ self.shared.T  # [B, K, V']

    # ------------------------------------------------------------------ files
    def save(self, folder: str | Path, *, extra: dict | None = None) -> Path:
        """Write the heads in Medusa's layout (config.json, medusa_lm_head.safetensors); a shared
        projection is not written (it is the target's), a draft vocabulary is (`token_ids`)."""
        tensors = {k: v for k, v in self.state_dict().items() if not k.startswith("projections")}
        tensors = {_medusa_key(k): v for k, v in tensors.items()}
        if self.projections is not None:
            tensors.update({f"{k}.{self.num_layers}.weight": p.weight for k, p in enumerate(self.projections)})
        config = {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                  "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                  "shares_lm_head": self.projections is None, "draft_vocab_size": self.draft_vocab_size,
                  "multidecode_target": self.target, **(extra or {})}
        return write_head(Path(folder), WEIGHTS, config, tensors)

    @classmethod
    def load(cls, folder: str | Path) -> MedusaHeads:
        """Heads from a folder in Medusa's layout: published ones (`medusa_num_heads`,
        `medusa_num_layers`, each head's blocks and projection) or ones written by `save`."""
        what = "the Medusa heads"
        config = read_config(Path(folder), what)
        tensors = read_tensors(Path(folder), WEIGHTS, what)
        try:
            heads, layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
            hidden = int(config.get("hidden_size") or tensors["0.0.linear.weight"].shape[0])
            own = f"0.{layers}.weight" in tensors
            vocab = int(config.get("vocab_size") or tensors[f"0.{layers}.weight"].shape[0])
        except (KeyError, ValueError, TypeError) as err:
            raise InvalidArgument(f"{what} in {folder} are not in Medusa's layout (missing {err})",
                                  "give a folder with config.json (medusa_num_heads) and medusa_lm_head weights") from None
        module = cls(hidden, vocab, heads, num_layers=layers, token_ids=tensors.pop("token_ids", None),
                     own_projection=own, target=config.get("multidecode_target"))
        state = {_module_key(k, layers): v for k, v in tensors.items()}
        missing, unexpected = load_checked(module, state, f"the file of {what} in {folder}")
        missing = [k for k in missing if k != "token_ids"]  # given to the constructor
        if missing or unexpected:
            raise InvalidArgument(f"{what} in {folder} do not match their config "
                                  f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})",
                                  "rewrite the head with `multidecode train-drafter`, or fix its config.json")
        module.config = config
        return module


def _medusa_key(key: str) -> str:
    """blocks.{k}.{j}.linear.weight -> {k}.{j}.linear.weight (Medusa's names)."""
    return key.removeprefix("blocks.")


def _module_key(key: str, layers: int) -> str:
    """Medusa's names -> this module's: {k}.{layers}.weight is head k's projection."""
    head, _, rest = key.partition(".")
    if rest == f"{layers}.weight":
        return f"projections.{head}.weight"
    return f"blocks.{key}"


def output_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """[len(ids), hidden] float32: the rows `ids` of the target's LM head (packed or not)."""
    head = model.get_output_embeddings()
    with torch.no_grad():  # not inference mode: training reads these rows under autograd
        if isinstance(head, PackedLinear):
            return head.rows(ids.to(head.codes.device)).float().clone()
        return head.weight[ids.to(head.weight.device)].float().clone()


class Medusa(Proposer):
    """Drafts with Medusa heads (see the module notes).

    width: candidates per head considered under each node. min_chance: nodes whose estimated
    chance (the product of the heads' probabilities down their path) falls below this are not
    proposed. A node's prior is its head's probability of it: its chance once its parent is accepted.
    """

    name = "medusa"
    layers = (-1,)
    default_budget = 4

    # The defaults measured best on the three speculate workloads on this CPU (docs/benchmarks.md).
    def __init__(self, heads: MedusaHeads, *, width: int = 2, min_chance: float = 0.01) -> None:
        self.heads = heads
        self.width, self.min_chance = width, min_chance

    def check(self, model) -> None:
        self.heads.bind(model)

    def propose_many(self, contexts: Sequence[BranchContext], budget: int) -> list[DraftTree]:
        trees = [DraftTree() for _ in contexts]
        ready = [i for i, c in enumerate(contexts) if c.features is not None]
        if not ready or budget < 1:
            return trees
        features = torch.stack([contexts[i].features_of(self.layers)[-1, -1] for i in ready])  # [B, hidden]
        with torch.inference_mode():
            logits = self.heads(features).cpu()  # [B, K, V'] (the heads sit on the target's device)
        for i, row in zip(ready, logits):
            sampled = contexts[i].sampling.do_sample
            trees[i] = self._sampled(contexts[i], row, budget) if sampled else self._greedy(row, budget)
        return trees

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        return self.propose_many([context], budget)[0]

    def _target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.heads.token_ids is None else self.heads.token_ids.cpu()[ids]

    def _greedy(self, logits: torch.Tensor, budget: int) -> DraftTree:
        """The likeliest nodes of the heads' candidates' product, best first ([K, V'] logits)."""
        chances, ids = logits.softmax(-1).topk(min(self.width, logits.shape[-1]), -1)  # [K, width]
        tokens = self._target_ids(ids).tolist()
        chances = chances.tolist()
        tree = DraftTree()
        # (-chance, order, parent, depth, rank): depth 0 is head 0, under the newest token
        frontier = [(-chances[0][r], r, UNDER_LEAF, 0, r) for r in range(len(tokens[0]))]
        heapq.heapify(frontier)
        order = len(frontier)
        while frontier and len(tree) < budget:
            chance, _, parent, depth, rank = heapq.heappop(frontier)
            if -chance < self.min_chance:
                break
            node = tree.add(tokens[depth][rank], parent, kind=depth + 1, prior=chances[depth][rank])
            if depth + 1 < len(tokens):
                for r in range(len(tokens[depth + 1])):
                    heapq.heappush(frontier, (chance * chances[depth + 1][r], order, node, depth + 1, r))
                    order += 1
        return tree

    def _sampled(self, context: BranchContext, logits: torch.Tensor, budget: int) -> DraftTree:
        """A chain with siblings: under each node, candidates drawn without replacement from head
        k's softmax warped by the branch's settings, the first one continued."""
        generator = context.scratch.get("medusa")
        if generator is None:
            generator = context.scratch["medusa"] = draft_generator(context.sampling)
        tree, parent, chance = DraftTree(), UNDER_LEAF, 1.0
        for depth, row in enumerate(logits):
            q = draft_distribution(row, self.heads.token_ids, self.heads.vocab_size, context.sampling)  # [vocab]
            drawn = add_candidates(tree, parent, q, min(self.width, budget - len(tree)), generator, kind=depth + 1)
            if not drawn:
                break
            first, _, q_first = drawn[0]
            chance *= q_first
            if chance < self.min_chance:
                break
            parent = first
        return tree
