"""The engine: feeds forest nodes through a causal LM over one shared cache, and nothing else.

One call, `feed`, adds nodes to the forest, runs them through the model's public `forward`, and
returns a `FeedResult`: the new nodes, the logits at the nodes asked for and, for a learned
drafter, the hidden states asked for. It is the only caller of `model.forward` in the package, and
its result is all that the layers above read of a forward. Strategies and the scheduler decide which nodes to add, which to take back and which
leaves stay alive; the engine does not know which strategy or proposer is running.

A feed is planned as one or more forwards over contiguous runs of its nodes:

- **plain**: a chain that continues everything already cached (a prefix prefill, or one branch
  alone) runs under the model's own causal mask, the fastest path for one token or for a long
  chain; no mask is passed.
- **apart**: several long chains (chunks of a document under a short instruction) each run in a
  scratch cache holding only their parent's path, so none pays attention work for the others'
  slots; their keys are then appended to the shared cache (`prefers_apart` decides).
- **forest**: anything else, in one forward. Position ids are the nodes' positions and a 4D float
  mask over `[cached slots + new nodes]` lets each node see itself and its ancestors
  (window-folded per layer type, see `masks`).

A long plain trunk at the head of a feed (a document, then its questions) runs plain first, and
the rest goes apart or as a forest. In a mixed feed (a new document's prompt beside branches that
are decoding, as in a merged batch forest or a server), a long chain under a cached node is
placed first and runs apart, so its hundreds of tokens do not attend to every other request's
slots; the feed's cache order is then not its call order, which only the engine sees. The LM head runs only where logits are wanted
(`logits_to_keep` with an index tensor).

Taking nodes back: `drop(nodes)` removes rejected draft nodes from the forest and their slots from
the cache (the accepted slots after the first rejected one move down, then the cache is cropped);
`compact(live, owner=...)` frees the slots of one owner's finished work.

Timing: once `time_forwards(model, recorder)` is called (the cost model does, see `cost`), every
engine over that model tells `recorder` the rows, the cached slots and the wall time of each plain
or forest forward it runs (an engine's first forward, its warm-up, left out), so that the cost of a
forward is learned from the forwards decoding runs anyway. No recorder: nothing is timed.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Generic, TypeVar

import torch

from .cache import SlotCache
from .compiled import CompileRefused, compiled_forward
from .errors import PromptTooLong
from .exact import ExactPlan, is_exact, plan_attention, plan_tensors
from .forest import EVERYONE, ROOT, Forest, chain_parents, unchanged_prefix
from .masks import build_attention_mask
from .memory import Footprint, Need
from .models.packed import activation_dtype, weights_device
from .models.vetting import cache_argument, check_supported, mask_layout, max_positions, positions_note

APART_MIN_MEAN_LENGTH = 64
"""Chains shorter than this on average are prefilled together (see `Engine.prefers_apart`)."""

TRUNK_MIN_LENGTH = 64
"""A plain chain runs under the model's own causal mask from this length on (or when it is a single
token), as its own forward at the head of a mixed feed. Below it, one more pass over the weights
costs more than the mask work it saves; and a short chain (a branch's next token and its draft)
is cheaper on the forest path, whose mask is ready-made and whose attention keeps grouped-query
heads grouped, than under a causal mask the model builds itself (measured on SmolLM2 with a
200-token context: 2 tokens 35.5 ms against 38.0 ms, 1 token 34.5 ms)."""


WINDOW_MIN_SKIP = 64
"""A forest forward leaves out the leading slots none of its nodes can see (a server's finished
requests, say) once there are this many: they would cost attention work for masked-out scores
only. Fewer are not worth a second set of cache views."""


ForwardRecorder = Callable[[int, int, float], None]
"""Told of one forward: its rows (new tokens), the slots cached before it, its wall seconds."""

_recorders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ForwardRecorder


def time_forwards(model, recorder: ForwardRecorder | None) -> ForwardRecorder | None:
    """From now on every engine over `model` tells `recorder` what each of its forwards cost (None:
    no engine times them). Returns the recorder this replaces (None if none)."""
    previous = _recorders.pop(model, None)
    if recorder is not None:
        _recorders[model] = recorder
    return previous


@dataclass
class EngineStats:
    """Counters a benchmark or a caller may read."""

    forward_passes: int = 0
    tokens_fed: int = 0
    compactions: int = 0
    peak_slots: int = 0
    peak_cache_bytes: int = 0
    slots_dropped: int = 0
    rolled_back: int = 0
    slots_skipped: int = 0  # leading slots left out of forest forwards, summed

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


Nodes = TypeVar("Nodes", list[int], list[list[int]])


@dataclass(frozen=True)
class FeedResult(Generic[Nodes]):
    """What one feed computed, and all of it: the engine and the rest of the package meet here
    (however the engine runs its forwards inside).

    nodes: the new nodes' ids, in call order ([len(tokens)]; `feed_chains`: one list per chain).
    logits: [len(logits_for), vocab] float32, the next-token logits at the `logits_for` nodes, in
        that order; [0, 0] when none were asked for.
    hidden: [len(hidden_for), len(hidden_layers), hidden size] in the model's dtype, the asked
        layers' hidden states at the `hidden_for` nodes (by default the `logits_for` ones), in that
        order; None when the feed asked for no layers or no nodes.
    """

    nodes: Nodes
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class Engine:
    """A forest of token nodes decoded over one shared KV cache of `model`.

    model: any transformers causal LM with eager or sdpa attention (checked on construction).
    capacity: cache slots to preallocate; the cache grows by doubling past it.
    apart: run a feed made of separate chains apart always (True), never (False), or when
        `prefers_apart` says it pays (None). Results are the same; only the cost differs.
    """

    def __init__(self, model, *, capacity: int = 0, apart: bool | None = None) -> None:
        check_supported(model)
        self.apart = apart
        self.model = model
        self.forest = Forest()
        self.cache = SlotCache(capacity)
        self.layout = mask_layout(model)
        self.max_positions = max_positions(model.config)
        self.positions_note = positions_note(model.config)  # why max_positions is short of the model's, or ""
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.stats = EngineStats()
        self.device = weights_device(model)
        self.dtype = activation_dtype(model)
        self.cache_argument = cache_argument(model)  # "cache" or "past_key_values", by transformers version
        self.exact = is_exact(model)  # batch-invariant forwards (see `exact`)
        self.footprint = Footprint.of(model)  # bytes per slot, per logits row, per forward row
        self._embeds: dict[int, torch.Tensor] | None = None  # node -> input vector, during a feed given `embeds`
        self._forwards_timed = 0  # see `_report_time`

    # ------------------------------------------------------------------ feeding
    def feed(
        self,
        tokens: Sequence[int],
        parents: Sequence[int],
        *,
        logits_for: Sequence[int] = (),
        root_position: int = 0,
        owners: Sequence[object] | None = None,
        hidden_layers: Sequence[int] = (),
        hidden_for: Sequence[int] | None = None,
        embeds: torch.Tensor | None = None,
    ) -> FeedResult[list[int]]:
        """Add nodes (see `Forest.add` for `parents` and `owners`) and run them through the model.

        logits_for: indices into this call's nodes whose next-token logits to return.
        hidden_layers: also return the hidden states of these layers, as the model's public
        `hidden_states` output numbers them: 0 the embeddings, i the output of layer i, -1 the last
        (after the final norm, what the LM head reads). A feed that asks for none pays nothing.
        hidden_for: the nodes (indices into this call's) whose hidden states to return, when not
        the `logits_for` ones.
        embeds: [len(tokens), hidden size], the nodes' input vectors, given to the model's forward
        in place of their tokens' embeddings (`inputs_embeds`: a learned draft head's input is
        built from the target's features); the tokens still name the nodes.
        Returns what the feed computed (see `FeedResult` for the shapes).
        """
        forest, before, layers = self.forest, self.forest.num_slots, list(hidden_layers)
        nodes = forest.add(tokens, parents, root_position=root_position, owners=owners)
        if not nodes:
            return FeedResult(nodes, torch.empty(0, 0))
        self._embeds = None if embeds is None else dict(zip(nodes, embeds.to(self.device, self.dtype)))
        runs, order = self._long_chains_first(nodes, before)
        states_for = logits_for if hidden_for is None else hidden_for
        if runs:  # the cache order: long chains first, the rest as fed
            placed = [nodes[i] for i in order]
            where = {i: j for j, i in enumerate(order)}  # index in nodes -> index in placed
            wanted, wanted_states = [where[i] for i in logits_for], [where[i] for i in states_for]
        else:  # the usual step: cache order is call order
            placed, wanted, wanted_states = nodes, list(logits_for), list(states_for)
        try:
            positions = self._positions(placed)  # [q]
            forest.place(placed)
            rows, states = self._run_all(placed, positions, runs, wanted, wanted_states, layers)
        except BaseException:
            self._undo(nodes, before)  # a failed forward (out of memory, Ctrl-C) leaves no trace
            raise
        logits = torch.stack([rows[i] for i in wanted]) if wanted else torch.empty(0, 0)  # [len(logits_for), vocab]
        # [len(hidden_for), len(hidden_layers), hidden size]
        hidden = torch.stack([states[i] for i in wanted_states]) if layers and wanted_states else None
        return FeedResult(nodes, logits, hidden)

    def _run_all(self, placed: list[int], positions: torch.Tensor, runs, wanted: list[int], wanted_states: list[int],
                 layers: list[int]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Every forward of a feed (see `_plan`): index into placed -> its logits row ([vocab]
        float32, at `wanted`), and -> its hidden states ([layers, hidden], at `wanted_states`)."""
        rows: dict[int, torch.Tensor] = {}
        hidden: dict[int, torch.Tensor] = {}
        recorder = _recorders.get(self.model)
        for kind, start, end in self._plan(placed, runs, kept=len(wanted)):
            keep = [i - start for i in wanted if start <= i < end]
            keep_states = [i - start for i in wanted_states if start <= i < end] if layers else []
            cached, started = self.cache.num_slots, time.perf_counter()
            if kind == "apart":  # not timed: its cost is its own path's, not the cache's
                out, states = self._run_apart(placed, start, end, keep, layers, keep_states)
            else:
                out, states = self._run(placed[start:end], positions[start:end], keep, layers, keep_states,
                                        plain=kind == "plain")
                if recorder is not None:
                    self._report_time(recorder, end - start, cached, started)
            rows.update({start + i: row for i, row in zip(keep, out)})
            if states is not None:
                hidden.update({start + i: row for i, row in zip(keep_states, states)})
        return rows, hidden

    def _report_time(self, recorder: ForwardRecorder, rows: int, cached: int, started: float) -> None:
        """Tell `recorder` what one forward cost, once the device is done with it. An engine's first
        forward is left out: it warms up (allocations, first-call work) and says little of the rest."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        self._forwards_timed += 1
        if self._forwards_timed > 1:
            recorder(rows, cached, seconds)

    def _undo(self, nodes: list[int], slots: int) -> None:
        """Take back a feed that did not finish: its nodes leave the forest, and the cache goes back
        to its first `slots` slots (whatever part of the feed reached it)."""
        self.forest.remove(nodes)
        if self.forest.num_slots > slots:
            self.forest.compact(torch.arange(slots))
        self.cache.truncate(slots)

    def feed_chain(
        self, tokens: Sequence[int], parent: int = ROOT, *, root_position: int = 0, logits: bool = True,
        owner: object = None,
    ) -> FeedResult[list[int]]:
        """Feed one straight sequence under `parent`; logits of its last node if `logits`
        ([1, vocab], else [0, 0])."""
        return self.feed(
            tokens, chain_parents(len(tokens), parent), logits_for=[len(tokens) - 1] if logits and tokens else (),
            root_position=root_position, owners=[owner] * len(tokens),
        )

    def feed_chains(
        self, chains: Sequence[Sequence[int]], parents: Sequence[int], *, root_position: int = 0,
        hidden_layers: Sequence[int] = (), embeds: torch.Tensor | None = None,
    ) -> FeedResult[list[list[int]]]:
        """Feed several sequences in one call, chain i under `parents[i]` (`hidden_layers` and
        `embeds`, the chains' input vectors in order: see `feed`).

        Returns the node ids of each chain, and the logits (and hidden states) at each non-empty
        chain's last node ([number of non-empty chains, ...]), in chain order.
        """
        tokens, flat_parents, spans = chain_layout(chains, parents)
        fed = self.feed(tokens, flat_parents, logits_for=[b - 1 for a, b in spans if b > a],
                        root_position=root_position, hidden_layers=hidden_layers, embeds=embeds)
        return replace(fed, nodes=[fed.nodes[a:b] for a, b in spans])

    # ------------------------------------------------------------------ planning the forwards
    def _long_chains_first(self, nodes: list[int], cached: int) -> tuple[list[tuple[int, int]], list[int]]:
        """Which long chains of a mixed feed run apart, and the order to place the feed in.

        A long chain (a new document's prompt) fed beside other work (branches decoding in a
        merged forest) would otherwise be one forest forward with the rest, paying attention from
        each of its tokens to every slot in the cache. A maximal chain of at least
        `APART_MIN_MEAN_LENGTH` nodes whose head hangs under a cached node (or under an earlier
        such chain) moves to the front, to run apart over its own path, where `prefers_apart`
        finds that cheaper. Returns the moved chains' (start, end) in the new order and the order
        (indices into `nodes`); placing parents before children stays true.
        """
        forest = self.forest
        identity = list(range(len(nodes)))
        if self.apart is False or len(nodes) <= APART_MIN_MEAN_LENGTH:
            return [], identity
        fresh = set(nodes)
        moved: set[int] = set()
        chains: list[tuple[int, int]] = []
        i = 0
        while i < len(nodes):
            j = i + 1
            while j < len(nodes) and forest.parents[nodes[j]] == nodes[j - 1]:
                j += 1
            parent = forest.parents[nodes[i]]
            if (j - i >= APART_MIN_MEAN_LENGTH and (parent not in fresh or parent in moved)
                    and self._apart_pays(j - i, parent, cached + len(nodes))):
                chains.append((i, j))
                moved.update(nodes[i:j])
            i = j
        if not chains or chains == [(0, len(nodes))]:
            return [], identity
        order = [k for a, b in chains for k in range(a, b)]
        order += [k for k in identity if nodes[k] not in moved]
        runs, at = [], 0
        for a, b in chains:
            runs.append((at, at + b - a))
            at += b - a
        return runs, order

    def _apart_pays(self, length: int, parent: int, slots: int) -> bool:
        """Whether a chain of `length` under `parent` costs less apart (over its parent's path)
        than in a forest forward over `slots` slots (the count of `prefers_apart`)."""
        path = len(self.forest.path(parent)) if parent != ROOT else 0
        return length * slots > 2 * (length * (path + length) + path)

    def _plan(self, nodes: list[int], chains: Sequence[tuple[int, int]] = (), *,
              kept: int = 0) -> list[tuple[str, int, int]]:
        """Split a feed into forwards: (kind, start, end) runs of `nodes`, in order. `chains`: long
        chains at the head of the feed that run apart (see `_long_chains_first`); kept: how many
        of the nodes return logits."""
        forest = self.forest
        plan: list[tuple[str, int, int]] = []
        for a, b in chains:
            plain = a == 0 and forest.is_plain_continuation(nodes[a:b])
            plan.append(("plain" if plain else "apart", a, b))
        start = chains[-1][1] if chains else 0
        return plan + (self._plan_rest(nodes, start, kept / len(nodes)) if start < len(nodes) else [])

    def _plan_rest(self, nodes: list[int], start: int, kept_share: float) -> list[tuple[str, int, int]]:
        """The forwards of nodes[start:]: a plain trunk at the head of a feed, then chains apart
        or a forest."""
        forest = self.forest
        plan: list[tuple[str, int, int]] = []
        if start == 0:
            trunk = 1
            while trunk < len(nodes) and forest.parents[nodes[trunk]] == nodes[trunk - 1]:
                trunk += 1
            plain = forest.is_plain_continuation(nodes[:trunk])
            if plain and trunk == len(nodes) and (trunk == 1 or trunk >= TRUNK_MIN_LENGTH):
                return self._pieces("plain", 0, trunk, kept_share)
            if plain and trunk >= TRUNK_MIN_LENGTH:
                plan += self._pieces("plain", 0, trunk, kept_share)
                start = trunk
        spans = chain_spans(forest, nodes, start) if self.apart is not False else None
        if spans is not None and (self.apart or self.prefers_apart(
            [b - a for a, b in spans], [forest.parents[nodes[a]] for a, b in spans]
        )):
            return plan + [("apart", a, b) for a, b in spans]
        return plan + self._pieces("forest", start, len(nodes), kept_share)

    def _pieces(self, kind: str, start: int, end: int, kept_share: float) -> list[tuple[str, int, int]]:
        """Forwards of `kind` over nodes[start:end] whose scratch fits (`Footprint.rows_per_forward`):
        a long prompt, a wide forest in pieces, each seeing the pieces before it."""
        step = self.footprint.rows_per_forward(self.forest.num_slots, kept_share)
        return [(kind, a, min(a + step, end)) for a in range(start, end, step)]

    def prefers_apart(self, lengths: Sequence[int], parents: int | Sequence[int] = ROOT) -> bool:
        """Whether running chains of `lengths` (chain i under `parents[i]`, or all under one
        parent) each in its own forward beats one forest forward.

        One forest pass computes attention (masked, but computed) from every new token to every
        slot: S x (slots + S) for S new tokens. Apart, a chain sees only its path of A slots:
        L x (A + L) per chain, plus copying the path once per chain. The weights' matmuls cost
        the same either way, but every extra pass reads all the weights again, which short chains
        cannot repay: apart needs chains of `APART_MIN_MEAN_LENGTH` tokens on average. Many
        questions of ~20 tokens under a long document stay together; long chunks under a short
        instruction go apart.
        """
        if isinstance(parents, int):
            parents = [parents] * len(lengths)
        pairs = [(n, p) for n, p in zip(lengths, parents) if n]
        if len(pairs) < 2 or sum(n for n, _ in pairs) < APART_MIN_MEAN_LENGTH * len(pairs):
            return False
        total = sum(n for n, _ in pairs)
        paths = {p: (len(self.forest.path(p)) if p != ROOT else 0) for _, p in pairs}
        together = total * (self.forest.num_slots + total)
        apart = sum(n * (paths[p] + n) + paths[p] for n, p in pairs)
        return together > 2 * apart

    # ------------------------------------------------------------------ batch-invariant forwards
    def _exact_inputs(self, visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                      parent_rows: list[int]) -> tuple[object, ExactPlan]:
        """The mask and the exact-attention plan of one forward (see `exact`)."""
        mask = build_attention_mask(visible, query_positions, key_positions, self.layout, self.dtype, self.device)
        plan = plan_attention(visible, key_positions, query_positions, torch.tensor(parent_rows, dtype=torch.long))
        return mask, plan

    def _parent_rows(self, nodes: Sequence[int]) -> list[int]:
        """Each node's parent as an index into `nodes`, -1 where the parent is not among them."""
        index = {n: i for i, n in enumerate(nodes)}
        return [index.get(self.forest.parents[n], -1) for n in nodes]

    # ------------------------------------------------------------------ the forwards
    def _run(self, nodes: list[int], positions: torch.Tensor, keep: list[int], layers: list[int],
             keep_states: list[int], *, plain: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of `nodes` (placed at the cache's next slots) on the shared cache; logits
        at `keep` (indices into nodes) as [len(keep), vocab] float32, and the hidden states of
        `layers` there (see `_forward`)."""
        forest = self.forest
        mask, plan = None, None
        start = 0
        if plain and not self.exact:
            forest.attention_rows(nodes[-1:])  # keep visibility rows in step for later forest feeds
        else:
            # [q, past + q]: the slots up to this run's own (a plain run may come before others of its feed)
            rows = forest.attention_rows(nodes)[:, : self.cache.num_slots + len(nodes)]
            seen = rows.any(dim=0)  # [past + q]
            first = int(seen.to(torch.uint8).argmax())  # the first slot any new node can see
            if first >= WINDOW_MIN_SKIP:
                start = first  # leading slots nobody here sees: not shown to the model at all
            # [past + q - start]: the keys' positions (a feed cut into runs placed all its nodes already)
            key_positions = forest.slot_positions()[start : rows.shape[1]]
            if self.exact:
                mask, plan = self._exact_inputs(rows[:, start:], positions, key_positions, self._parent_rows(nodes))
            else:
                mask = build_attention_mask(rows[:, start:], positions, key_positions, self.layout, self.dtype,
                                            self.device)
        compiled = compiled_forward(self.model) if self.exact else None
        out = None
        if (compiled is not None and compiled.refused is None and not layers and self._embeds is None
                and self.cache.ready_to_write()):
            out = self._forward_compiled(compiled, nodes, positions, keep, mask, plan, start)  # None: refused
        if out is None:
            with self.cache.window(start) if start else contextlib.nullcontext():
                out = self._forward(nodes, positions, self.cache, keep, layers, keep_states, mask, plan)
            self.stats.slots_skipped += start
        self._count(len(nodes))
        return out

    def _run_apart(self, nodes: list[int], start: int, end: int, keep: list[int],
                   layers: list[int], keep_states: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chain nodes[start:end] in its own forward, in a scratch cache holding only its
        parent's path; its new keys and values are then appended to the shared cache.

        Same result as a forest forward: the chain sees exactly its ancestors, at their positions.
        """
        forest = self.forest
        chain = nodes[start:end]
        parent = forest.parents[chain[0]]
        # [width] the slots of the parent's path, in cache order
        path = forest.compaction_plan([parent]) if parent != ROOT else torch.empty(0, dtype=torch.long)
        width = path.numel()
        scratch = SlotCache(width + len(chain))
        with torch.inference_mode():
            for i, layer in enumerate(self.cache.layers):
                index = path.to(layer.keys.device)
                scratch.update(layer.keys.index_select(2, index), layer.values.index_select(2, index), i)
        positions = forest.positions_of(chain)
        mask, plan = None, None
        if self.exact:  # the chain sees its parent's whole path, and itself causally
            visible = torch.cat([torch.ones(len(chain), width, dtype=torch.bool),
                                 torch.ones(len(chain), len(chain), dtype=torch.bool).tril()], 1)
            path_positions = forest.slot_positions()[path] if width else torch.empty(0, dtype=torch.long)
            mask, plan = self._exact_inputs(visible, positions, torch.cat([path_positions, positions]),
                                            self._parent_rows(chain))
        out = self._forward(chain, positions, scratch, keep, layers, keep_states, mask, plan)
        end = width + len(chain)
        with torch.inference_mode():
            for i, layer in enumerate(scratch.layers):
                self.cache.update(layer.keys[:, :, width:end], layer.values[:, :, width:end], i)
        forest.attention_rows(chain[-1:])
        self._count(len(chain), extra_bytes=scratch.allocated_bytes)
        return out

    def _forward(self, nodes: list[int], positions: torch.Tensor, cache, keep: list[int], layers: list[int],
                 keep_states: list[int], mask, plan: ExactPlan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward over `nodes`:
        [len(keep), vocab] float32 logits at `keep`, and [len(keep_states), len(layers), hidden]
        hidden states at `keep_states` (in the model's dtype) when `layers` are asked for (else None)."""
        index = torch.tensor(keep or [len(nodes) - 1], dtype=torch.long, device=self.device)
        tokens = [self.forest.tokens[n] for n in nodes]
        extra = {"forest_plan": plan} if plan is not None else {}
        if layers:  # only these are kept (transformers 5.24 on; before it, a list is a true flag: all)
            extra["output_hidden_states"] = list(layers)
        if self._embeds is not None:  # [1, q, hidden]: the given input vectors
            extra["inputs_embeds"] = torch.stack([self._embeds[n] for n in nodes])[None]
        else:
            extra["input_ids"] = torch.tensor([tokens], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(
                position_ids=positions[None].to(self.device),
                attention_mask=mask,
                use_cache=True,
                **{self.cache_argument: cache},
                logits_to_keep=index,
                **extra,
            )
        logits = out.logits[0, : len(keep)].float()
        if not layers:
            return logits, None
        rows = torch.tensor(keep_states, dtype=torch.long, device=self.device)
        # [len(keep_states), layers, hidden]: each asked layer's states at those rows
        hidden = torch.stack([out.hidden_states[layer][0].index_select(0, rows) for layer in layers], 1)
        return logits, hidden

    def _forward_compiled(self, compiled, nodes: list[int], positions: torch.Tensor, keep: list[int], mask,
                          plan: ExactPlan, start: int) -> tuple[torch.Tensor, None]:
        """`_forward` of a plain or forest run on the model's compiled forward (see `compiled`): the
        plan goes in as tensors (each layer's visible bits, from its type's mask), the model gets an
        empty mask, and the cache writes the new nodes at its next slots. None where the compiled
        forward is refused (`compiled.CompileRefused`): the caller runs the forward eagerly."""
        types = self.layout.layer_types
        masks = [mask[kind] for kind in types] if isinstance(mask, dict) else [mask] * len(types)  # one per layer
        units = plan_tensors(plan, masks, masks[0].shape[-1], self.device, offset=start)
        empty = torch.empty(1, 1, 0, 0, dtype=self.dtype, device=self.device)
        placeholder = dict.fromkeys(self.layout.kinds, empty) if self.layout.as_dict else empty
        index = torch.tensor(keep or [len(nodes) - 1], dtype=torch.long, device=self.device)
        tokens = torch.tensor([[self.forest.tokens[n] for n in nodes]], dtype=torch.long, device=self.device)
        try:
            with torch.inference_mode(), self.cache.writing(len(nodes), self.device):
                logits = compiled(tokens, positions[None].to(self.device), placeholder, self.cache, index, units,
                                  self.cache_argument)
        except CompileRefused:  # raised before the graph ran: the cache is as it was
            return None
        return logits[0, : len(keep)].float(), None

    def _positions(self, nodes: Sequence[int]) -> torch.Tensor:
        """Position ids of new nodes ([len(nodes)]), refused past the model's last position."""
        positions = self.forest.positions_of(nodes)
        top = int(positions.max())
        if self.max_positions is not None and top >= self.max_positions:
            raise PromptTooLong(
                f"position {top} is past the model's maximum of {self.max_positions} positions"
                f"{self.positions_note}",
                "shorten the document (or prompt) or lower max_new_tokens",
            )
        return positions

    # ------------------------------------------------------------------ taking nodes back, memory
    def drop(self, nodes: Sequence[int]) -> int:
        """Take rejected nodes back: out of the forest, and their slots out of the cache.

        `nodes` must come with all of their descendants (a rejected draft subtree). Slots before
        the first dropped one stay put; the kept slots after it move down; the cache is cropped.
        Returns the number of slots freed.
        """
        if not nodes:
            return 0
        forest = self.forest
        dropped = torch.tensor(sorted(forest.slot_of[n] for n in nodes), dtype=torch.long)
        keep = torch.ones(forest.num_slots, dtype=torch.bool)
        keep[dropped] = False
        forest.remove(nodes)
        self._keep_slots(keep.nonzero().flatten())
        self.stats.rolled_back += len(nodes)
        return len(nodes)

    def need(self, *, prompt_slots: int, branches: int, branch_slots: int, rows_per_branch: int = 1) -> Need:
        """The bytes a group of branches will add to this engine (see `Footprint.group_bytes`):
        cache slots past the cache's capacity are new memory, and growing copies the old ones."""
        before = self.forest.num_slots
        after = before + prompt_slots + branches * branch_slots
        capacity = self.cache.capacity
        grown = max(0, after - capacity) + (capacity if after > capacity and self.cache.layers else 0)
        return self.footprint.group_bytes(slots_before=before, prompt_slots=prompt_slots, branches=branches,
                                          branch_slots=branch_slots, rows_per_branch=rows_per_branch,
                                          cache_slots=grown)

    def reserve(self, slots: int) -> None:
        """Preallocate the cache for `slots` slots in all."""
        self.cache.reserve(slots)

    def compact(self, live: Sequence[int], *, owner: object = EVERYONE) -> int:
        """Drop every cached slot of `owner` (any owner by default) that is not `live` or an
        ancestor of a live node. Returns the number of slots dropped.

        Exact: positions are node data and do not move.
        """
        return self._compact(self.forest.compaction_plan(live, owner=owner))

    def compact_if_due(self, live: Sequence[int], due: Callable[[int, int], bool], *,
                       owner: object = EVERYONE) -> int:
        """`compact(live, owner=owner)` if `due(dead slots, all slots)` says so; returns the slots dropped."""
        keep = self.forest.compaction_plan(live, owner=owner)
        if not due(self.forest.num_slots - keep.numel(), self.forest.num_slots):
            return 0
        return self._compact(keep)

    def _compact(self, keep: torch.Tensor) -> int:
        dropped = self._keep_slots(keep)
        if dropped:
            self.stats.compactions += 1
            self.stats.slots_dropped += dropped
        return dropped

    def _keep_slots(self, keep: torch.Tensor) -> int:
        """Keep only the slots `keep` ([n] slot indices, ascending), in the cache and the forest."""
        dropped = self.forest.num_slots - keep.numel()
        if dropped == 0:
            return 0
        first = unchanged_prefix(keep)
        self.cache.compact(keep, first)
        self.forest.compact(keep)
        return dropped

    def _count(self, fed: int, extra_bytes: int = 0) -> None:
        """Count a forward pass; extra_bytes is KV held beside the shared cache (a scratch cache)."""
        s = self.stats
        s.forward_passes += 1
        s.tokens_fed += fed
        s.peak_slots = max(s.peak_slots, self.forest.num_slots)
        s.peak_cache_bytes = max(s.peak_cache_bytes, self.cache.allocated_bytes + extra_bytes)


def chain_layout(chains: Sequence[Sequence[int]], parents: Sequence[int]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Several chains as one feed: (tokens, parents, (start, end) of each chain), chain i under
    `parents[i]`."""
    tokens: list[int] = []
    flat_parents: list[int] = []
    spans = []
    for chain, parent in zip(chains, parents):
        start = len(tokens)
        tokens.extend(chain)
        flat_parents.extend(chain_parents(len(chain), parent, start))
        spans.append((start, len(tokens)))
    return tokens, flat_parents, spans


def chain_spans(forest: Forest, nodes: Sequence[int], start: int = 0) -> list[tuple[int, int]] | None:
    """nodes[start:] as separate chains, each hanging under a node fed before them: their
    (start, end) runs, or None when some node hangs under another new node that is not the one
    just before it (a tree, not chains)."""
    fresh = set(nodes[start:])
    spans: list[tuple[int, int]] = []
    for i in range(start, len(nodes)):
        parent = forest.parents[nodes[i]]
        if i > start and parent == nodes[i - 1]:
            continue
        if parent in fresh:
            return None
        spans.append((i, i))
    ends = [a for a, _ in spans[1:]] + [len(nodes)]
    return [(a, b) for (a, _), b in zip(spans, ends)]
