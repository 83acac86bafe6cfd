"""An EAGLE-style draft head: one decoder layer that runs ahead on the target's features.

EAGLE (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
arXiv 2401.15077; EAGLE-2, arXiv 2406.16858, grows the draft tree where the head is confident)
drafts at the level of features rather than tokens. Terms:

- a **feature** f_i is the target's last hidden state at position i (here after its final norm,
  what its LM head reads: the public `hidden_states[-1]`);
- a **pair** (f_i, x_{i+1}) is a feature and the token chosen after it. The head reads
  `fc([embedding of x_{i+1}; f_i])` (the target's own embedding, shared) through one decoder layer
  and predicts f_{i+1}; the target's LM head on that prediction (over the draft vocabulary) gives
  the distribution of x_{i+2};
- the head attends over its own **path**: the pairs of the branch's answer so far, with the
  target's true features. Drafting runs on: a predicted feature and a candidate token make the
  next pair, and so on, one head forward per depth for every branch at once.

The head is a one-layer causal LM of transformers' Llama family (`model`), run on its own `Engine`:
its cache is a forest like the target's, every branch's path in it, and each depth's candidates
are fed as a forest forward with their inputs given as vectors (`Engine.feed(embeds=...)`). Its
embedding table and LM head are one tied matrix, the target's LM head rows of the draft vocabulary
(bound from the target, never written to disk), so a head file holds `fc` and one layer: a few MB.

Heads published by others load too (`EagleHead.load` reads each layout): the EAGLE project's
EAGLE-1/2 heads (a first layer without its input norm and no final norm, over the target's whole
LM head: built here by replacing those two norms with identities) and EAGLE-3 heads in the EAGLE
project's and the `speculators` layouts (`proposers.eagle3`: several target layers in, a 2h-wide
attention, a draft vocabulary of its own). The proposer reads whichever layers its head names.

The tree grows best first (EAGLE-2): under each node the `width` likeliest tokens, and a node is
expanded while its path probability is at least `confidence`, up to `max_depth`. A greedy branch's
candidates are the likeliest tokens; a sampled branch's are drawn from the head's warped softmax,
which goes with the draft (`DraftTree.dists`), so verification keeps the target's distribution.
Every draft node is taken back from the head's cache before the next round; the accepted tokens
come back as pairs with the target's true features.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..engine import Engine
from ..errors import InvalidArgument
from ..forest import ROOT
from .base import UNDER_LEAF, BranchContext, DraftTree, Proposer
from .drafting import add_candidates, draft_distribution, draft_generator
from .heads import (
    check_head_fits,
    load_checked,
    on_device_of,
    read_config,
    read_state_dict,
    read_tensors,
    write_head,
)
from .medusa import output_rows

WEIGHTS = "eagle_head"


def head_config(model, draft_vocab_size: int):
    """A one-layer Llama config of the target's widths (its attention and MLP shapes where it has
    them), whose vocabulary is the draft vocabulary."""
    from transformers import LlamaConfig

    config = model.config
    heads = getattr(config, "num_attention_heads", None) or max(1, config.hidden_size // 64)
    return LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=getattr(config, "intermediate_size", None)
        or 4 * config.hidden_size, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab_size=draft_vocab_size, tie_word_embeddings=True, max_position_embeddings=1 << 16,
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6), rope_theta=getattr(config, "rope_theta", 10000.0),
        attn_implementation="sdpa")


class EagleHead(nn.Module):
    """`fc` and a one-layer causal LM (see the module notes).

    config: `head_config`'s. token_ids: the draft vocabulary ([V'] target token ids).
    vocab_size: the target's. target: the fingerprint of the model it was trained for.
    norms: the layer's input norm and a final norm before the LM head (ours); EAGLE-1/2 heads as
    published have neither (their first layer skips its input norm, and the LM head reads the
    layer's output, which is also what the next depth reads). fc_bias: whether `fc` has a bias.
    reads_prompt: trained with each sequence's prompt pairs before its answer's (heads written
    before that was so read from the node after the prompt on).
    """

    def __init__(self, config, token_ids: torch.Tensor, vocab_size: int, *, target: dict | None = None,
                 norms: bool = True, fc_bias: bool = True, reads_prompt: bool = True) -> None:
        from transformers import LlamaForCausalLM

        super().__init__()
        self.hidden_size, self.vocab_size, self.target, self.norms = config.hidden_size, vocab_size, target, norms
        self.reads_prompt = reads_prompt
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.model = LlamaForCausalLM(config).eval()
        if not norms:
            self.model.model.layers[0].input_layernorm = nn.Identity()
            self.model.model.norm = nn.Identity()
        self.register_buffer("token_ids", token_ids.long())
        self.embed: list[nn.Module] = []  # the target's input embeddings (not a submodule: not ours)

    @property
    def draft_vocab_size(self) -> int:
        return len(self.token_ids)

    @staticmethod
    def reads(config: dict) -> bool:
        """Whether a head folder's config may be an EAGLE head's: any (ours, the EAGLE project's,
        EAGLE-3's and speculators' configs share no key), so its row comes after the other learned
        heads' and `load` says what is wrong with a folder that is no head at all."""
        return True

    def bind(self, model) -> EagleHead:
        """Check the head fits `model` (and was trained for it); tie its LM head to the target's
        rows of the draft vocabulary and keep the target's embeddings for its inputs."""
        check_head_fits(model, self.hidden_size, self.vocab_size, self.target, "eagle", token_ids=self.token_ids)
        on_device_of(self, model)
        rows = output_rows(model, self.token_ids.cpu())  # [V', hidden]
        with torch.no_grad():
            self.model.lm_head.weight.copy_(rows.to(self.model.lm_head.weight.device))
        self.model.lm_head.weight.requires_grad_(False)
        self.embed = [model.get_input_embeddings()]
        return self

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor, *, own: bool = False) -> torch.Tensor:
        """The head's input vectors of pairs: features [n, hidden] (the target's, or with `own` the
        head's predicted ones: the same here) and the tokens after them [n]."""
        embedded = self.embed[0](tokens.to(features.device)).to(self.fc.weight.dtype)  # [n, hidden]
        return self.fc(torch.cat([embedded, features.to(self.fc.weight.dtype)], -1))

    # ------------------------------------------------------------------ files
    def save(self, folder: str | Path, *, extra: dict | None = None) -> Path:
        """config.json (the layer's Llama config and what the head is) and eagle_head.safetensors
        (fc, the layer and the norm, the draft vocabulary; not the tied matrix: the target's)."""
        tensors = {k: v for k, v in self.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
        config = {**self.model.config.to_dict(), "eagle": {"vocab_size": self.vocab_size,
                                                          "draft_vocab_size": self.draft_vocab_size,
                                                          "norms": self.norms, "reads_prompt": self.reads_prompt},
                  "multidecode_target": self.target, **(extra or {})}
        return write_head(Path(folder), WEIGHTS, config, tensors)

    @classmethod
    def load(cls, folder: str | Path):
        """A head from `folder`, in any layout `Eagle` drafts with: ours (written by `save`), the
        EAGLE project's EAGLE-1/2 layout, or an EAGLE-3 head (the EAGLE project's or the
        `speculators` format: an `eagle3.Eagle3Head`)."""
        from .eagle3 import WEIGHT_FILES, Eagle3Head

        folder, what = Path(folder), "the EAGLE head"
        config = read_config(folder, what)
        if "eagle" in config:
            return cls._load_ours(folder, config)
        tensors = read_state_dict(folder, WEIGHT_FILES, what)
        if "speculators_model_type" in config or any(k.startswith("midlayer.") for k in tensors):
            return Eagle3Head.load(folder)
        if "fc.weight" in tensors and any(k.startswith("layers.0.") for k in tensors):
            return cls._load_published(folder, config, tensors)
        raise InvalidArgument(f"{what} in {folder} is in no layout multidecode reads",
                              "use a head written by multidecode train-drafter --kind eagle, or an EAGLE, EAGLE-3 "
                              "or speculators head as published")

    @classmethod
    def _load_ours(cls, folder: Path, config: dict) -> EagleHead:
        from transformers import LlamaConfig

        tensors = read_tensors(folder, WEIGHTS, "the EAGLE head")
        if "token_ids" not in tensors:
            raise InvalidArgument(f"the EAGLE head in {folder} is not in multidecode's EAGLE layout",
                                  "write it with multidecode train-drafter --kind eagle")
        layer_config = LlamaConfig(**{k: v for k, v in config.items() if k not in ("eagle", "multidecode_target",
                                                                                  "training")})
        layer_config._attn_implementation = "sdpa"
        head = cls(layer_config, tensors["token_ids"], config["eagle"]["vocab_size"],
                   target=config.get("multidecode_target"), norms=config["eagle"].get("norms", True),
                   fc_bias="fc.bias" in tensors, reads_prompt=config["eagle"].get("reads_prompt", False))
        return head._fill(tensors, folder, config)

    @classmethod
    def _load_published(cls, folder: Path, config: dict, tensors: dict) -> EagleHead:
        """An EAGLE-1/2 head as the EAGLE project publishes it: a Llama config of its layers and
        `fc`, `layers.*` (the first without an input norm), no final norm, the target's LM head
        over its whole vocabulary, the target's embeddings (a copy in the file is not read)."""
        from transformers import LlamaConfig

        from .eagle3 import NOT_LAYER_KEYS

        layer_config = LlamaConfig(**{k: v for k, v in config.items() if k not in NOT_LAYER_KEYS})
        layer_config.head_dim = layer_config.hidden_size // layer_config.num_attention_heads  # as EAGLE computes it
        layer_config._attn_implementation = "sdpa"
        vocab = layer_config.vocab_size
        state = {("model.model." + k if k.startswith("layers.") else k): v for k, v in tensors.items()
                 if k != "embed_tokens.weight"}
        head = cls(layer_config, torch.arange(vocab), vocab, norms=False, fc_bias="fc.bias" in tensors)
        return head._fill(state, folder, config)

    def _fill(self, tensors: dict, folder: Path, config: dict) -> EagleHead:
        """Load `tensors` (all but the tied matrix, which `bind` takes from the target), or refuse."""
        missing, unexpected = load_checked(self, tensors, f"the EAGLE head in {folder}")
        missing = [k for k in missing if "embed_tokens" not in k and "lm_head" not in k and k != "token_ids"]
        if missing or unexpected:
            raise InvalidArgument(f"the EAGLE head in {folder} does not match its config "
                                  f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})",
                                  "write it again with multidecode train-drafter --kind eagle")
        self.config = config
        return self


@dataclass
class _Branch:
    """What the head holds for one branch: the last node of its path, and its generator."""

    leaf: int = ROOT
    generator: torch.Generator | None = None
    grown: list[int] = field(default_factory=list)


class Eagle(Proposer):
    """Drafts with an `EagleHead` (see the module notes). width: candidates per node; confidence:
    expand a node while its path probability is at least this; max_depth: the deepest node."""

    name = "eagle"
    default_budget = 6

    # The defaults measured best on the story workload on this CPU, where a row past the first
    # costs most of a forward: a chain, grown while the head is fairly sure (docs/benchmarks.md).
    def __init__(self, head: EagleHead, *, width: int = 1, confidence: float = 0.1, max_depth: int = 6) -> None:
        self.head = head
        self.width, self.confidence, self.max_depth = width, confidence, max_depth
        self.engine: Engine | None = None
        self._branches: dict[int, _Branch] = {}
        self._next_key = 0
        self._grown: list[int] = []  # last round's draft nodes, taken back before the next
        self._released = 0  # branches finished since the last compaction

    @property
    def reads_prompt(self) -> bool:
        """Whether the head was trained with the prompt in its context (published heads are)."""
        return bool(getattr(self.head, "reads_prompt", False))

    @property
    def layers(self) -> tuple[int, ...]:
        """The target layers the head reads: the last one (ours, EAGLE-1/2, MTP), or EAGLE-3's aux layers."""
        return tuple(getattr(self.head, "layers", (-1,)))

    def check(self, model) -> None:
        if not self.head.embed:  # not bound to the target yet
            self.head.bind(model)
        if self.engine is None:
            self.engine = Engine(self.head.model)

    def release(self, context: BranchContext) -> None:
        if self._branches.pop(context.scratch.pop(self.name, -1), None) is not None:
            self._released += 1

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        return self.propose_many([context], budget)[0]

    def propose_many(self, contexts: Sequence[BranchContext], budget: int) -> list[DraftTree]:
        trees = [DraftTree() for _ in contexts]
        if self.engine is None:
            raise InvalidArgument("the EAGLE proposer was not checked against a target", "call check(model) first")
        self.engine.drop(self._grown)
        self._grown = []
        if self._released:  # finished branches' paths leave the head's cache
            self.engine.compact([s.leaf for s in self._branches.values() if s.leaf != ROOT])
            self._released = 0
        ready = [b for b, c in enumerate(contexts) if c.features is not None]
        if not ready or budget < 1:
            return trees
        states = [self._state(contexts[b]) for b in ready]
        logits, hidden = self._catch_up([contexts[b] for b in ready], states)  # [B, V'], [B, hidden]
        # frontier: (branch, candidate index or UNDER_LEAF, head node, path probability)
        frontier = [(i, UNDER_LEAF, s.leaf, 1.0) for i, s in enumerate(states)]
        for depth in range(1, self.max_depth + 1):
            grow = []
            for (i, parent, node, prob), row, feature in zip(frontier, logits, hidden):
                b = ready[i]
                for child, token, q in self._children(contexts[b], states[i], trees[b], parent, row, budget):
                    if prob * q >= self.confidence and depth < self.max_depth:
                        grow.append((i, child, node, prob * q, token, feature))
            grow = self._worth_growing(grow, [budget - len(trees[b]) for b in ready])
            if not grow:
                break
            logits, hidden, nodes = self._feed_grown(grow)
            frontier = [(i, child, n, p) for (i, child, _, p, _, _), n in zip(grow, nodes)]
        return trees

    @staticmethod
    def _worth_growing(grow: list, room: list[int]) -> list:
        """The likeliest nodes to grow, at most as many per branch as its budget has room for
        (each grown node adds at least one candidate)."""
        kept = []
        for g in sorted(grow, key=lambda g: -g[3]):
            if room[g[0]] > 0:
                room[g[0]] -= 1
                kept.append(g)
        return kept

    def _state(self, context: BranchContext) -> _Branch:
        key = context.scratch.get(self.name)  # by name: an EAGLE head and an MTP layer may both draft
        if key is None:
            key = context.scratch[self.name] = self._next_key
            self._next_key += 1
            self._branches[key] = _Branch(generator=draft_generator(context.sampling))
        return self._branches[key]

    def _catch_up(self, contexts: Sequence[BranchContext], states: Sequence[_Branch]):
        """Feed each branch's newly settled pairs (the target's features with the tokens chosen
        after them) to the head; its logits and predicted feature after each branch's last pair.
        New branches' pairs start with their prompt's where the head reads prompts; the pairs
        they share (a common document) are fed once, as a trunk they all hang under."""
        pairs = []  # per branch: (tokens [m], features [m, layers * hidden])
        for context, state in zip(contexts, states):
            features = context.features_of(self.layers).flatten(1)  # [m, layers * hidden]
            if state.leaf == ROOT and not self.reads_prompt:  # from the head node on, as it was trained
                features = features[-(len(context.tokens) - context.prompt_length):]
            pairs.append((context.tokens[-len(features):], features))
        trunk = self._feed_trunk(pairs, states)
        chains = [tokens for tokens, _ in pairs]
        fed = [i for i, chain in enumerate(chains) if chain]
        logits, hidden = [trunk[0]] * len(pairs), [trunk[1]] * len(pairs)  # a branch left nothing: the trunk's
        if fed:
            with torch.inference_mode():
                embeds = torch.cat([self.head.inputs(pairs[i][1], torch.tensor(chains[i])) for i in fed])
                result = self.engine.feed_chains([chains[i] for i in fed], [states[i].leaf for i in fed],
                                                 hidden_layers=[-1], embeds=embeds)
            for k, i in enumerate(fed):
                states[i].leaf, logits[i], hidden[i] = result.nodes[k][-1], result.logits[k], result.hidden[k, 0]
        return torch.stack(logits), torch.stack(hidden)

    def _feed_trunk(self, pairs: list, states: Sequence[_Branch]) -> tuple:
        """Feed the pairs that all new branches begin with (the same tokens and features: one
        prompt's) once, and take them off their pairs; their leaves move to its last node.
        Returns the logits and predicted feature after the trunk (None, None without one)."""
        new = [i for i, state in enumerate(states) if state.leaf == ROOT]
        if len(new) < 2:
            return None, None
        first = pairs[new[0]]
        length = min(len(pairs[i][0]) for i in new)
        for i in new[1:]:  # the leading pairs of the same tokens and states (another prompt's differ)
            tokens, features = pairs[i]
            differ = torch.tensor(tokens[:length]) != torch.tensor(first[0][:length])  # [length]
            differ |= (features[:length] != first[1][:length]).flatten(1).any(-1)
            length = int(differ.int().argmax()) if differ.any() else length
        if length < 2:
            return None, None
        tokens = first[0][:length]
        with torch.inference_mode():
            result = self.engine.feed_chains([tokens], [ROOT], hidden_layers=[-1],
                                             embeds=self.head.inputs(first[1][:length], torch.tensor(tokens)))
        for i in new:
            states[i].leaf = result.nodes[0][-1]
            pairs[i] = (pairs[i][0][length:], pairs[i][1][length:])
        return result.logits[0], result.hidden[0, 0]

    def _feed_grown(self, grow) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """One head forward for every node worth growing: pair (its parent's predicted feature, its token)."""
        tokens = torch.tensor([g[4] for g in grow])
        features = torch.stack([g[5] for g in grow])
        with torch.inference_mode():
            result = self.engine.feed(tokens.tolist(), [g[2] for g in grow], logits_for=range(len(grow)),
                                      hidden_layers=[-1], embeds=self.head.inputs(features, tokens, own=True))
        self._grown.extend(result.nodes)
        return result.logits, result.hidden[:, 0], result.nodes

    def _children(self, context: BranchContext, state: _Branch, tree: DraftTree, parent: int,
                  logits: torch.Tensor, budget: int) -> list[tuple[int, int, float]]:
        """Add the candidates under `parent` from the head's logits there ([V'])."""
        q = draft_distribution(logits, self.head.token_ids, self.head.vocab_size, context.sampling)  # [vocab]
        return add_candidates(tree, parent, q, min(self.width, budget - len(tree)), state.generator)
