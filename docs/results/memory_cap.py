"""What `MULTIDECODE_MEMORY` holds the work to: the process's resident memory growth at its peak
(sampled every 3 ms) while `ask` answers 4 questions about the 1,400-token sample document with
the embedded model in float32, without a budget and under one, each in a fresh process.

    PYTHONPATH=src python docs/results/memory_cap.py [BUDGET ...]   # default: none, 150MB

A budget caps the cache, the logits and a forward's scratch: a long prompt is read in pieces of a
quarter of it (`memory.forward_bytes`). The growth is measured after a warm-up and `malloc_trim`,
so it is the work's, not the weights'.
"""

import ctypes
import json
import os
import subprocess
import sys
import threading
import time

QUESTIONS = 4


def measure() -> dict:
    """One run in this process: the peak resident growth, the wall time and the answers."""
    import torch

    import multidecode
    from multidecode import data

    torch.set_num_threads(2)

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    decoder = multidecode.load(None, precision="float32")
    document, questions = data.sample_document(), data.sample_questions()[:QUESTIONS]
    decoder.ask(document[:200], questions[:1], max_new_tokens=2, speculate=None)  # warm-up
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = resident()
    peak, done = [base], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.003)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.perf_counter()
    try:
        answers = decoder.ask(document, questions, max_new_tokens=16, speculate=None)
    finally:
        done.set()
        watcher.join()
    return {"budget": os.environ.get("MULTIDECODE_MEMORY"), "peak_growth_mb": round((peak[0] - base) / 1e6, 1),
            "wall_s": round(time.perf_counter() - start, 2), "answers": [a.text for a in answers]}


def main(budgets: list[str]) -> None:
    runs = []
    for budget in budgets:
        environment = {k: v for k, v in os.environ.items() if k != "MULTIDECODE_MEMORY"}
        if budget != "none":
            environment["MULTIDECODE_MEMORY"] = budget
        out = subprocess.run([sys.executable, __file__, "--one"], env=environment, check=True, capture_output=True,
                             text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    for run in runs:
        same = run["answers"] == runs[0]["answers"]
        print(f"budget {run['budget'] or 'none':>6}: peak growth {run['peak_growth_mb']:6.1f} MB, "
              f"{run['wall_s']:.2f} s, answers {'the same' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--one"]:
        print(json.dumps(measure()))
    else:
        main(sys.argv[1:] or ["none", "150MB"])
