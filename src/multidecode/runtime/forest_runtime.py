"""The forest runtime: one engine thread, one forest, work admitted and retired between steps.

This is the continuous-batching runtime that `multidecode serve` and the batch job both drive.
`ForestRuntime` owns one `Scheduler` (one engine, one KV cache) and a thread that loops:

1. take cancellations (a client that went away: its work is retired, its slots freed before the
   next feed; or every job at once, each told why: `cancel_all`, a server past its drain deadline)
   and new jobs (`jobs.Job`);
2. **admit** waiting jobs between steps (continuous batching). A job's prompts are split into
   their common prefix and the rest; the longest part of the prefix already cached is looked up
   in the `PrefixIndex` and not fed again: the job's prompt hangs under that node. When a waiting
   job shares at least `defer_tokens` uncached prefix tokens with a job admitted in the same
   round, it waits one step and then hits the cache. An idle engine may first wait for more jobs
   (`Limits.gather`), so that jobs sent together start together;
3. **pace prefill**: jobs decoding are streams; a prompt is fed beside them in pieces within a
   per-step token budget that adapts to what steps cost here (`pacing.PrefillPacer`): a prompt
   whose rest fits the larger finish budget goes whole, the others in pieces, first admitted
   first. Each piece is indexed as soon as it is fed, so
   the cache offers a prompt only as far as it is fed, and a waiting job that shares more than
   that with a prompt still being fed waits for it as it would for one admitted in its round;
4. run one `Scheduler.step` (every running job's branches in one forward), hand each job its
   tokens, index the prompts just fed, retire finished jobs;
5. keep the prefix cache within its budget: prompt nodes belong to the cache owner, not to a
   job, so they outlive it; least recently used prefixes are forgotten, and the cache owner's
   slots that no indexed prefix and no running job needs are compacted away.

Admission is counted when a job is submitted (`admission.Admission`, within `jobs.Limits`): a
driver that cannot take a refusal (the batch job, a Ray worker) submits with `wait=True`, or
`offer`s a job and tries again once one of its jobs ends. A trace (for a job that asks for
one) lists the nodes the job fed in a step as [node, parent, token text, kind], kind being
"prompt", "kept" (a token the model chose), "accepted" (a draft token it confirmed) or
"rejected" (a draft token taken back), with the cached prefix's size and each branch's last node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from ..branches import BranchRun, admit
from ..errors import MultiDecodeError
from ..forest import ROOT
from ..memory import budget_bytes
from ..prompts import share_prefix
from ..scheduler import CompactionPolicy, Scheduler, StepTrace, new_scheduler
from ..speculation import build_speculation
from ..stopping import eos_ids_of, node_texts
from ..strategies.beam import BeamWork, check_settings
from .admission import Admission
from .jobs import Counters, Job, Limits, Overloaded, Reservation, TooLarge, Usage
from .pacing import PacedStep, PrefillPacer
from .radix import PrefixIndex

log = logging.getLogger("multidecode.runtime")

CACHE_OWNER = "prefix-cache"
"""The forest owner of every prompt node: the prefix cache, not the request that fed it."""


RENUMBER_FACTOR = 4
MIN_RENUMBER = 1024
"""When idle, the forest is renumbered once it holds RENUMBER_FACTOR times more nodes than slots
(and at least RENUMBER_FACTOR x MIN_RENUMBER nodes)."""


class ForestRuntime:
    """One model, one forest, one engine thread; jobs come and go between steps.

    model, tokenizer: a transformers causal LM (eager or sdpa) and its tokenizer.
    limits: see `Limits`. compaction, cost: see `Scheduler`. draft: the draft model of jobs that
    speculate with "draft" (see `speculation.build_speculation`).
    """

    def __init__(self, model, tokenizer, *, limits: Limits | None = None,
                 compaction: CompactionPolicy | None = None, cost=None, draft=None) -> None:
        self.model, self.tokenizer, self.draft = model, tokenizer, draft
        self.limits = limits or Limits()
        self.scheduler: Scheduler = new_scheduler(model, compaction=compaction, cost=cost, observer=self._observe)
        self.engine = self.scheduler.engine
        self.index = PrefixIndex()
        self.pacer = PrefillPacer(self.limits.prefill_chunk, self.limits.prefill_stretch)
        self.eos = eos_ids_of(model, None)
        self.counters = Counters()
        self.draining = False
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._cancelled: list[Job] = []
        self._ending: Exception | None = None  # set by cancel_all, taken by the engine thread
        self._running: dict[str, Job] = {}
        self.budget_bytes = self.limits.max_live_bytes or budget_bytes(self.engine.device)
        self.admission = Admission(self.limits, self.budget_bytes)  # jobs submitted and not finished
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the client side (any thread)
    def start(self) -> ForestRuntime:
        self._thread = threading.Thread(target=self._loop, name="multidecode-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, job: Job, *, wait: bool = False) -> Job:
        """Queue a job. Raises `TooLarge` for a job that could never fit, `Overloaded` while
        shutting down, and past the admission limits `Overloaded` too, or with wait=True waits
        until jobs that end make room."""
        refusal = self._queue(job, wait=wait)
        if refusal is not None:
            self.counters.rejected += 1
            raise refusal
        return job

    def offer(self, job: Job) -> bool:
        """Queue a job if it fits now; False (nothing queued) if it must wait for jobs in flight to
        end. Raises as `submit` does for a job that could never fit, or while shutting down."""
        refusal = self._queue(job, wait=False)
        if refusal is not None and refusal.draining:
            raise refusal
        return refusal is None

    def _queue(self, job: Job, *, wait: bool) -> Overloaded | None:
        """Reserve and queue `job` if admission lets it start (with wait, once it does); else why not."""
        job.reservation = need = self.reservation(job)
        with self._cond:
            while True:
                refusal = self.admission.refusal(need)
                if isinstance(refusal, TooLarge):
                    raise refusal
                if self.draining or self._stopping:
                    return Overloaded.shutting_down()
                if refusal is None:
                    break
                if not wait:
                    return refusal
                self._cond.wait()
            self.admission.hold(need)
            self._waiting.append(job)
            self._cond.notify_all()
        return None

    def reservation(self, job: Job) -> Reservation:
        """What a job will hold from its submission to its end (see `Admission`)."""
        return Reservation(job.reserved_tokens, job.branches, self.job_bytes(job))

    def job_bytes(self, job: Job) -> int:
        """The bytes a job will hold (see `memory`), its prompts counted whole (a shared prefix
        or a cached one needs less: this errs on the safe side). A forward's scratch is not a
        job's: the forest runs one forward at a time, for every job, cut to `memory.forward_bytes`."""
        draft = getattr(job.speculate, "size", None) or 0
        need = self.engine.footprint.group_bytes(
            slots_before=0, prompt_slots=sum(map(len, job.prompts)), branches=job.branches,
            branch_slots=job.max_new_tokens + draft, rows_per_branch=1 + draft)
        return need.total - need.scratch

    def cancel(self, job: Job) -> None:
        """Stop a job (its client went away): its branches are pruned at the next step."""
        with self._cond:
            if not job.cancelled:
                job.cancelled = True
                self._cancelled.append(job)
                self._cond.notify_all()

    def cancel_all(self, error: Exception) -> None:
        """End every job in flight (waiting or decoding) with `error` as its last message, on the
        engine thread at its next round, as `cancel` ends one: a server past its drain deadline
        does this so that no stream keeps the process alive while it decodes to its end. Unlike a
        cancelled job's client, these clients are still there, so each is sent the error (a stream
        its error event, a plain request its status). A job submitted after the engine thread has
        taken the call runs as usual: drain first to refuse those."""
        with self._cond:
            self._ending = error
            self._cond.notify_all()

    def drain(self) -> None:
        """Refuse new jobs from now on; running ones go on."""
        with self._cond:
            self.draining = True
            self._cond.notify_all()  # an engine gathering jobs starts on those it has; waiting submitters give up

    @property
    def busy(self) -> int:
        """Jobs submitted and not finished (waiting, being admitted or decoding)."""
        with self._cond:
            return self.admission.jobs

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        deferred: list[Job] = []
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._cancelled or self._running or self._ending):
                    self._cond.wait()
                if self._waiting and not (self._running or deferred):
                    self._gather()
                if self._stopping:
                    return
                cancelled, self._cancelled = self._cancelled, []
                ending, self._ending = self._ending, None
                waiting = list(self._waiting)
                self._waiting.clear()
            try:
                for job in cancelled:
                    self._cancel(job)
                if ending is not None:
                    self._fail_all(ending, waiting)
                    waiting = []
                deferred = self._admit([j for j in waiting if not j.cancelled])
                with self._cond:
                    self._waiting.extendleft(reversed(deferred))
                self._step()
            except Exception as error:  # a bug or a failed forward: fail what ran, keep serving
                log.exception("a step failed; its requests get an error")
                self._fail_all(error)
                self._settle_cache()

    def _gather(self) -> None:
        """(Under the lock, the engine idle.) Wait until `limits.gather` jobs wait, at most
        `limits.gather_s` seconds (see `Limits`)."""
        deadline = time.monotonic() + self.limits.gather_s
        while (len(self._waiting) < self.limits.gather and not (self._stopping or self.draining or self._ending)
               and (left := deadline - time.monotonic()) > 0):
            self._cond.wait(left)

    def _admit(self, jobs: list[Job]) -> list[Job]:
        """Admit jobs to the scheduler; returns those deferred to the next round."""
        if not jobs:
            return []
        fresh = PrefixIndex()  # prefixes still being fed or admitted this round, not yet all cached
        for job in self._running.values():
            if not job.beams and not job.work.started:
                prefix = cacheable_prefix(share_prefix(job.prompts))
                fresh.insert(prefix, list(range(len(prefix))))
        deferred = []
        for job in jobs:
            if self.limits.max_running is not None and len(self._running) >= self.limits.max_running:
                deferred.append(job)
                continue
            shared = share_prefix(job.prompts)
            prefix = cacheable_prefix(shared)
            matched, node = self.index.match(prefix) if not job.beams else (0, None)
            if fresh.match(prefix)[0] - matched >= self.limits.defer_tokens:
                deferred.append(job)
                continue
            fresh.insert(prefix, list(range(len(prefix))))
            try:
                job.work = self._work(job, shared, matched, ROOT if node is None else node)
            except Exception as error:  # a bad request (MultiDecodeError) or a bug: that job fails, not the round
                if not isinstance(error, MultiDecodeError):
                    log.exception("admitting request %s failed", job.id)
                self._finish(job, ("error", error))
                continue
            job.cached_tokens = matched
            self._running[job.id] = job
            self.counters.admitted += 1
            self.counters.prompt_tokens += job.prompt_tokens
            self.counters.cached_tokens += matched
        return deferred

    def _work(self, job: Job, shared, matched: int, under: int):
        if job.beams:
            check_settings(job.beams, job.max_new_tokens, 1.0, False, job.beams)
            return self.scheduler.admit(BeamWork(job.prompts[0], num_beams=job.beams, max_new_tokens=job.max_new_tokens,
                                                 length_penalty=1.0, early_stopping=False, eos=self.eos))
        run: BranchRun = admit(
            self.scheduler, shared.prefix_ids[matched:], shared.suffix_ids, max_new_tokens=job.max_new_tokens,
            sampling=job.sampling, tokenizer=self.tokenizer, stop=job.stop,
            speculate=build_speculation(job.speculate, self.engine.dtype, draft=self.draft, exact=self.engine.exact),
            under=under,
            cached=shared.prefix_ids[:matched], prompt_owner=CACHE_OWNER, logprobs=job.logprobs,
            constraint=job.constraint)
        return run.group

    def _step(self) -> None:
        if not self._running:
            self._settle_cache()
            return
        paced = self._pace_prompts()
        started = time.perf_counter()
        before, steps = self.engine.stats.forward_passes, self.scheduler.steps
        self.scheduler.step()
        seconds = time.perf_counter() - started
        self.pacer.record(replace(paced, seconds=seconds))
        forwards = self.engine.stats.forward_passes - before
        record = self.scheduler.history[-1] if self.scheduler.steps > steps else None
        branches = sum(_live_branches(job) for job in self._running.values())
        self.counters.count_step(forwards, record.rows if record else 0, branches, seconds)
        log.debug("step %d: %d requests, %d branches, %d rows (%d prompt tokens, budget %s) in %d forward(s), "
                  "%.1f ms, %d slots", self.counters.steps, len(self._running), branches, record.rows if record else 0,
                  paced.prompt_tokens, paced.budget, forwards, 1000 * seconds, self.engine.forest.num_slots)
        finished = False
        for job in list(self._running.values()):
            finished |= self._after_step(job)
        if finished:
            self._settle_cache()

    def _pace_prompts(self) -> PacedStep:
        """Share this step's prompt tokens (`pacing`) among the jobs still prefilling: first the
        prompts whose rest fits the finish budget, whole, then pieces of the others from what the
        budget has left, each first admitted first. Returns what the step will feed of prompts,
        beside how many streams. A beam search's prompt is fed whole in its first step, within
        the budget or not."""
        prefilling = [job for job in self._running.values() if not job.beams and not job.work.started]
        new_beams = [job for job in self._running.values() if job.beams and not job.steps]
        streams = len(self._running) - len(prefilling) - len(new_beams)
        budget = self.pacer.budget(streams, len(prefilling))
        fed = sum(len(job.prompts[0]) for job in new_beams)
        if budget is None:
            return PacedStep(streams, fed + sum(job.work.pace_prompt(None) for job in prefilling), budget)
        left = max(budget - fed, 0)
        finish_left = max(self.pacer.finish_budget(streams, len(prefilling)) - fed, 0)
        finishing = set()
        for job in prefilling:
            if job.work.prompt_left <= finish_left:
                finishing.add(job)
                finish_left -= job.work.prompt_left
        for job in sorted(prefilling, key=lambda job: job not in finishing):  # stable: each group in admission order
            taken = job.work.pace_prompt(job.work.prompt_left if job in finishing else left)
            fed += taken
            left = max(left - taken, 0)
        return PacedStep(streams, fed, budget)

    def _after_step(self, job: Job) -> bool:
        """Hand a job what its step gave (tokens, beams, its end); True when it finished."""
        work = job.work
        job.steps += 1
        if not job.beams:
            self._index_prompt(job)
            while work.events:
                event = work.events.popleft()
                self.counters.generated += 1
                self._send(job, ("token", event))
        if not work.done:
            return False
        if work.failure is not None:  # its own input ended it, alone (`scheduler.Work.failure`)
            self._finish(job, ("error", work.failure))
            return True
        if job.beams:
            beams = work.beams(self.engine, self.tokenizer, job.beams)
            self.counters.generated += sum(len(b.token_ids) for b in beams)
            self._send(job, ("beams", beams))
        self._finish(job, ("done", self._usage(job)))
        return True

    def _index_prompt(self, job: Job) -> None:
        """Index what a job's step fed of its prompt: a piece (the prompt as far as it is fed), or
        its last part (every prompt, whole)."""
        work, forest = job.work, self.engine.forest
        if work.prompt_piece:
            self.index.insert(forest.path_tokens(work.under), forest.path(work.under))
        elif work.started and not job.prefilled:
            job.prefilled = True
            for end in work.prompt_ends:
                self.index.insert(forest.path_tokens(end), forest.path(end))

    def _usage(self, job: Job) -> Usage:
        work = job.work
        if job.beams:
            generated = sum(len(b.token_ids) for b in work.beams(self.engine, None, job.beams))
            stats = {"steps": work.steps}
        else:
            generated = sum(len(b.output.token_ids) for b in work.branches)
            stats = work.stats.as_dict()
        return Usage(job.prompt_tokens, job.cached_tokens, generated, stats)

    def _send(self, job: Job, item: tuple) -> None:
        """Hand the job's sink an item; a sink that fails (its client's event loop is gone) ends
        the job as if the client had gone away, and never the engine thread."""
        if job.cancelled:
            return
        try:
            job.sink(item)
        except Exception:
            log.warning("request %s: its sink failed; cancelling it", job.id, exc_info=True)
            self.cancel(job)

    def _finish(self, job: Job, item: tuple) -> None:
        """End a job (once): its last message to the sink, its reservation released, its work retired."""
        if job.finished:
            return
        job.finished = True
        self._running.pop(job.id, None)
        if job.work is not None and job.work in self.scheduler.works:
            self.scheduler.retire(job.work)
        with self._cond:
            self.admission.release(job.reservation)
            self._cond.notify_all()  # a submitter waiting for room
        self._send(job, item)

    def _cancel(self, job: Job) -> None:
        if job.finished:  # its client left just as it ended: it was not cut off
            return
        self.counters.cancelled += 1
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
        self._finish(job, ("error", Overloaded("cancelled")))

    def _fail_all(self, error: Exception, waiting: Sequence[Job] = ()) -> None:
        """End every running job, and those of `waiting` (taken off the queue: `cancel_all`), with
        `error` as its last message."""
        for job in [*self._running.values(), *waiting]:
            self._finish(job, ("error", error))

    def _settle_cache(self) -> None:
        """Free retired jobs' slots, forget prefixes past the budget, and compact the cache
        owner's slots that neither an indexed prefix nor a running job needs."""
        self.scheduler.free_retired()
        self.index.evict(self.limits.prefix_cache_tokens)
        live = self.index.leaves() + [n for job in self._running.values() for n in job.work.live()]
        self.engine.compact(live, owner=CACHE_OWNER)
        forest = self.engine.forest
        if not self._running and len(forest) > RENUMBER_FACTOR * max(forest.num_slots, MIN_RENUMBER):
            # Idle, and the forest is mostly history (finished requests' nodes, compacted long
            # ago): start a fresh forest of what is cached, so a server never grows for ever.
            self.engine.forest, ids = forest.renumbered()
            self.index.renumber(ids)

    def _observe(self, trace: StepTrace) -> None:
        """Send traced jobs the nodes they fed this step (before rejected ones are taken back)."""
        traced = [job for job in self._running.values() if job.trace and not job.beams]
        if not traced:
            return
        forest = trace.forest
        rejected = set(trace.rejected)
        fed = set(trace.nodes)
        for job in traced:
            work = job.work
            mine = {n for n in trace.nodes if forest.owners[n] == work.owner}
            if not job.prefilled:  # the prompt nodes it fed belong to the cache: those on its prompts' paths
                ends = work.prompt_ends if work.started else [work.under] if work.prompt_piece else []
                mine |= {n for end in ends for n in forest.path(end)} & fed
            if not mine:
                continue  # its prompt waited for others' pieces
            ids = [n for n in trace.nodes if n in mine]
            nodes = [[n, forest.parents[n], text, _kind(n, forest, rejected, work)]
                     for n, text in zip(ids, node_texts(self.tokenizer, forest, ids))]
            heads = [b.leaf for b in work.branches] if work.started else []
            self._send(job, ("trace", {"step": trace.step, "cached_tokens": job.cached_tokens, "heads": heads,
                                       "nodes": nodes}))


def _kind(node: int, forest, rejected: set[int], work) -> str:
    """How the live page draws a node: a prompt token, a draft taken back, a draft accepted, or
    a token the model chose."""
    if node in rejected:
        return "rejected"
    if forest.owners[node] == CACHE_OWNER:
        return "prompt"
    return "accepted" if node in work.draft_nodes else "kept"


def _live_branches(job: Job) -> int:
    """The branches that got a token this step (none while a prompt is fed in pieces)."""
    if job.beams:
        return job.beams
    if not job.work.started:
        return 0
    return sum(not b.output.finished for b in job.work.branches)


def cacheable_prefix(shared) -> list[int]:
    """What the prefix cache may hold of a job's prompts (`prompts.SharedPrompts`): their shared
    prefix, short of the last token of the shortest (which is fed again for its logits)."""
    return shared.prefix_ids[: min(len(shared.prefix_ids), min(map(len, shared.prompt_ids)) - 1)]


__all__ = ["CACHE_OWNER", "ForestRuntime"]
