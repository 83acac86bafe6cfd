"""Training Medusa heads by self-distillation: the target writes, the heads learn to guess it.

Medusa (Cai et al., 2024, arXiv 2401.10774) trains its heads on the target's own text
("self-distillation"), so that they learn what the target will write, not what some dataset says.
Here that runs in three **phases**, each kept in a work folder as it goes, so an interrupted run
resumes where it stopped:

1. **write**: the target answers each prompt greedily, `batch` prompts at a time in one forest:
   `answers.jsonl` (one line per prompt, appended as each forest finishes);
2. **read**: the target reads each prompt and answer once; its last hidden state and its `TOP`
   likeliest next tokens with their probabilities at every position are kept: `features/NNNNN.pt`;
3. **train**: head k learns, at position t, the target's distribution at t + 1 + k (the token
   k + 2 places ahead) by soft cross-entropy over the draft vocabulary, weighted `DECAY ** k`;
   `checkpoint.pt` holds the heads, the optimizer and the log every `checkpoint_every` steps.

One sequence in `HOLDOUT` is held out (the last one, in a run of fewer). On it, at every checkpoint, the **chain acceptance** is
measured: at each position of an answer, how many heads in a row guess the target's greedy tokens
(the mean accepted length of a chain draft, before the target's own token), and each head's top-1
agreement. The heads are then written (default: the user cache, where `speculate="medusa"` finds
them for this model) with `training.json`: what they saw and how acceptance grew.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import data
from ..engine import Engine
from ..errors import InvalidArgument
from ..forest import chain_parents
from ..prompts import render_prompt, tokenize_prompt
from ..proposers.heads import fingerprint, head_dir
from ..proposers.medusa import MedusaHeads

TOP = 16
"""The target's likeliest next tokens kept per position: the soft targets."""
DECAY = 0.8
"""Head k's loss weighs DECAY ** k (the Medusa recipe: far heads matter less, and learn less)."""
HOLDOUT = 20
"""One sequence in this many is held out for measuring acceptance."""
EVAL_POSITIONS = 4096
KINDS = ("medusa",)


@dataclass(frozen=True)
class DistillSettings:
    """What `train_drafter` does. prompts: a JSONL file (None: the prompts shipped in the package).
    work: where phases keep their files (None: beside the output). output: the head's folder
    (None: the user cache for the model). limit: use the first `limit` prompts only."""

    kind: str = "medusa"
    prompts: str | None = None
    heads: int = 4
    layers: int = 1
    draft_vocab: int = 8192
    max_new_tokens: int = 192
    batch: int = 16
    epochs: float = 2.0
    batch_positions: int = 512
    learning_rate: float = 1e-3
    seed: int = 0
    checkpoint_every: int = 50
    limit: int | None = None
    work: str | None = None
    output: str | None = None

    def training_key(self) -> str:
        """A hash of what decides the trained weights (not where they go): a resumed run must match."""
        keep = {k: v for k, v in asdict(self).items() if k not in ("work", "output", "checkpoint_every")}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Progress:
    """One event of a training run: `phase` ("write", "read", "train", "done"), `done` of `total`
    units (prompts, sequences, steps), and what the phase reports (`info`: loss, acceptance...)."""

    phase: str
    done: int
    total: int
    info: dict = field(default_factory=dict)


# ---------------------------------------------------------------------- prompts
def read_prompts(path: str | None) -> list[str]:
    """The prompts of a JSONL file: each line {"prompt": text} or {"document": text, "question":
    text}. A line that is neither is refused with its number. None: the shipped prompt set."""
    if path is None:
        lines, name = data.text("distill_prompts.jsonl").splitlines(), "the shipped prompts"
    else:
        try:
            lines, name = Path(path).read_text(encoding="utf-8").splitlines(), str(path)
        except OSError as err:
            raise InvalidArgument(f"cannot read the prompts file {path}: {err.strerror}",
                                  "give a JSONL file with one {\"prompt\": ...} per line") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        text = _prompt_of(record)
        if text is None:
            raise InvalidArgument(f"line {number} of {name} is not a prompt",
                                  'write one JSON object per line: {"prompt": "..."} or {"document": "...", '
                                  '"question": "..."}')
        prompts.append(text)
    if not prompts:
        raise InvalidArgument(f"{name} holds no prompts", 'write one {"prompt": "..."} per line')
    return prompts


def _prompt_of(record) -> str | None:
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prompt"), str) and record["prompt"].strip():
        return record["prompt"]
    if isinstance(record.get("document"), str) and isinstance(record.get("question"), str):
        return f"Here is a document.\n\n{record['document'].strip()}\n\nQuestion: {record['question'].strip()}"
    return None


def check_model(model, kind: str) -> None:
    """Refuse a kind this trainer does not make, or a model without what the kind reads."""
    if kind not in KINDS:
        raise InvalidArgument(f"cannot train a {kind!r} drafter yet", f"use --kind {' or '.join(KINDS)}")
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if getattr(model.config, "hidden_size", None) is None or head is None:
        raise InvalidArgument("Medusa heads read the model's last hidden state and share its LM head, and this "
                              "model has no hidden_size or no output embeddings",
                              "train heads for a causal LM with an LM head")


# ---------------------------------------------------------------------- the run
def train_drafter(decoder, settings: DistillSettings) -> Iterator[Progress]:
    """Train a drafter for `decoder`'s model (see the module notes), yielding `Progress` events;
    the last one ("done") carries the head's folder and its measured acceptance."""
    model = decoder.model
    check_model(model, settings.kind)
    prompts = read_prompts(settings.prompts)[: settings.limit]
    output = Path(settings.output) if settings.output else head_dir(model, settings.kind)
    work = Path(settings.work) if settings.work else output.with_name(output.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    _check_work(work, settings)
    started = time.perf_counter()
    yield from write_answers(decoder, prompts, work / "answers.jsonl", settings)
    answers = read_answers(work / "answers.jsonl")
    yield from read_features(model, answers, work / "features")
    token_ids = draft_vocabulary(answers, settings.draft_vocab, model)
    heads = MedusaHeads(model.config.hidden_size, _vocab(model), settings.heads,
                        num_layers=settings.layers, token_ids=token_ids, target=fingerprint(model)).bind(model)
    heads.to(next(model.parameters()).device)
    log: list[dict] = []
    yield from train_heads(heads, load_features(work / "features", len(answers)), settings, work / "checkpoint.pt", log)
    seen = sum(len(a["prompt"]) + len(a["answer"]) for a in answers)
    summary = {"prompts": len(prompts), "tokens": seen, "answer_tokens": sum(len(a["answer"]) for a in answers),
               "seconds": round(time.perf_counter() - started, 1), "settings": asdict(settings), "log": log}
    heads.save(output, extra={"training": {k: v for k, v in summary.items() if k != "log"}})
    (output / "training.json").write_text(json.dumps(summary, indent=2))
    yield Progress("done", 1, 1, {"folder": str(output), **(log[-1] if log else {}), "tokens": seen,
                                  "seconds": summary["seconds"]})


def _vocab(model) -> int:
    head = model.get_output_embeddings()
    return getattr(head, "out_features", None) or head.weight.shape[0]


def _check_work(work: Path, settings: DistillSettings) -> None:
    """A work folder belongs to one set of settings: resuming with others would mix two runs."""
    stamp = work / "settings.json"
    key = settings.training_key()
    if stamp.exists():
        if json.loads(stamp.read_text()).get("key") != key:
            raise InvalidArgument(f"the work folder {work} holds a run with other settings",
                                  "resume it with the same settings, or give another --work folder (or delete it)")
        return
    stamp.write_text(json.dumps({"key": key, "settings": asdict(settings)}, indent=2))


# ---------------------------------------------------------------------- 1. write
def write_answers(decoder, prompts: list[str], path: Path, settings: DistillSettings) -> Iterator[Progress]:
    """The target's greedy answer to each prompt not answered yet, `batch` at a time, appended."""
    done = {a["i"] for a in read_answers(path)}
    todo = [i for i in range(len(prompts)) if i not in done]
    total_tokens = 0
    yield Progress("write", len(done), len(prompts))
    for start in range(0, len(todo), settings.batch):
        chosen = todo[start : start + settings.batch]
        ids = [tokenize_prompt(decoder.tokenizer, render_prompt(decoder.tokenizer, prompts[i])) for i in chosen]
        run = decoder.start(ids, max_new_tokens=settings.max_new_tokens).finish()
        with path.open("a", encoding="utf-8") as out:
            for i, prompt, branch in zip(chosen, ids, run.branches):
                out.write(json.dumps({"i": i, "prompt": prompt, "answer": list(branch.output.token_ids)}) + "\n")
                total_tokens += len(branch.output.token_ids)
        done.update(chosen)
        yield Progress("write", len(done), len(prompts), {"tokens": total_tokens})


def read_answers(path: Path) -> list[dict]:
    """The answers written so far, in prompt order (a line cut by an interruption is dropped)."""
    if not path.exists():
        return []
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[record["i"]] = record
    return [out[i] for i in sorted(out)]


# ---------------------------------------------------------------------- 2. read
def read_features(model, answers: list[dict], folder: Path) -> Iterator[Progress]:
    """The target's last hidden state and top-`TOP` next-token probabilities at every position of
    each prompt and answer, one file per sequence (existing files are kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    engine = Engine(model)
    for n, record in enumerate(answers):
        path = folder / f"{n:05d}.pt"
        if not path.exists():
            tokens = record["prompt"] + record["answer"]
            _, logits = engine.feed(tokens, chain_parents(len(tokens)), logits_for=range(len(tokens)),
                                    hidden_layers=[-1])  # logits [n, vocab]
            probs, ids = logits.softmax(-1).topk(TOP, -1)  # [n, TOP]
            state = {"features": engine.hidden[:, 0].to(torch.float16).cpu(), "top_ids": ids.to(torch.int32).cpu(),
                     "top_probs": probs.to(torch.float16).cpu(), "prompt_length": len(record["prompt"])}
            engine.compact([])
            torch.save(state, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        yield Progress("read", n + 1, len(answers))


def draft_vocabulary(answers: list[dict], size: int, model) -> torch.Tensor:
    """The `size` tokens the target wrote most (its answers count, then its prompts), as ids."""
    counts = Counter()
    for record in answers:
        counts.update(record["answer"])
    for record in answers:
        counts.update({t: 0 for t in record["prompt"]})  # seen, after every written token
    vocab = _vocab(model)
    if size >= vocab:
        return torch.arange(vocab)
    chosen = [t for t, _ in counts.most_common(size)]
    taken = set(chosen)
    rest = [t for t in range(vocab) if t not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen + rest))


@dataclass
class Features:
    """Every position of every sequence, concatenated: features [N, hidden] float32, top_ids and
    top_probs [N, TOP], last [N] (the index of its sequence's last position), answer [N] (whether
    a position is in an answer), holdout [N] (held-out sequences)."""

    features: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    last: torch.Tensor
    answer: torch.Tensor
    holdout: torch.Tensor


def load_features(folder: Path, count: int) -> Features:
    parts = [torch.load(folder / f"{n:05d}.pt", weights_only=True) for n in range(count)]
    lengths = [p["features"].shape[0] for p in parts]
    ends = torch.tensor(lengths).cumsum(0)
    last = torch.cat([torch.full((n,), int(e) - 1) for n, e in zip(lengths, ends)])
    answer = torch.cat([torch.arange(n) >= p["prompt_length"] - 1 for n, p in zip(lengths, parts)])
    held = [i % HOLDOUT == HOLDOUT - 1 or (count < HOLDOUT and i == count - 1) for i in range(count)]  # at least one
    holdout = torch.cat([torch.full((n,), h) for h, n in zip(held, lengths)])
    return Features(torch.cat([p["features"] for p in parts]).float(), torch.cat([p["top_ids"] for p in parts]).long(),
                    torch.cat([p["top_probs"] for p in parts]).float(), last, answer, holdout)


# ---------------------------------------------------------------------- 3. train
def train_heads(heads: MedusaHeads, data_: Features, settings: DistillSettings, checkpoint: Path,
                log: list[dict]) -> Iterator[Progress]:
    """Train the heads' blocks (the shared LM head rows stay frozen), resuming from `checkpoint`."""
    device = heads.shared.device
    index = torch.full((heads.vocab_size,), -1, dtype=torch.long)
    index[heads.token_ids.cpu()] = torch.arange(heads.draft_vocab_size)
    draft_ids = index[data_.top_ids]  # [N, TOP] draft-vocabulary index, -1 outside it
    train = ((~data_.holdout) & (torch.arange(len(data_.last)) < data_.last)).nonzero().flatten()
    total = max(1, int(settings.epochs * len(train) / settings.batch_positions))
    optimizer = torch.optim.AdamW(heads.blocks.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, settings.learning_rate, total_steps=total, pct_start=0.05)
    step = _resume(checkpoint, heads, optimizer, schedule, log)
    generator = torch.Generator()
    yield Progress("train", step, total, log[-1] if log else {})
    while step < total:
        generator.manual_seed(settings.seed * 1_000_003 + step)  # each step's positions, the same after a resume
        rows = train[torch.randint(len(train), (settings.batch_positions,), generator=generator)]
        loss = _loss(heads, data_, draft_ids, rows, device)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        step += 1
        info = {"loss": round(float(loss.detach()), 4), "positions_seen": step * settings.batch_positions}
        if step % settings.checkpoint_every == 0 or step == total:
            info.update(evaluate(heads, data_, device))
            log.append({"step": step, **info})
            _save_checkpoint(checkpoint, heads, optimizer, schedule, step, log)
        yield Progress("train", step, total, info)


def _loss(heads: MedusaHeads, data_: Features, draft_ids: torch.Tensor, rows: torch.Tensor, device) -> torch.Tensor:
    """Soft cross-entropy of each head against the target's distribution k + 1 positions later."""
    logq = heads(data_.features[rows].to(device)).log_softmax(-1)  # [B, K, V']
    total = logq.new_zeros(())
    for k in range(heads.num_heads):
        later = rows + 1 + k
        valid = later <= data_.last[rows]  # [B]
        if not valid.any():
            continue
        target = later[valid]
        ids, probs = draft_ids[target].to(device), data_.top_probs[target].to(device)  # [b, TOP]
        probs = probs * (ids >= 0)
        probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-6)
        picked = logq[valid.to(device), k].gather(-1, ids.clamp(min=0))  # [b, TOP]
        total = total + DECAY**k * -(probs * picked).sum(-1).mean()
    return total


@torch.no_grad()
def evaluate(heads: MedusaHeads, data_: Features, device) -> dict:
    """On held-out answers: each head's top-1 agreement with the target's greedy token, and the
    mean accepted length of a chain of the heads' top-1 guesses."""
    K = heads.num_heads
    rows = (data_.holdout & data_.answer & (torch.arange(len(data_.last)) + K < data_.last)).nonzero().flatten()
    rows = rows[:EVAL_POSITIONS]
    if not len(rows):
        return {}
    guess = heads.token_ids.cpu()[heads(data_.features[rows].to(device)).argmax(-1).cpu()]  # [R, K] target ids
    truth = torch.stack([data_.top_ids[rows + 1 + k, 0] for k in range(K)], 1)  # [R, K]
    right = guess == truth
    chain = right.long().cumprod(1).sum(1).float()  # heads right in a row
    return {"mean_accepted": round(float(chain.mean()), 3),
            "head_top1": [round(float(v), 3) for v in right.float().mean(0)]}


def _save_checkpoint(path: Path, heads, optimizer, schedule, step: int, log: list[dict]) -> None:
    state = {"step": step, "blocks": heads.blocks.state_dict(), "optimizer": optimizer.state_dict(),
             "schedule": schedule.state_dict(), "log": log}
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def _resume(path: Path, heads, optimizer, schedule, log: list[dict]) -> int:
    """The step a checkpoint reached (0 without one), with the heads and optimizer restored."""
    if not path.exists():
        return 0
    state = torch.load(path, weights_only=False)
    heads.blocks.load_state_dict(state["blocks"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    log[:] = state["log"]
    return int(state["step"])
