"""Forest helpers shared by the exactness tests (`test_exact`, `test_compiled`): tiny models on the
exact kernels at each precision, random forests fed through an engine, the nodes whose logits
differ from their paths fed alone, and torch's thread count for a block."""

from __future__ import annotations

import copy
import os
import random
from contextlib import contextmanager

import torch
from tiny_models import tiny_model

from multidecode import exact
from multidecode.engine import Engine
from multidecode.models.packed import pack_model
from multidecode.scheduler import Feed

PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": 8, "int4": 4}


def exact_model(arch: str, attn: str, precision: str, device: str = "cpu"):
    """A tiny model at `precision` (packed ones: linear weights as codes, bfloat16 activations) on
    `device`, put on the exact kernels there (a GPU's exact path differs from the CPU's)."""
    kind = PRECISIONS[precision]
    model = copy.deepcopy(tiny_model(arch, attn))
    if isinstance(kind, int):
        pack_model(model, kind, torch.bfloat16)
        model.to(device, torch.bfloat16)
    else:
        model.to(device, kind)
    exact.use_exact_kernels(model)
    return model


def random_forest(engine: Engine, rng: random.Random, *, steps: int = 4, vocab: int = 250) -> dict[int, torch.Tensor]:
    """Feed a random forest; returns every fed node's logits (nodes later taken back excluded).

    A prompt of 1-150 tokens (so paths cross position blocks), then steps of up to 12 nodes: each
    under a recent leaf, any cached node, or a node of the same step (draft trees); some steps
    take back leaves (rejected drafts), some compact to half the leaves."""
    prompt = engine.feed_chain([rng.randint(3, vocab) for _ in range(rng.randint(1, 150))], logits=False).nodes
    cached, leaves, logits = list(prompt), [prompt[-1]], {}
    for _ in range(steps):
        tokens, parents = [], []
        for _ in range(rng.randint(1, 12)):
            if tokens and rng.random() < 0.5:
                parents.append(Feed.ref(rng.randrange(len(tokens))))
            else:
                parents.append(rng.choice(cached if rng.random() < 0.3 else leaves))
            tokens.append(rng.randint(3, vocab))
        fed = engine.feed(tokens, parents, logits_for=list(range(len(tokens))))
        new, rows = fed.nodes, fed.logits
        logits.update(zip(new, rows))
        cached += new
        leaves = list(new)
        if rng.random() < 0.3:
            dropped = [n for n in new if engine.forest.is_leaf(n)][:2]
            engine.drop(dropped)
            for node in dropped:
                del logits[node]
                cached.remove(node)
                leaves.remove(node)
        if rng.random() < 0.3 and leaves:
            engine.compact(rng.sample(leaves, max(1, len(leaves) // 2)))
            cached = [n for n in cached if engine.forest.slot_of[n] is not None]
            leaves = [n for n in leaves if engine.forest.slot_of[n] is not None] or leaves
    return logits


def beside_alone(model, *, seed: int, apart: bool | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each node of a random forest: (its logits in the forest, its path's fed alone)."""
    engine = Engine(model, apart=apart)
    logits = random_forest(engine, random.Random(seed))
    return {node: (row, Engine(model).feed_chain(engine.forest.path_tokens(node)).logits[0])
            for node, row in logits.items()}


def differing(model, *, seed: int, apart: bool | None = None) -> tuple[list[int], int]:
    """The nodes of a random forest whose logits differ from their paths fed alone, and how many were fed."""
    pairs = beside_alone(model, seed=seed, apart=apart)
    return [node for node, (row, alone) in pairs.items() if not torch.equal(alone, row)], len(pairs)


@contextmanager
def threads(count: int):
    """torch's intra-op threads set to `count` for a block (test workers run at one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


THREADS = sorted({1, os.cpu_count() or 1})
"""One thread (a test worker, a Ray worker, a container limit) and all of this machine's."""
