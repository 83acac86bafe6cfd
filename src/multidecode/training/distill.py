"""Training learned drafters by self-distillation: the target writes, the head learns to guess it.

Medusa (Cai et al., 2024, arXiv 2401.10774) and EAGLE (Li et al., 2024, arXiv 2401.15077) train
their heads on the target's own text ("self-distillation"), so that they learn what the target
will write, not what some dataset says. Here that runs in three **phases**, each kept in a work
folder as it goes, so an interrupted run resumes where it stopped:

1. **write**: the target answers each prompt greedily, `batch` prompts at a time in one forest:
   `answers.jsonl` (one line per prompt, appended as each forest finishes);
2. **read**: the target reads each prompt and answer once; its last hidden state (the
   **feature**) and its `features.TOP` likeliest next tokens with their probabilities at every position
   are kept: `features/NNNNN.pt`. Both phases are shared by every kind trained in the folder;
3. **train**: the head learns from the features (`trainees`: what each kind learns);
   `<kind>-checkpoint.pt` holds the trained tensors, the optimizer and the log every
   `checkpoint_every` steps.

One sequence in `features.HOLDOUT` is held out (the last one, in a run of fewer); at every checkpoint the
head is measured on it (`evaluate` of its trainee: top-1 agreement with the target's greedy
tokens, and for Medusa the mean accepted length of a chain of its guesses). The head is then
written (default: the user cache, where `speculate="medusa"` or `"eagle"` finds it for this
model) with `training.json`: what it saw and how acceptance grew.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import data
from ..engine import Engine
from ..errors import InvalidArgument, changed_settings, check_positive, decode_text, is_int
from ..forest import chain_parents
from ..models.packed import weights_device
from ..models.vetting import max_positions
from ..prompts import render_prompt, tokenize_prompt
from ..proposers.drafting import vocabulary_size
from ..proposers.eagle import EagleHead, head_config
from ..proposers.heads import fingerprint, head_dir, other_target
from ..proposers.medusa import MedusaHeads
from ..speculation import folder_mode
from . import TRAINABLE
from .features import TOP, Features, load_features
from .trainees import EagleTrainee, MedusaTrainee

RECIPE = 2
"""What the trainees learn (2: the EAGLE head reads whole sequences, prompt first): a checkpoint of
another recipe is not resumed."""


MIN_PROMPTS = 2
"""The fewest prompts a run trains on: one answer in `features.HOLDOUT` (at least one) is held out."""


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

    def __post_init__(self) -> None:
        """Refuse a setting no run could use before anything loads (--epochs nan passed click's range
        and failed as a traceback once the answers were written)."""
        for name in ("heads", "layers", "draft_vocab", "max_new_tokens", "batch", "batch_positions",
                     "checkpoint_every", *(("limit",) if self.limit is not None else ())):
            check_positive(name, getattr(self, name))
        for name in ("epochs", "learning_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise InvalidArgument(f"{name} must be a positive finite number, got {value!r}",
                                      f"for example {name}={getattr(DistillSettings, name)}")
        if not is_int(self.seed) or self.seed < 0:
            raise InvalidArgument(f"seed must be a non-negative integer, got {self.seed!r}", "for example seed=0")

    def training_settings(self) -> dict:
        """What decides the trained weights besides the data (not where they go, nor how often they
        are saved): the work folder's answers are held to their prompts by `data_key`."""
        keep = {k: v for k, v in asdict(self).items()
                if k not in ("work", "output", "checkpoint_every", "prompts", "limit")}
        return keep | {"recipe": RECIPE}

    def training_key(self) -> str:
        """A hash of `training_settings`: a resumed run must match."""
        return hashlib.sha256(json.dumps(self.training_settings(), sort_keys=True).encode()).hexdigest()[:16]

    def data_key(self, prompts: list[str]) -> str:
        """A hash of what decides the answers the target writes (shared by every kind trained on
        them): the prompts themselves (not the file's name: a file rewritten or grown is other data)
        and max_new_tokens. The target is checked apart (`_check_work`)."""
        keep = {"prompts": prompts, "max_new_tokens": self.max_new_tokens}
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
            raw = Path(path).read_bytes()
        except OSError as err:
            raise InvalidArgument(f"cannot read the prompts file {path}: {err.strerror}",
                                  "give a JSONL file with one {\"prompt\": ...} per line") from None
        lines, name = decode_text(raw, str(path), "prompts file").splitlines(), str(path)
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


def training_prompts(settings: DistillSettings) -> list[str]:
    """The prompts a run trains on (`read_prompts`, the first `limit`): at least `MIN_PROMPTS`, since
    one answer is held out to measure acceptance (refused before the model loads, not after it answered)."""
    prompts = read_prompts(settings.prompts)[: settings.limit]
    if len(prompts) < MIN_PROMPTS:
        raise InvalidArgument(f"a drafter is trained on {MIN_PROMPTS} prompts or more, got {len(prompts)}: one "
                              "answer is held out to measure acceptance", "give more prompts (or a larger --limit)")
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
    if kind not in TRAINABLE:
        raise InvalidArgument(f"cannot train a {kind!r} drafter yet", f"use --kind {' or '.join(TRAINABLE)}")
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if getattr(model.config, "hidden_size", None) is None or head is None:
        raise InvalidArgument(f"{kind} heads read the model's last hidden state and share its LM head, and this "
                              "model has no hidden_size or no output embeddings",
                              "train heads for a causal LM with an LM head")


# ---------------------------------------------------------------------- the run
def train_drafter(decoder, settings: DistillSettings) -> Iterator[Progress]:
    """Train a drafter for `decoder`'s model (see the module notes), yielding `Progress` events;
    the last one ("done") carries the head's folder and its measured acceptance."""
    model = decoder.model
    check_model(model, settings.kind)
    prompts, left_out = fitting_prompts(decoder, training_prompts(settings), settings.max_new_tokens)
    output = Path(settings.output) if settings.output else head_dir(model, settings.kind)
    work = Path(settings.work) if settings.work else output.parent / "distill.work"
    _check_output(output, model, settings.kind)
    work.mkdir(parents=True, exist_ok=True)
    _check_work(work, settings, prompts, model)
    started = time.perf_counter()
    yield from write_answers(decoder, prompts, work / "answers.jsonl", settings)
    answers = read_answers(work / "answers.jsonl")
    yield from read_features(model, answers, work / "features")
    token_ids = draft_vocabulary(answers, settings.draft_vocab, model)
    trainee = new_trainee(settings, model, token_ids, load_features(work / "features", [a["i"] for a in answers]))
    log: list[dict] = []
    yield from train_loop(trainee, settings, work / f"{settings.kind}-checkpoint.pt", log)
    seen = sum(len(a["prompt"]) + len(a["answer"]) for a in answers)
    summary = {"prompts": len(prompts), "left_out": left_out, "tokens": seen,
               "answer_tokens": sum(len(a["answer"]) for a in answers),
               "seconds": round(time.perf_counter() - started, 1), "settings": asdict(settings), "log": log}
    trainee.head.save(output, extra={"training": {k: v for k, v in summary.items() if k != "log"}})
    (output / "training.json").write_text(json.dumps(summary, indent=2))
    yield Progress("done", 1, 1, {"folder": str(output), **(log[-1] if log else {}), "tokens": seen,
                                  "seconds": summary["seconds"], "left_out": left_out})


def _target_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt's ids as the target reads it (in its chat template, where it has one)."""
    return tokenize_prompt(tokenizer, render_prompt(tokenizer, prompt))


def fitting_prompts(decoder, prompts: list[str], max_new_tokens: int) -> tuple[list[str], list[int]]:
    """The prompts that fit the model's positions with an answer of `max_new_tokens` (read back
    whole: every token fed), and the numbers (from 1, in the prompts' order) of those left out: a
    prompt set written for long windows (the shipped one reaches about 1,100 tokens) still trains
    a model of 512 positions on what fits. None fitting is refused."""
    limit = max_positions(decoder.model.config)
    if limit is None:
        return prompts, []
    fits = [len(_target_ids(decoder.tokenizer, p)) + max_new_tokens <= limit for p in prompts]
    if not any(fits):
        raise InvalidArgument(f"none of the {len(prompts)} prompts fits the model's {limit} positions with "
                              f"{max_new_tokens} new tokens", "lower --max-new-tokens, or give --prompts FILE with "
                              "shorter prompts")
    return [p for p, fit in zip(prompts, fits) if fit], [i for i, fit in enumerate(fits, 1) if not fit]


def new_trainee(settings: DistillSettings, model, token_ids: torch.Tensor, data_: Features):
    """The trainee of `settings.kind`: fresh heads bound to `model`, over `data_`; their starting
    weights drawn from `settings.seed` (an EAGLE layer's are random), so a run is repeatable."""
    device = weights_device(model)
    if settings.kind == "eagle":
        with torch.random.fork_rng(devices=[]):  # the caller's global generator is left as it was
            torch.manual_seed(settings.seed)
            head = EagleHead(head_config(model, len(token_ids)), token_ids, vocabulary_size(model),
                             target=fingerprint(model))
        head.bind(model)
        return EagleTrainee(head.to(device), data_)
    heads = MedusaHeads(model.config.hidden_size, vocabulary_size(model), settings.heads, num_layers=settings.layers,
                        token_ids=token_ids, target=fingerprint(model)).bind(model)
    return MedusaTrainee(heads.to(device), data_, settings.batch_positions)


def _check_work(work: Path, settings: DistillSettings, prompts: list[str], model) -> None:
    """A work folder's answers belong to one target and one set of prompts (every kind trained
    there reads them): resuming with another model (the default folder is one per model shape) or
    other prompts would train a head on text its target never wrote."""
    stamp, key, fix = work / "settings.json", settings.data_key(prompts), f"give another --work folder (or delete {work})"
    if not stamp.exists():
        stamp.write_text(json.dumps({"key": key, "target": fingerprint(model), "settings": asdict(settings)}, indent=2))
        return
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        recorded = None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("target"), dict):
        raise InvalidArgument(f"the work folder {work} was not made by this trainer, or by an earlier version", fix)
    other = other_target(recorded["target"], model)
    if other is not None:
        raise InvalidArgument(f"the work folder {work} holds the answers of {other}", fix)
    if recorded.get("key") != key:
        raise InvalidArgument(f"the work folder {work} holds answers to other prompts (or of another max new tokens)",
                              f"resume it with the same prompts, in the same order, and max new tokens, or {fix}")


def _check_output(output: Path, model, kind: str) -> None:
    """Refuse an output folder holding something else than a `kind` head for this model: a model's
    config.json (`--output` naming the model's own folder), a head trained for another target,
    which writing there would replace, or a head of another kind, whose weights would be left
    beside the new head's."""
    path = output / "config.json"
    if not path.exists():
        return
    try:
        target = json.loads(path.read_text()).get("multidecode_target")
    except (OSError, ValueError, AttributeError):
        target = None
    if not isinstance(target, dict):
        raise InvalidArgument(f"{output} holds a config.json that is not a head this trainer wrote (a model's folder?)",
                              "give --output an empty folder or a new one")
    other = other_target(target, model)
    if other is not None:
        raise InvalidArgument(f"{output} holds a head trained for {other}, which this run would replace",
                              f"give another --output (or delete {output})")
    held = folder_mode(output)
    if held != kind:
        raise InvalidArgument(f"{output} holds {held} weights and this run writes {kind} weights, which would be left "
                              "beside them",
                              f"give another --output (or delete {output})")


# ---------------------------------------------------------------------- 1. write
def write_answers(decoder, prompts: list[str], path: Path, settings: DistillSettings) -> Iterator[Progress]:
    """The target's greedy answer to each prompt not answered yet, `batch` at a time, appended
    (after a line an interruption cut short is taken off: its prompt is answered again)."""
    _drop_cut_line(path)
    done = {a["i"] for a in read_answers(path)}
    todo = [i for i in range(len(prompts)) if i not in done]
    total_tokens = 0
    yield Progress("write", len(done), len(prompts))
    for start in range(0, len(todo), settings.batch):
        chosen = todo[start : start + settings.batch]
        ids = [_target_ids(decoder.tokenizer, prompts[i]) for i in chosen]
        run = decoder.start(ids, max_new_tokens=settings.max_new_tokens).finish()
        with path.open("a", encoding="utf-8") as out:
            for i, prompt, branch in zip(chosen, ids, run.branches):
                out.write(json.dumps({"i": i, "prompt": prompt, "answer": list(branch.output.token_ids)}) + "\n")
                total_tokens += len(branch.output.token_ids)
        done.update(chosen)
        yield Progress("write", len(done), len(prompts), {"tokens": total_tokens})


def _drop_cut_line(path: Path) -> None:
    """Truncate `path` after its last whole line (an appended record must not join a cut one)."""
    if not path.exists():
        return
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        with path.open("r+b") as out:
            out.truncate(raw.rfind(b"\n") + 1)


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
    each prompt and answer, one file per sequence, named by its prompt's index (existing files are
    kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    engine = Engine(model)
    for n, record in enumerate(answers):
        path = folder / f"{record['i']:05d}.pt"
        if not path.exists():
            tokens = record["prompt"] + record["answer"]
            result = engine.feed(tokens, chain_parents(len(tokens)), logits_for=range(len(tokens)),
                                 hidden_layers=[-1])  # logits [n, vocab], hidden [n, 1, hidden size]
            probs, ids = result.logits.softmax(-1).topk(TOP, -1)  # [n, TOP]
            state = {"features": result.hidden[:, 0].to(torch.float16).cpu(), "top_ids": ids.to(torch.int32).cpu(),
                     "top_probs": probs.to(torch.float16).cpu(), "prompt_length": len(record["prompt"]),
                     "tokens": torch.tensor(tokens, dtype=torch.int32)}
            engine.compact([])
            _save(state, path)
        yield Progress("read", n + 1, len(answers))


def draft_vocabulary(answers: list[dict], size: int, model) -> torch.Tensor:
    """The `size` tokens the target wrote most (its answers count, then its prompts), as ids."""
    counts = Counter()
    for record in answers:
        counts.update(record["answer"])
    for record in answers:
        counts.update({t: 0 for t in record["prompt"]})  # seen, after every written token
    vocab = vocabulary_size(model)
    if size >= vocab:
        return torch.arange(vocab)
    chosen = [t for t, _ in counts.most_common(size)]
    taken = set(chosen)
    rest = [t for t in range(vocab) if t not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen + rest))


# ---------------------------------------------------------------------- 3. train
def train_loop(trainee, settings: DistillSettings, checkpoint: Path, log: list[dict]) -> Iterator[Progress]:
    """Train `trainee` (a `trainees.MedusaTrainee` or `trainees.EagleTrainee`: its trained
    `module`, its `loss` of a seeded batch, its held-out `evaluate`) for `settings.epochs`,
    resuming from `checkpoint`; every `checkpoint_every` steps it is evaluated and saved."""
    total = max(1, int(settings.epochs * trainee.steps_per_epoch))
    optimizer = torch.optim.AdamW([p for p in trainee.module.parameters() if p.requires_grad],
                                  lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, settings.learning_rate, total_steps=total, pct_start=0.05)
    step = _resume(checkpoint, settings, trainee.module, optimizer, schedule, log)
    generator = torch.Generator()
    yield Progress("train", step, total, log[-1] if log else {})
    while step < total:
        generator.manual_seed(settings.seed * 1_000_003 + step)  # each step's batch, the same after a resume
        loss = trainee.loss(generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        step += 1
        info = {"loss": round(float(loss.detach()), 4), "positions_seen": step * trainee.positions_per_step}
        if step % settings.checkpoint_every == 0 or step == total:
            info.update(trainee.evaluate())
            log.append({"step": step, **info})
            _save_checkpoint(checkpoint, settings, trainee.module, optimizer, schedule, step, log)
        yield Progress("train", step, total, info)


def _save_checkpoint(path: Path, settings: DistillSettings, module, optimizer, schedule, step: int,
                     log: list[dict]) -> None:
    _save({"key": settings.training_key(), "settings": settings.training_settings(), "step": step,
           "module": _trained_state(module),
           "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "log": log}, path)


def _save(state: dict, path: Path) -> None:
    """torch.save, whole or not at all (an interrupted write leaves the old file, or none)."""
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def _trained_state(module) -> dict:
    """The module's trained tensors (the target's tied rows are not the trainee's)."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in module.state_dict().items() if k not in frozen}


def _resume(path: Path, settings: DistillSettings, module, optimizer, schedule, log: list[dict]) -> int:
    """The step a checkpoint reached (0 without one), with the module and optimizer restored. A
    checkpoint of other training settings is refused: resuming it would mix two runs."""
    if not path.exists():
        return 0
    state = torch.load(path, weights_only=False)
    if state.get("key") != settings.training_key():
        saved = state.get("settings")  # a checkpoint written before they were kept names none
        changed = changed_settings(saved, settings.training_settings()) if saved else []
        raise InvalidArgument(f"the work folder holds a {settings.kind} training with other settings ({path})"
                              + (f": {'; '.join(changed)}" if changed else ""),
                              "resume it with the same settings, or give another --work folder (or delete the file)")
    if state["schedule"].get("total_steps") != schedule.total_steps:  # the data is checked: a damaged work folder
        raise InvalidArgument(f"the checkpoint {path} was trained over {state['schedule'].get('total_steps')} steps, "
                              f"this run has {schedule.total_steps}: its features are not the ones it saw",
                              "delete the checkpoint (the answers and features are kept), or give another --work folder")
    module.load_state_dict(state["module"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    log[:] = state["log"]
    return int(state["step"])
