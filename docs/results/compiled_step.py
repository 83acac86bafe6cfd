"""Embedded model: compile time, bits per step against eager, graphs over a changing forest, ms/step."""
import random
import sys
import time

import torch
from torch._dynamo.utils import counters

import multidecode
from multidecode.compiled import compile_forward, uncompile
from multidecode.engine import Engine

md = multidecode.load()
model = md.model
if len(sys.argv) > 1:
    torch.set_num_threads(int(sys.argv[1]))

def run_forest(seed, steps=10):
    rng = random.Random(seed)
    eng = Engine(model, capacity=64)
    out = eng.feed_chain([rng.randrange(1000, 9000) for _ in range(rng.randrange(5, 90))])
    leaves = [(out.nodes[-1], int(out.logits.argmax()))]
    logs = []
    for _ in range(steps):
        width = rng.choice([1, 1, 2, 3, 5, 8])
        parents, toks = [], []
        for _ in range(width):
            leaf, tok = rng.choice(leaves)
            parents.append(leaf)
            toks.append(tok if rng.random() < 0.5 else rng.randrange(1000, 9000))
        r = eng.feed(toks, parents, logits_for=list(range(width)))
        logs.append((width, eng.cache.num_slots, r.logits))
        leaves = [(n, int(l.argmax())) for n, l in zip(r.nodes, r.logits)]
    return logs

eager = [run_forest(s) for s in range(3)]
compile_forward(model)
eng = Engine(model, capacity=64)
eng.feed_chain(list(range(100, 120)))
t = time.perf_counter()
eng.feed([5], [eng.forest.num_slots - 1], logits_for=[0])
print(f"first compiled step (compile): {time.perf_counter() - t:.1f} s", flush=True)
t = time.perf_counter()
comp = [run_forest(s) for s in range(3)]
print(f"3 forests x 10 steps compiled: {time.perf_counter() - t:.1f} s; graphs {counters['stats']['unique_graphs']}")
for s, (e, c) in enumerate(zip(eager, comp)):
    print(s, [(w, n, torch.equal(a, b)) for (w, n, a), (_, _, b) in zip(e, c)])
# one-row steps, alternating eager / compiled on the same engine
eng = Engine(model, capacity=256)
out = eng.feed_chain(list(range(100, 146)))
leaf, tok = out.nodes[-1], int(out.logits.argmax())
te, tc = [], []
for block in range(6):
    for acc, on in ((te, False), (tc, True)):
        (compile_forward if on else uncompile)(model)
        for _ in range(10):
            t = time.perf_counter()
            r = eng.feed([tok], [leaf], logits_for=[0])
            acc.append(time.perf_counter() - t)
            leaf, tok = r.nodes[0], int(r.logits.argmax())
med = lambda x: sorted(x)[len(x) // 2] * 1e3
print(f"one-row engine step, ~50-110 cached: eager {med(te):.2f} ms, compiled {med(tc):.2f} ms (medians of 60); graphs {counters['stats']['unique_graphs']}")
