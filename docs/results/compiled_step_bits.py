import random

import multidecode
from multidecode.compiled import compile_forward, uncompile
from multidecode.engine import Engine

md = multidecode.load(); model = md.model
rng = random.Random(1)
prompt = [rng.randrange(1000, 9000) for _ in range(rng.randrange(5, 90))]
def go(width, prompt_len):
    out = {}
    for on in (False, True):
        (compile_forward if on else uncompile)(model)
        eng = Engine(model, capacity=64)
        r = eng.feed_chain(prompt[:prompt_len])
        leaf = r.nodes[-1]
        r2 = eng.feed([1234 + i for i in range(width)], [leaf] * width, logits_for=list(range(width)))
        out[on] = r2.logits
    d = (out[False] != out[True]).any(-1)
    print("width", width, "prompt", prompt_len, "rows differing", d.tolist(), float((out[False] - out[True]).abs().max()))
for w in (1, 2, 5):
    for p in (22, 70):
        go(w, p)
