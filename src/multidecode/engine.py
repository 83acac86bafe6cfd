"""The engine: feeds forest nodes through a causal LM over one shared cache, and nothing else.

One call, `feed`, adds nodes to the forest, runs them through the model's public `forward` in one
pass, and returns the logits at the nodes asked for. Strategies (ask, complete, beam, ...) decide
which nodes to add and which leaves stay alive; the engine does not know which one is running.

A feed takes one of two paths:

- **plain**: the new nodes form one chain that continues everything already cached (a prefix
  prefill). The model's own causal mask is exact here and is the fastest path, so no mask is
  passed.
- **forest**: anything else. The model gets position ids equal to the nodes' positions and a 4D
  float mask over `[cached slots + new nodes]` that lets each node see itself and its ancestors
  (window-folded per layer type, see `masks`).

The LM head runs only where logits are wanted (`logits_to_keep` with an index tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .cache import SlotCache
from .forest import ROOT, Forest, chain_parents
from .masks import build_attention_mask
from .models import check_supported, mask_layout, max_positions

APART_MIN_MEAN_LENGTH = 64
"""Chains shorter than this on average are prefilled together (see `Engine.prefers_apart`)."""


@dataclass
class EngineStats:
    """Counters a benchmark or a caller may read."""

    forward_passes: int = 0
    tokens_fed: int = 0
    compactions: int = 0
    peak_slots: int = 0
    peak_cache_bytes: int = 0
    slots_dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Engine:
    """A forest of token nodes decoded over one shared KV cache of `model`.

    model: any transformers causal LM with eager or sdpa attention (checked on construction).
    capacity: cache slots to preallocate; the cache grows by doubling past it.
    """

    def __init__(self, model, *, capacity: int = 0) -> None:
        check_supported(model)
        self.model = model
        self.forest = Forest()
        self.cache = SlotCache(capacity)
        self.layout = mask_layout(model.config)
        self.max_positions = max_positions(model.config)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.stats = EngineStats()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    # ------------------------------------------------------------------ feeding
    def feed(
        self,
        tokens: Sequence[int],
        parents: Sequence[int],
        *,
        logits_for: Sequence[int] = (),
        root_position: int = 0,
    ) -> tuple[list[int], torch.Tensor]:
        """Add nodes (see `Forest.add` for `parents`) and run them in one forward pass.

        logits_for: indices into this call's nodes whose next-token logits to return.
        Returns (new node ids, logits [len(logits_for), vocab] in float32).
        """
        forest = self.forest
        nodes = forest.add(tokens, parents, root_position=root_position)
        if not nodes:
            return nodes, torch.empty(0, 0)
        positions = self._positions(nodes)  # [q]
        forest.place(nodes)
        if forest.is_plain_continuation(nodes):
            mask = None
        else:
            rows = forest.attention_rows(nodes)  # [q, past + q]
            mask = build_attention_mask(
                rows, positions, forest.slot_positions(), self.layout, self.dtype, self.device
            )
        if mask is None:
            # Keep visibility rows in step for later forest feeds on top of this chain.
            forest.attention_rows(nodes[-1:])
        keep = torch.tensor(list(logits_for) or [len(nodes) - 1], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([list(tokens)], dtype=torch.long, device=self.device),
                position_ids=positions[None].to(self.device),
                attention_mask=mask,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=keep,
            )
        self._count(len(nodes))
        logits = out.logits[0].float() if logits_for else out.logits[0, :0].float()  # [len(logits_for), vocab]
        return nodes, logits

    def feed_chain(
        self, tokens: Sequence[int], parent: int = ROOT, *, root_position: int = 0, logits: bool = True
    ) -> tuple[list[int], torch.Tensor]:
        """Feed one straight sequence under `parent`; logits of its last node if `logits`."""
        return self.feed(
            tokens, chain_parents(len(tokens), parent), logits_for=[len(tokens) - 1] if logits and tokens else (),
            root_position=root_position,
        )

    def feed_chains(
        self, chains: Sequence[Sequence[int]], parents: Sequence[int], *, root_position: int = 0
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Feed several sequences in one pass, chain i under `parents[i]`.

        Returns the node ids of each chain and the logits at each non-empty chain's last node
        ([number of non-empty chains, vocab]), in chain order.
        """
        tokens: list[int] = []
        flat_parents: list[int] = []
        last_index: list[int] = []
        spans = []
        for chain, parent in zip(chains, parents):
            start = len(tokens)
            tokens.extend(chain)
            flat_parents.extend(chain_parents(len(chain), parent, start))
            spans.append((start, len(tokens)))
            if chain:
                last_index.append(len(tokens) - 1)
        nodes, logits = self.feed(tokens, flat_parents, logits_for=last_index, root_position=root_position)
        return [nodes[a:b] for a, b in spans], logits

    def feed_apart(
        self, chains: Sequence[Sequence[int]], parent: int = ROOT, *, root_position: int = 0
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Feed several sequences under `parent`, each in its own pass, as if `parent`'s path were
        all that is cached.

        The path's keys and values are gathered into a scratch cache; each chain runs there under
        the model's own causal mask and its new keys and values are appended to the shared cache.
        A chain so never pays attention work for the other chains' slots, which one forest pass
        over long chains does (masked, but computed). Same result as `feed_chains` with every
        parent equal; worth it when the chains are long and the path is short.

        Returns the node ids of each chain and the logits at each non-empty chain's last node
        ([number of non-empty chains, vocab]), in chain order.
        """
        forest = self.forest
        # [width] the slots of `parent`'s path, in cache order
        path = forest.compaction_plan([parent]) if parent != ROOT else torch.empty(0, dtype=torch.long)
        width = path.numel()
        scratch = SlotCache(width + max((len(c) for c in chains), default=0))
        with torch.inference_mode():
            for i, layer in enumerate(self.cache.layers):
                keep = path.to(layer.keys.device)
                scratch.update(layer.keys.index_select(2, keep), layer.values.index_select(2, keep), i)
        out_nodes: list[list[int]] = []
        rows: list[torch.Tensor] = []
        for chain in chains:
            if not chain:
                out_nodes.append([])
                continue
            nodes = forest.add_chain(chain, parent, root_position=root_position)
            positions = self._positions(nodes)  # [len(chain)]
            with torch.inference_mode():
                out = self.model(
                    input_ids=torch.tensor([list(chain)], dtype=torch.long, device=self.device),
                    position_ids=positions[None].to(self.device),
                    past_key_values=scratch,
                    use_cache=True,
                    logits_to_keep=1,
                )
                forest.place(nodes)
                for i, layer in enumerate(scratch.layers):
                    self.cache.update(layer.keys[:, :, width:], layer.values[:, :, width:], i)
                scratch.crop(-len(chain))
            forest.attention_rows(nodes[-1:])
            self._count(len(nodes), extra_bytes=scratch.allocated_bytes)
            out_nodes.append(nodes)
            rows.append(out.logits[0, -1].float())
        logits = torch.stack(rows) if rows else torch.empty(0, 0)
        return out_nodes, logits

    def prefers_apart(self, lengths: Sequence[int], parent: int = ROOT) -> bool:
        """Whether `feed_apart` beats one forest pass for chains of `lengths` under `parent`.

        One forest pass computes attention (masked, but computed) from every new token to every
        slot: S x (slots + S) for S new tokens. Apart, a chain sees only its path of A slots:
        L x (A + L) per chain, plus copying the path once per chain. The weights' matmuls cost
        the same either way, but every extra pass reads all the weights again, which short chains
        cannot repay: apart needs chains of `APART_MIN_MEAN_LENGTH` tokens on average. Many
        questions of ~20 tokens under a long document stay together; long chunks under a short
        instruction go apart.
        """
        lengths = [n for n in lengths if n]
        if len(lengths) < 2 or sum(lengths) < APART_MIN_MEAN_LENGTH * len(lengths):
            return False
        total = sum(lengths)
        path = len(self.forest.path(parent)) if parent != ROOT else 0
        together = total * (self.forest.num_slots + total)
        apart = sum(n * (path + n) for n in lengths) + len(lengths) * path
        return together > 2 * apart

    def _positions(self, nodes: Sequence[int]) -> torch.Tensor:
        """Position ids of new nodes ([len(nodes)]), refused past the model's last position."""
        positions = self.forest.positions_of(nodes)
        top = int(positions.max())
        if self.max_positions is not None and top >= self.max_positions:
            from .errors import PromptTooLong

            raise PromptTooLong(
                f"position {top} is past the model's maximum of {self.max_positions} positions",
                "shorten the document or lower max_new_tokens",
            )
        return positions

    # ------------------------------------------------------------------ memory
    def reserve(self, slots: int) -> None:
        """Preallocate the cache for `slots` slots in all."""
        self.cache.reserve(slots)

    def compact(self, live: Sequence[int]) -> int:
        """Drop every cached slot that is not `live` or an ancestor of a live node.

        Returns the number of slots dropped. Exact: positions are node data and do not move.
        """
        return self._compact(self.forest.compaction_plan(live))

    def compact_if_due(self, live: Sequence[int], due: Callable[[int, int], bool]) -> int:
        """`compact(live)` if `due(dead slots, all slots)` says so; returns the slots dropped."""
        keep = self.forest.compaction_plan(live)
        if not due(self.forest.num_slots - keep.numel(), self.forest.num_slots):
            return 0
        return self._compact(keep)

    def _compact(self, keep: torch.Tensor) -> int:
        """Keep only the slots `keep` ([n] slot indices, ascending), in the cache and the forest."""
        dropped = self.forest.num_slots - keep.numel()
        if dropped == 0:
            return 0
        self.cache.compact(keep)
        self.forest.compact(keep)
        self.stats.compactions += 1
        self.stats.slots_dropped += dropped
        return dropped

    def _count(self, fed: int, extra_bytes: int = 0) -> None:
        """Count a forward pass; extra_bytes is KV held beside the shared cache (a scratch cache)."""
        s = self.stats
        s.forward_passes += 1
        s.tokens_fed += fed
        s.peak_slots = max(s.peak_slots, self.forest.num_slots)
        s.peak_cache_bytes = max(s.peak_cache_bytes, self.cache.allocated_bytes + extra_bytes)
