"""Operator calls in a one-stream decode step of the embedded model, by operator (docs/benchmarks.md,
"Why the operator count stops at about 100 a layer"): the profiler's events of a 9-token run less
those of a 1-token run, over the 8 steps between. Run: PYTHONPATH=src python docs/results/operator_count.py"""

import torch
from torch.profiler import ProfilerActivity, profile

import multidecode

torch.set_num_threads(2)
md = multidecode.load()
layers = md.model.config.num_hidden_layers
prompt = md.tokenizer("Once upon a time in a small village there lived", add_special_tokens=False)["input_ids"]


def events(new: int) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        md.generate(list(prompt), max_new_tokens=new, speculate=None, chat=False, eos_token_id=[])
    return {e.key: e.count for e in profiled.key_averages()}


events(3)
one, nine = events(1), events(9)
per_step = {k: (nine.get(k, 0) - one.get(k, 0)) / 8 for k in set(one) | set(nine)}
total = sum(per_step.values())
print(f"{total:.0f} events a step, {total / layers:.1f} a layer")
for name, count in sorted(per_step.items(), key=lambda kv: -kv[1])[:25]:
    print(f"{count:8.1f} {count / layers:6.2f}  {name}")
