"""The entry points: `MultiDecoder` (a model and its tokenizer, one method per strategy), `load`,
and the token-level `decode` / `stream_decode` / `start_forest` for any transformers causal LM.

Every call builds a new `Scheduler` (one engine, one KV cache) for that call and hands it to a
strategy (`multidecode.strategies`) or to `branches.start`; nothing here prints. `stream*`
methods yield `TokenEvent`s as tokens are produced; the others return finished results.

`speculate=` (see `speculation`) lets every branch carry a draft tree verified in the same
forward; it changes how fast tokens come, never which tokens.

Structured output: `json_schema=` (a dict or JSON text), `regex=`, `grammar=` (Lark or GBNF) or
one `constraint=` (a `Constraint`) holds every branch's output to it (see `constraints`); in
`ask`, each may be a list of one per question (None for a free answer).

`decode` is the model-level entry point: with `do_sample=False`, branch i's ids equal what
`model.generate(prefix_ids + branch_ids[i], do_sample=False, ...)` returns after the prompt,
with or without speculation.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Self

from .branches import ADMIT_SETTINGS, BranchRun, TokenEvent, start, start_prompts
from .compiled import compile_forward
from .constraints import Constraint, constraint_of
from .cost import CostCurve, LearnedCurve
from .engine import Engine
from .errors import InvalidArgument, InvalidInput, UnsupportedModel, as_list, check_flag, is_int
from .exact import hold_exact_kernels, is_exact
from .memory import Footprint, available_bytes
from .models.loading import Loaded, load_model
from .models.packed import activation_dtype, packed_bytes
from .models.precision import parse as parse_precision
from .models.vetting import check_has_weights, check_is_model, check_supported
from .sampling_params import SAMPLING_KEYS, per_branch_sampling
from .scheduler import CompactionPolicy, Scheduler, new_scheduler
from .speculation import (
    LEARNED,
    PROPOSER_MODES,
    SpeculationSettings,
    build_speculation,
    load_draft,
    load_heads,
    speculation_mode,
)
from .stopping import eos_ids_of
from .strategies import ask as _ask
from .strategies import beam as _beam
from .strategies import complete as _complete
from .strategies import margins as _margins
from .strategies import vote as _vote
from .strategies.ask import Answer
from .strategies.beam import Beam
from .strategies.complete import Completion
from .strategies.vote import Vote


def _one_completion(settings: dict) -> None:
    """Refuse what only `complete` takes on `generate` (it passes n=1 and sample=False itself: the
    keywords collided in a TypeError)."""
    hints = {"n": "use complete(prompt, n=...) for several completions",
             "sample": "pass do_sample=True (or temperature=, top_p=, seed=) to sample it"}
    for name, hint in hints.items():
        if name in settings:
            raise InvalidArgument(f"generate makes one completion and takes no {name}=", hint)


class MultiDecoder:
    """A causal LM and its tokenizer, decoded as forests over one shared KV cache.

    model: any transformers causal LM loaded with eager or sdpa attention.
    exact: put `model` on the exact kernels (`exact.hold_exact_kernels`) while this decoder lives:
        its linear layers and attention are swapped for ones sharing the same weights, so a
        branch's tokens never depend on what shares its forward; `close()` (or the end of a `with`
        block, or the decoder being collected) puts the model back as it was. A model that cannot
        run on them is refused here (`NotBitExact`, with the reason); False keeps the model's own
        kernels: exact to the token in float32, not the bit (`load` decides this for its models).
    compaction: when to drop finished branches from the cache (default: a quarter of it dead).
    cost: the forward cost curve that speculate="auto" uses (default: learned from this model's
        forwards on this machine, from a probe of at most a second on first use, and kept on
        disk: see `cost.cost_curve`; a given `CostCurve` is used as it is).
    draft: the draft model of speculate="draft": a causal LM with the target's tokenizer, or a
        self-draft of the target (`self_draft.self_draft(model, skip_layers)`).
    """

    def __init__(self, model, tokenizer, *, exact: bool = True, compaction: CompactionPolicy | None = None,
                 cost: CostCurve | LearnedCurve | None = None, draft=None, loaded: Loaded | None = None) -> None:
        check_supported(model)
        check_has_weights(model)
        check_flag("exact", exact)
        # The release runs once: at close(), or when the decoder is collected (it holds the model, not the decoder).
        self._kernels = weakref.finalize(self, hold_exact_kernels(model)) if exact else None
        self.model = model
        self.tokenizer = tokenizer
        self.loaded = loaded  # how `load` loaded it: precision, formats, source
        self.compaction = compaction or CompactionPolicy()
        self.cost = cost
        self.draft = draft
        self._drafts: dict[tuple, object] = {}  # (draft model, skipped layers) -> a draft made by `draft_for`

    def close(self) -> None:
        """Put the model back on the kernels it had before this decoder (see `exact`); the decoder
        is not to be used afterwards. Idempotent."""
        if self._kernels is not None:
            self._kernels()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def speculation(self, speculate):
        """`speculate` as this decoder runs it. "draft" drafts with this decoder's draft model;
        a learned mode ("medusa", "eagle", "mtp") with the head found for this model, and "auto"
        with them too where there are some (`learned_heads`); `SpeculationSettings` that name their
        own draft (a model, or a self-draft) get it from `draft_for`. These come back as a
        `Speculation` with a fresh proposer, so call this once per run; other values come back as
        they are (an unknown mode's name is refused here)."""
        if isinstance(speculate, str):
            mode = speculation_mode(speculate)
            if mode is not None and PROPOSER_MODES[mode].drafts_with_decoder:
                speculate = SpeculationSettings(mode)
        if isinstance(speculate, SpeculationSettings):
            return build_speculation(speculate, self.model.dtype, draft=self.draft_for(speculate),
                                     exact=is_exact(self.model))
        return speculate

    def draft_for(self, settings: SpeculationSettings):
        """The draft model `settings` draft with: the one they name, loaded or built once and kept
        (see `speculation.load_draft`), else this decoder's `draft`."""
        if settings.mode == "auto":
            return self.learned_heads()
        if settings.mode in LEARNED:  # the learned heads, found for this model once
            return self._learned_head(settings)
        if not settings.own_draft:
            return self.draft
        key = (settings.draft_model, settings.skip_layers)
        if key not in self._drafts:
            self._drafts[key] = load_draft(settings, self.model, self.tokenizer)
        return self._drafts[key]

    def learned_heads(self) -> list:
        """The learned heads trained for this model (in the user cache, or shipped for the
        embedded model), of each kind, and the MTP layer its checkpoint ships: "auto" drafts with
        them too, where the cost model finds they pay."""
        if "auto" not in self._drafts:
            found = []
            for kind in LEARNED:
                try:
                    found.append(self._learned_head(SpeculationSettings(kind)))
                except (InvalidArgument, UnsupportedModel):  # none, or for another model: auto goes without
                    pass
            self._drafts["auto"] = found
        return self._drafts["auto"]

    def _learned_head(self, settings: SpeculationSettings):
        """The learned head `settings` name, loaded once (one copy for its mode and for "auto")."""
        key = (settings.mode, settings.head)
        if key not in self._drafts:
            self._drafts[key] = load_heads(settings, self.model)
        return self._drafts[key]

    def memory(self) -> dict:
        """What the model holds: its precision (and why `auto` chose it), the bytes of its resident
        weights (each storage once), the bytes of its file's tensors (GGUF), the KV cache's bytes
        per token, and how many tensors ended in each format."""
        return memory_report(self.model, self.loaded)

    @property
    def eos_ids(self) -> frozenset[int]:
        return eos_ids_of(self.model, None)

    def scheduler(self) -> Scheduler:
        """A new scheduler (with its own engine and cache) for this model. On an exact decoder it
        holds the exact kernels too, while it lives: a stream or run it serves keeps them after
        the decoder is gone."""
        if self._kernels is not None and not self._kernels.alive:
            raise InvalidArgument("this MultiDecoder was closed (its model is back on the kernels it had)",
                                  "make a new MultiDecoder, or use it before close()")
        scheduler = new_scheduler(self.model, compaction=self.compaction, cost=self.cost)
        if self._kernels is not None:
            weakref.finalize(scheduler, hold_exact_kernels(self.model))
        return scheduler

    # ------------------------------------------------------------------ token level
    def start(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop: Sequence[str] = (),
              eos_token_id=None, speculate=None, constraint=None, json_schema=None, regex=None, grammar=None,
              logprobs: int | None = None, **sampling) -> BranchRun:
        """Start decoding whole prompts (token ids) as one forest; iterate `.events` to decode.

        eos_token_id: the ids that end a branch (default: the model's; [] never stops early).
        logprobs: each event's token log-probability and the `logprobs` likeliest (see `TokenEvent`).
        """
        prompts = as_list(prompts)
        if isinstance(prompts, (str, bytes)):
            raise InvalidInput("start takes prompts as token ids (a list of lists of ints), got text",
                               "for text use generate, complete or ask; or tokenize it: [tokenizer(text)['input_ids']]")
        if isinstance(prompts, list) and prompts and all(is_int(t) for t in prompts):
            raise InvalidInput("start takes a list of prompts, got one prompt's token ids", "wrap it: start([ids])")
        return start_prompts(self.scheduler(), prompts, max_new_tokens=max_new_tokens,
                             sampling=per_branch_sampling(len(prompts), sampling), tokenizer=self.tokenizer,
                             stop=stop, eos_token_id=eos_token_id, speculate=self.speculation(speculate),
                             constraint=constraint_of(constraint, json_schema=json_schema, regex=regex, grammar=grammar),
                             logprobs=logprobs)

    # ------------------------------------------------------------------ one prompt
    def generate(self, prompt: str | Sequence[int], *, max_new_tokens: int = 256, speculate="auto",
                 chat: bool | None = None, stop: Sequence[str] = (), eos_token_id=None, constraint=None, json_schema=None, regex=None, grammar=None,
                 logprobs: int | None = None, **sampling) -> Completion:
        """One completion of one prompt, greedy unless sampling settings say otherwise.

        A text prompt goes through the chat template when the tokenizer has one (chat=False for
        raw text); a list of ids is used as given. speculate: "auto" (the default) drafts with
        prompt lookup and the suffix store only where the measured cost of a forward on this
        hardware says it pays (learned from the forwards that run anyway, after a probe of at most a
        second on first use, and kept on disk);
        "lookup", "suffix", "lookahead" and "draft" always draft (see `speculation`); None never does.
        Greedy output equals `model.generate(do_sample=False)`; `.stats` says how many forwards
        it took and how many draft tokens were accepted. logprobs=k: the completion carries each
        token's log-probability under the model (`.logprobs`, their sum `.logprob`) and the k
        likeliest tokens at each step (`.top_logprobs`; 0: none), as its events do.
        """
        _one_completion(sampling)
        return _complete.complete(self.scheduler(), self.tokenizer, prompt, n=1, max_new_tokens=max_new_tokens,
                                  stop=stop, chat=chat, sample=False, speculate=self.speculation(speculate),
                                  eos_token_id=eos_token_id, constraint=constraint_of(constraint, json_schema=json_schema, regex=regex, grammar=grammar), logprobs=logprobs, **sampling)[0]

    def stream_generate(self, prompt: str | Sequence[int], *, max_new_tokens: int = 256, speculate="auto",
                        chat: bool | None = None, stop: Sequence[str] = (), eos_token_id=None, constraint=None, json_schema=None, regex=None, grammar=None,
                        logprobs: int | None = None, **sampling) -> Iterator[TokenEvent]:
        """`TokenEvent`s as `generate` produces them."""
        _one_completion(sampling)
        return _complete.stream(self.scheduler(), self.tokenizer, prompt, n=1, max_new_tokens=max_new_tokens,
                                stop=stop, chat=chat, sample=False, speculate=self.speculation(speculate),
                                eos_token_id=eos_token_id, constraint=constraint_of(constraint, json_schema=json_schema, regex=regex, grammar=grammar), logprobs=logprobs, **sampling)

    # ------------------------------------------------------------------ many questions, one document
    def question_prompts(self, document: str, questions: Sequence[str], *, instruction: str | None = None):
        """The whole prompt ids each question would be asked with alone."""
        return _ask.question_prompts(self.tokenizer, document, questions, instruction=instruction)

    def ask(self, document: str, questions: Sequence[str], *, max_new_tokens: int = 48, stop: Sequence[str] = (),
            instruction: str | None = None, speculate=None, constraint=None, json_schema=None, regex=None, grammar=None,
            eos_token_id=None, **sampling) -> list[Answer]:
        """Answer every question about `document` in one MultiDecode pass.

        Greedy by default; each answer equals greedy generation from its `.prompt_ids` alone (on
        the exact kernels, the default; with exact=False in float32 only: see the README).
        Sampling settings (`do_sample`, `temperature`, `top_k`, `top_p`, `min_p`,
        `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `seed`) take
        one value or one per question; the penalties and the bias apply to greedy answers too. speculate: every
        question's branch carries its own draft tree ("lookup", "auto", ...). json_schema, regex,
        grammar, constraint: one for every answer, or a list of one per question (None: free).
        eos_token_id: the ids that end an answer (default: the model's; [] never stops early).
        """
        return _ask.ask(self.scheduler(), self.tokenizer, document, questions, max_new_tokens=max_new_tokens,
                        stop=stop, instruction=instruction, speculate=self.speculation(speculate),
                        constraint=constraint_of(constraint, json_schema=json_schema, regex=regex, grammar=grammar),
                        eos_token_id=eos_token_id, **sampling)

    def stream(self, document: str, questions: Sequence[str], *, max_new_tokens: int = 48,
               stop: Sequence[str] = (), instruction: str | None = None, speculate=None, constraint=None, json_schema=None, regex=None, grammar=None,
               eos_token_id=None, **sampling) -> Iterator[TokenEvent]:
        """`TokenEvent`s (branch = question index) as `ask` answers; inputs are checked and the
        prompts prefilled before this returns."""
        return _ask.stream(self.scheduler(), self.tokenizer, document, questions, max_new_tokens=max_new_tokens,
                           stop=stop, instruction=instruction, speculate=self.speculation(speculate),
                           constraint=constraint_of(constraint, json_schema=json_schema, regex=regex, grammar=grammar),
                           eos_token_id=eos_token_id, **sampling)

    # ------------------------------------------------------------------ parallel completions
    def complete(self, prompt: str | Sequence[int], *, n: int = 1, max_new_tokens: int = 64,
                 stop: Sequence[str] = (), chat: bool | None = None, speculate=None, constraint=None, json_schema=None, regex=None, grammar=None,
                 logprobs: int | None = None, **sampling) -> list[Completion]:
        """n completions of one prompt from one prefill, sampled by default.

        Sampling settings take one value or a list of n. With `seed=s`, completion i uses seed
        s + i and equals `complete(prompt, n=1, seed=s + i)`; without one, a random base seed is
        drawn and each `Completion.seed` says how to reproduce it. Text prompts go through the
        chat template when the tokenizer has one (chat=False for raw text); ids are used as given.
        speculate never changes the tokens of a seeded completion. logprobs=k: each completion's
        token log-probabilities, to rank them by (`Completion.logprob`), as `generate` gives them.
        """
        return _complete.complete(self.scheduler(), self.tokenizer, prompt, n=n, max_new_tokens=max_new_tokens,
                                  stop=stop, chat=chat, speculate=self.speculation(speculate), constraint=constraint_of(constraint, json_schema=json_schema, regex=regex, grammar=grammar),
                                  logprobs=logprobs, **sampling)

    def stream_complete(self, prompt: str | Sequence[int], *, n: int = 1, max_new_tokens: int = 64,
                        stop: Sequence[str] = (), chat: bool | None = None, speculate=None, constraint=None, json_schema=None, regex=None, grammar=None,
                        logprobs: int | None = None, **sampling) -> Iterator[TokenEvent]:
        """`TokenEvent`s (branch = completion index) as `complete` generates."""
        return _complete.stream(self.scheduler(), self.tokenizer, prompt, n=n, max_new_tokens=max_new_tokens,
                                stop=stop, chat=chat, speculate=self.speculation(speculate), constraint=constraint_of(constraint, json_schema=json_schema, regex=regex, grammar=grammar),
                                logprobs=logprobs, **sampling)

    # ------------------------------------------------------------------ self-consistency
    def vote(self, question: str, *, n: int = 8, max_new_tokens: int = 256,
             extract: Callable[[str], str | None] | None = None, speculate=None, constraint=None, json_schema=None, regex=None, grammar=None,
             **sampling) -> Vote:
        """n sampled reasoning traces in one forest, an answer extracted from each, and the majority.
        extract: text -> answer (default: an "Answer:" line, else the last number or line; a trace
        held to a constraint is its answer whole, see `strategies.vote`). Other keywords are
        `complete`'s (chat, stop, sampling), but logprobs."""
        return _vote.vote(self.scheduler(), self.tokenizer, question, n=n, max_new_tokens=max_new_tokens,
                          extract=extract, speculate=self.speculation(speculate), constraint=constraint_of(constraint, json_schema=json_schema, regex=regex, grammar=grammar), **sampling)

    # ------------------------------------------------------------------ beam search
    def beam_search(self, prompt: str | Sequence[int], *, num_beams: int, max_new_tokens: int,
                    length_penalty: float = 1.0, early_stopping: bool | str = False,
                    num_return_sequences: int = 1, chat: bool | None = None, eos_token_id=None) -> list[Beam]:
        """Beam search with beams as branches of one tree, best first; sequences equal transformers'
        `generate(num_beams=...)` and scores equal its `sequences_scores` to float32 rounding.
        num_beams=1 is greedy search, as in transformers. eos_token_id: the ids that end a beam
        (default: the model's; [] never stops early)."""
        return _beam.beam_search(self.scheduler(), self.tokenizer, prompt, num_beams=num_beams,
                                 max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                                 early_stopping=early_stopping, num_return_sequences=num_return_sequences, chat=chat,
                                 eos_token_id=eos_token_id)

    # ------------------------------------------------------------------ writing in the margins
    def margins(self, document: str | Sequence[str], question: str, *, chunk_tokens: int = 300, **settings):
        """Writing in the margins: a note per chunk (all in one pass), relevance, then the answer."""
        return _margins.margins(self.scheduler(), self.tokenizer, document, question, chunk_tokens=chunk_tokens,
                                **settings)


def load(model: str | None = None, *, precision: str | None = None, dtype=None, device=None,
         exact: bool = True, compile: bool = False) -> MultiDecoder:
    """Load a model by name (nothing for the embedded SmolLM2-135M-Instruct) as a `MultiDecoder`.

    model: None, a local Hugging Face folder, a local .gguf file, or a hub id.
    precision: "auto" (default: a GGUF file keeps its 4- or 8-bit codes, a folder its own dtype),
        "float32", "bfloat16", "float16" (CUDA), "int8" or "int4" (see `models.precision`); dtype
        is the older name of the float ones. device: "cpu", "cuda", ... (default: cuda if any).
    exact: batch-invariant attention (default): a node's logits do not depend on what else shares
        its forward, bit for bit (`multidecode.exact`); False keeps the model's own attention
        (faster on long prompts, exact to the token).
    compile: run the engine's forwards as one compiled graph (`multidecode.compiled`): the same bits
        as without, a shorter step, for long jobs (a server, a batch): the first forwards wait for
        inductor (seconds to a minute or two per graph on a CPU; its artifacts are kept in the user
        cache for later processes). A model the compiled step cannot run exactly runs eagerly
        (`compiled.compiled_forward(model).refused` says why). Needs exact=True.
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise InvalidArgument(f"load takes a model's name or path, got {type(model).__name__}",
                              "pass a local folder, a .gguf file or a hub id, or nothing for the embedded model; "
                              "a model object goes to MultiDecoder(model, tokenizer)")
    check_flag("exact", exact)
    check_flag("compile", compile)
    if compile and not exact:
        raise InvalidArgument("compile=True needs exact=True (the compiled step runs on the exact kernels)",
                              "drop compile=True, or keep exact=True")
    if precision is not None and dtype is not None and parse_precision(precision) != parse_precision(dtype):
        raise InvalidArgument(f"precision={precision!r} and dtype={dtype!r} ask for two precisions",
                              "give precision= alone (dtype is its older name)")
    loaded = load_model(model, precision_name=precision if precision is not None else dtype, device=device,
                        exact=exact)  # (precision="" is no precision: refused, not auto)
    if compile:
        compile_forward(loaded.model)
    return MultiDecoder(loaded.model, loaded.tokenizer, exact=exact, loaded=loaded)


def memory_report(model, loaded: Loaded | None = None) -> dict:
    """See `MultiDecoder.memory`."""
    dtype = activation_dtype(model)
    formats = dict(Counter((loaded.formats if loaded else {}).values()))
    file_bytes = loaded.file_tensor_bytes if loaded else None
    return {"precision": loaded.precision.name if loaded else str(dtype).removeprefix("torch."),
            "reason": loaded.precision.reason if loaded else "",
            "weights_bytes": packed_bytes(model), "file_tensor_bytes": file_bytes,
            "kv_bytes_per_token": Footprint.of(model).kv_per_slot, "available_bytes": available_bytes(model.device),
            "formats": formats}


# ---------------------------------------------------------------------- token level, any model
def start_forest(model, prefix_ids: Sequence[int], suffixes: Sequence[Sequence[int]], *,
                 compaction: CompactionPolicy | None = None, engine: Engine | None = None,
                 apart: bool | None = None, cost: CostCurve | LearnedCurve | None = None, **settings) -> BranchRun:
    """`start` on a new scheduler for `model` (see `new_scheduler`)."""
    refuse_unknown(settings)
    scheduler = new_scheduler(model, engine=engine, compaction=compaction, apart=apart, cost=cost)
    return start(scheduler, prefix_ids, suffixes, **settings)


FOREST_SETTINGS = ("compaction", "engine", "apart", "cost", *ADMIT_SETTINGS)
"""The settings `start_forest` takes by name (`stream_decode`: these and the sampling settings)."""


def refuse_unknown(settings: dict, also: Sequence[str] = ()) -> None:
    """Refuse a setting that is neither one of `FOREST_SETTINGS` nor of `also` (a typo)."""
    unknown = sorted(set(settings) - set(FOREST_SETTINGS) - set(also))
    if unknown:
        raise InvalidArgument(f"unknown setting(s): {', '.join(unknown)}", f"use {', '.join((*also, *FOREST_SETTINGS))}")


def stream_decode(
    model, prefix_ids: Sequence[int], branch_ids: Sequence[Sequence[int]], *, exact: bool = True, **settings
) -> Iterator[TokenEvent]:
    """Yield events while decoding every branch `prefix_ids + branch_ids[i]` in one forest.

    exact: run on the exact kernels (`exact.exact_kernels`): the model's linear layers and
    attention are swapped for them while the events come, and put back when the stream ends or
    is closed; a model that cannot run on them is refused (`NotBitExact`) before any token.
    False: the model's own kernels, exact to the token in float32, not the bit. An `engine=`
    given in the settings runs on the kernels the model had when it was built. The sampling
    settings are `decode`'s (greedy where none is given), or `sampling=`, a `SamplingParams` per
    branch."""
    check_flag("exact", exact)
    refuse_unknown(settings, SAMPLING_KEYS)
    if isinstance(branch_ids, Iterator):  # a generator is read once, here: its length is the branch count
        branch_ids = list(branch_ids)
    if "sampling" in settings and (both := [key for key in SAMPLING_KEYS if key in settings]):
        raise InvalidArgument(f"sampling= and {', '.join(both)} were both given", "give the settings one way: "
                              "sampling= (a SamplingParams per branch), or the settings by name")
    if "sampling" not in settings:
        asked = {key: settings.pop(key) for key in SAMPLING_KEYS if key in settings}
        settings["sampling"] = per_branch_sampling(len(branch_ids), asked)
    check_is_model(model)
    check_has_weights(model)
    given_engine = settings.get("engine") is not None  # an engine built earlier keeps the kernels it found
    release = hold_exact_kernels(model) if exact and not given_engine else None  # it checks the model first
    if release is None:
        check_supported(model)
    try:
        run = start_forest(model, prefix_ids, branch_ids, **settings)
    except BaseException:
        if release is not None:
            release()
        raise
    return run.events if release is None else _Releasing(run.events, release)


class _Releasing(Iterator[TokenEvent]):
    """`events`, then the stream's hold on the exact kernels released: when they end or raise,
    when the stream is closed or dropped, started or not (a generator never started runs no
    `finally`). The model is put back once no other stream or thread holds them."""

    def __init__(self, events: Iterator[TokenEvent], release: Callable[[], None]) -> None:
        self._events, self._release = events, release

    def __next__(self) -> TokenEvent:
        try:
            return next(self._events)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            getattr(self._events, "close", lambda: None)()
        finally:
            self._release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the lock or the model may be gone
            self._release()


def decode(
    model,
    prefix_ids: Sequence[int],
    branch_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: dict[int, float] | Sequence[dict[int, float] | None] | None = None,
    seed: int | None = None,
    speculate=None,
    cost: CostCurve | LearnedCurve | None = None,
    exact: bool = True,
    tokenizer=None,
    constraint: Constraint | Sequence[Constraint | None] | None = None,
) -> list[list[int]]:
    """Generate from `prefix_ids + branch_ids[i]` for every i at once; returns each branch's new ids.

    It samples where do_sample=True or a sampling setting is given (a temperature other than 0,
    top_k, top_p, min_p or a seed), as `stream_decode` and `MultiDecoder.generate` read them;
    do_sample=False decodes greedily whatever else is given, as `generate` does.
    Greedy output equals per-branch `model.generate(..., do_sample=False)`,
    eos included, for a generation config that adds no logits processors of its own
    (`repetition_penalty`, `no_repeat_ngram_size`, `bad_words_ids`, ...): settings are never read
    from the model's generation config, only its eos ids. With sampling and a seed, branch i draws
    from its own generator seeded `seed + i`, so it does not depend on the other branches.
    repetition_penalty (transformers'), presence_penalty and frequency_penalty (OpenAI's, over the
    generated tokens) and logit_bias ({token id: bias}) apply to greedy branches too, in the order
    of `sampling`'s module notes; each setting takes one value, or a list of one per branch.
    speculate: None, "lookup", "auto", a `Proposer` or a `Speculation` (see `speculation`); it
    never changes the output. cost: the cost curve for "auto" (default: learned, kept on disk).
    exact: on the exact kernels while it runs (see `stream_decode`; the model is put back after):
    each branch then gets the bits it gets alone, at every precision, and speculation is exact in
    every dtype. Compare with `generate` through the same kernels: `with exact_kernels(model):`.
    constraint: a `Constraint` every branch follows, or a list of one per branch, with the
    model's `tokenizer` (a Hugging Face fast tokenizer) to compile it for; output then equals
    the plain loop that masks each step's logits by the grammar.
    """
    sampling = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty, logit_bias=logit_bias, seed=seed)
    sampling = {key: value for key, value in sampling.items() if value is not None}  # only what was given
    branch_ids = list(branch_ids) if isinstance(branch_ids, Iterator) else branch_ids  # counted, then read
    out: list[list[int]] = [[] for _ in branch_ids]
    for event in stream_decode(model, prefix_ids, branch_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                               speculate=speculate, cost=cost, exact=exact, tokenizer=tokenizer, constraint=constraint,
                               **sampling):
        out[event.branch].append(event.token_id)
    return out


