"""Benchmark: speculative decoding of one sequence, greedy: transformers' prompt lookup and assisted
generation against every proposer of ours (docs/benchmarks.md, `bench speculate`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import data
from ..cost import CostCurve, LearnedCurve, cost_curve, measure_cost, quick_curve
from ..engine import time_forwards
from ..errors import InvalidArgument, MultiDecodeError, check_known
from ..proposers.draft import DraftModel
from ..proposers.lookahead import Lookahead
from ..proposers.self_draft import choose_skip, decoder_layers
from ..proposers.suffix import SuffixStore
from ..speculation import LEARNED, PROPOSER_MODES, SpeculationSettings, learned_kind
from ..strategies.complete import prompt_ids
from .common import ForwardCounter, RunOutput, Setup, auto_over, fresh, hf_sequential, suffix_over, trim_at_eos
from .harness import Benchmark, Case, Method, Plot, Runner, Target, runs

GREEDY, LOOKUP_3, LOOKUP_10 = "hf_greedy", "hf_lookup_3", "hf_lookup_10"
ASSISTED = "hf_assisted_self"
OURS_PLAIN, OURS_LOOKUP, OURS_AUTO = "multidecode_plain", "multidecode_lookup", "multidecode_auto"
OURS_LOOKAHEAD, OURS_LOOKAHEAD_FIT = "multidecode_lookahead", "multidecode_lookahead_fit"
OURS_SUFFIX, OURS_DRAFT = "multidecode_suffix", "multidecode_draft"
OURS_SUFFIX_2ND, OURS_AUTO_2ND = "multidecode_suffix_2nd", "multidecode_auto_2nd"
OURS_AUTO_TOKENS = "multidecode_auto_tokens"
OURS_AUTO_MEASURED, OURS_AUTO_QUICK = "multidecode_auto_measured", "multidecode_auto_quick"
COST_METHODS = (OURS_AUTO_MEASURED, OURS_AUTO_QUICK)
"""auto on other cost curves (`compare_cost`): on a full measurement, and from a fresh probe learning as it runs."""
LEARNED_METHODS = {name: f"multidecode_{name}" for name in LEARNED}
"""A learned head's kind -> its method, measured where the model has such a head."""
HF_METHODS = {GREEDY: 0, LOOKUP_3: 3, LOOKUP_10: 10}
"""transformers' prompt-lookup methods -> prompt_lookup_num_tokens (0: plain greedy)."""
LABELS = {
    GREEDY: ("HF generate, greedy", "HF greedy"),
    LOOKUP_3: ("HF generate(prompt_lookup_num_tokens=3)", "HF lookup 3"),
    LOOKUP_10: ("HF generate(prompt_lookup_num_tokens=10)", "HF lookup 10"),
    ASSISTED: ("HF generate(assistant_model=self-draft)", "HF assisted"),
    OURS_PLAIN: ("MultiDecode generate(speculate=None)", "MD plain"),
    OURS_LOOKUP: ("MultiDecode generate(speculate='lookup')", "MD lookup"),
    OURS_AUTO: ("MultiDecode generate(speculate='auto'), first pass", "MD auto"),
    OURS_LOOKAHEAD: ("MultiDecode lookahead N=5, W=G=7", "MD lookahead"),
    OURS_LOOKAHEAD_FIT: ("MultiDecode lookahead sized by the cost curve", "MD lookahead fit"),
    OURS_SUFFIX: ("MultiDecode suffix, first pass", "MD suffix"),
    OURS_DRAFT: ("MultiDecode draft model = self-draft", "MD draft"),
    OURS_SUFFIX_2ND: ("MultiDecode suffix, second pass", "MD suffix 2nd"),
    OURS_AUTO_2ND: ("MultiDecode auto, second pass", "MD auto 2nd"),
    OURS_AUTO_TOKENS: ("MultiDecode auto without the learned heads, first pass", "MD auto tokens"),
    OURS_AUTO_MEASURED: ("MultiDecode auto on a full measurement of the cost curve", "MD auto measured"),
    OURS_AUTO_QUICK: ("MultiDecode auto from a fresh probe of the cost curve, learning as it runs", "MD auto quick"),
    **{method: (f"MultiDecode speculate={name!r} ({PROPOSER_MODES[name].summary})", f"MD {name}")
       for name, method in LEARNED_METHODS.items()},
}
LOOKAHEAD_FLOOR = 0.95
"""lade's best against plain greedy on these workloads here (0.51-0.95x), held on every workload."""
TARGETS = {OURS_SUFFIX_2ND: 2.0}
LEARNED_TARGETS = {"story": 1.5, "summary": 1.5}
"""Each learned head over plain greedy on open-ended text; auto with the heads >= `NO_WORSE` of auto without."""
NO_WORSE = 0.97
FLOOR = 0.97
"""`auto` must never be slower than this fraction of plain greedy, on any workload."""


@dataclass(frozen=True)
class Workload:
    """One shipped workload: `prompt` with `{document}` replaced by the data file `document`."""

    name: str
    label: str
    prompt: str
    document: str | None
    max_new_tokens: int
    target: float

    def text(self) -> str:
        return self.prompt.replace("{document}", data.text(self.document).strip() if self.document else "")


def workloads() -> list[Workload]:
    lines = data.text("speculate_workloads.jsonl").splitlines()
    return [Workload(**json.loads(line)) for line in lines if line.strip()]


def choose(names: Sequence[str] | None) -> list[Workload]:
    """The shipped workloads named (all for None), in file order; unknown names or none are refused."""
    shipped = workloads()
    check_known(names or (), [w.name for w in shipped], "workload(s)")
    chosen = [w for w in shipped if names is None or w.name in names]
    if not chosen:
        raise InvalidArgument("no workload chosen", f"name one or more of {', '.join(w.name for w in shipped)}")
    return chosen


def draft_counts(counter: ForwardCounter, prompt_tokens: int, new_tokens: int) -> dict:
    """Drafted and accepted tokens of one transformers run, from its forward calls' input shapes."""
    drafted = counter.tokens_fed - prompt_tokens - (counter.forward_passes - 1)
    accepted = new_tokens - counter.forward_passes
    return {"drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None}


def hf_generate(model, prompt: Sequence[int], counter: ForwardCounter, *, lookup: int = 0, assistant=None,
                **settings) -> RunOutput:
    """transformers' `generate` on one prompt, with prompt lookup of `lookup` tokens (0: none) or
    `assistant` drafting (the target's forwards counted)."""
    lookup = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    out = hf_sequential(model, [prompt], counter, assistant=assistant, **lookup, **settings)
    out.extra.update(draft_counts(counter, len(prompt), len(out.answers[0])))
    return out


def multidecode_generate(decoder, prompt: Sequence[int], counter: ForwardCounter, *, speculate,
                         max_new_tokens: int, eos_ids) -> RunOutput:
    """`MultiDecoder.generate` with `speculate` (or a function making a fresh one per run), its own counts."""
    speculate = decoder.speculation(fresh(speculate))
    counter.prefill(1)
    completion = decoder.generate(list(prompt), max_new_tokens=max_new_tokens, speculate=speculate,
                                  eos_token_id=list(eos_ids))
    stats = {k: v for k, v in dict(completion.stats).items()
             if isinstance(v, (int, float, str, bool, list, dict, type(None)))}
    proposer = getattr(speculate, "proposer", speculate)
    if isinstance(proposer, DraftModel):
        stats["draft_forwards"] = proposer.engine.stats.forward_passes
    return RunOutput([trim_at_eos(completion.token_ids, eos_ids)], int(stats.get("peak_cache_bytes") or 0),
                     forward_passes=stats.get("forward_passes"), extra=stats)


def speculate_benchmark(decoder, *, names: Sequence[str] | None = None, repeats: int = 3, budget_s: float = 90.0,
                        warmup: bool = True, max_new_tokens: int | None = None,
                        compare_cost: bool = False) -> Benchmark:
    """The speculation benchmark as data: the workloads `names` (default: all); max_new_tokens overrides
    theirs; compare_cost: auto on other cost curves too (`COST_METHODS`)."""
    chosen, setup = choose(names), Setup.of(decoder)
    draft, fitted, draft_config = _drafts(decoder)  # draft None: the model has no self-draft
    heads = decoder.learned_heads()  # the learned heads trained for the model, if any
    ours = _our_speculations(decoder, chosen, max_new_tokens, draft, fitted, heads)
    curves, cost_config = _cost_curves(decoder) if compare_cost else ({}, {})
    assisted = (ASSISTED,) if draft is not None else ()
    measured = {*HF_METHODS, *assisted, *ours, *curves}

    def methods(prompt: list[int], new: int) -> tuple[Method, ...]:
        def hf(**how) -> Runner:
            return setup.baseline(hf_generate, prompt, new, **how)

        def md(speculate) -> Runner:
            return lambda c: multidecode_generate(decoder, prompt, c, speculate=speculate, max_new_tokens=new,
                                                  eos_ids=setup.eos_ids)

        def on(curve_for) -> Runner:
            return lambda c: on_curve(decoder, curve_for, c, lambda: md(ours[OURS_AUTO])(c))

        return (*(Method.named(LABELS, name, run=hf(lookup=n)) for name, n in HF_METHODS.items()),
                *(Method.named(LABELS, name, run=hf(assistant=decoder.draft_for(draft))) for name in assisted),
                *(Method.named(LABELS, name, run=md(speculate)) for name, speculate in ours.items()),
                *(Method.named(LABELS, name, run=on(curve_for)) for name, curve_for in curves.items()))

    def case(w: Workload) -> Case:
        prompt, new = prompt_ids(setup.tokenizer, w.text()), max_new_tokens or w.max_new_tokens
        return Case({"workload": w.name}, methods(prompt, new), budget_s=budget_s,
                    targets=_targets(w, [learned_kind(h) for h in heads], compare_cost=compare_cost),
                    report=lambda got: {"label": w.label, "prompt_tokens": len(prompt), "max_new_tokens": new,
                                        "output": setup.text(got[GREEDY].answers[0])})

    shortest = prompt_ids(setup.tokenizer, min((w.text() for w in workloads()), key=len))
    return Benchmark(
        name="speculate", title="speculative decoding of one sequence, greedy", model=setup.model,
        cases=tuple(case(w) for w in chosen), reference=GREEDY,
        pairs=tuple((name, GREEDY) for name in LABELS if name != GREEDY and name in measured)
        + (((OURS_AUTO, OURS_AUTO_TOKENS),) if heads else ())
        + tuple((name, OURS_AUTO_MEASURED) for name in (OURS_AUTO, OURS_AUTO_QUICK) if curves),
        config={"workloads": [w.name for w in chosen], "decoding": "greedy", "eos_ids": setup.eos_ids,
                "pad_id": setup.pad_id, "auto_floor": FLOOR, **draft_config, "lookahead_fit": repr(fitted),
                "learned_heads": {learned_kind(h): getattr(h, "config", {}).get("training", {}) for h in heads},
                **cost_config},
        warmup=methods(shortest, 4) if warmup else (), repeats=repeats,
        columns=("wall_s", "forward_passes", "tokens_per_forward", "acceptance", "tokens_per_s"),
        plot=Plot("bars", figures=("wall_s", "forward_passes", "tokens_per_forward", "acceptance")),
        rows_key="workloads",
    )


run_speculate_benchmark = runs(speculate_benchmark)


def on_curve(decoder, curve_for: Callable[[], CostCurve | LearnedCurve], counter: ForwardCounter,
             run: Callable[[], RunOutput]) -> RunOutput:
    """`run()` on the cost curve `curve_for()` makes (untimed and uncounted: its seconds in `curve_s`), put
    back after; a learned curve learns from the run's forwards."""
    calls, started = len(counter.calls), time.perf_counter()
    curve = curve_for()
    made_s = time.perf_counter() - started
    del counter.calls[calls:]
    learns = isinstance(curve, LearnedCurve)
    before, previous = decoder.cost, time_forwards(decoder.model, curve.record) if learns else None
    decoder.cost = curve
    try:
        started = time.perf_counter()
        out = run()
        out.seconds = time.perf_counter() - started
    finally:
        decoder.cost = before
        if learns:
            time_forwards(decoder.model, previous)
    out.extra["curve_s"] = round(made_s, 3)
    return out


def _cost_curves(decoder) -> tuple[dict[str, Callable[[], CostCurve | LearnedCurve]], dict]:
    """`COST_METHODS` -> what makes each one's curve for a run (the full measurement once, here; the
    quick one afresh each run), and the config's figures. The full measurement's forwards do not
    teach the curve auto learns: the two stay apart."""
    started, previous = time.perf_counter(), time_forwards(decoder.model, None)
    try:
        full = measure_cost(decoder.model)
    finally:
        time_forwards(decoder.model, previous)
    config = {"full_measurement_s": round(time.perf_counter() - started, 2)}
    return {OURS_AUTO_MEASURED: lambda: full, OURS_AUTO_QUICK: lambda: quick_curve(decoder.model)}, config


def _drafts(decoder) -> tuple[SpeculationSettings | None, Lookahead, dict]:
    """The self-draft's settings (a quarter of the layers skipped at least: a draft that is the target
    itself would say nothing; None where the model cannot be self-drafted, a GGUF of mixed layer
    formats), the lookahead the cost curve fits, and the config's figures."""
    model, tokenizer = decoder.model, decoder.tokenizer
    fitted = Lookahead.from_cost(cost_curve(model))
    try:
        skip = choose_skip(model, [tokenizer(data.self_draft_sample())["input_ids"]],
                           min_skip=max(1, len(decoder_layers(model)[1]) // 4))
    except MultiDecodeError as err:
        return None, fitted, {"self_draft_skips": None, "self_draft": f"no self-draft: {err.message}"}
    return (SpeculationSettings.parse("draft", skip_layers=skip.layers), fitted,
            {"self_draft_skips": skip.layers, "self_draft_agreement": round(skip.agreement, 4)})


def _our_speculations(decoder, chosen: list[Workload], max_new_tokens: int | None, draft: SpeculationSettings,
                      fitted: Lookahead, heads) -> dict:
    """MultiDecode's methods -> `speculate=` (a function: a fresh store per run); the second passes draft
    from a store that saw every chosen workload once; with learned `heads`, auto uses them too."""
    seen = SuffixStore()
    for w in chosen:
        decoder.generate(prompt_ids(decoder.tokenizer, w.text()), max_new_tokens=max_new_tokens or w.max_new_tokens,
                         speculate=suffix_over(seen), eos_token_id=sorted(decoder.eos_ids))
    learned = {LEARNED_METHODS[learned_kind(h)]: SpeculationSettings.parse(learned_kind(h)) for h in heads}
    if heads:
        learned[OURS_AUTO_TOKENS] = auto_over
    return {
        OURS_PLAIN: None,
        OURS_LOOKUP: SpeculationSettings.parse("lookup"),
        OURS_AUTO: lambda: auto_over(heads=heads),
        OURS_LOOKAHEAD: SpeculationSettings.parse("lookahead", lookahead=(7, 5, 7)),
        OURS_LOOKAHEAD_FIT: SpeculationSettings.parse("lookahead", lookahead=(fitted.window, fitted.ngram,
                                                                              fitted.guesses)),
        OURS_SUFFIX: suffix_over,
        **({OURS_DRAFT: draft} if draft is not None else {}),
        OURS_SUFFIX_2ND: lambda: suffix_over(seen),
        OURS_AUTO_2ND: lambda: auto_over(seen, heads),
        **learned,
    }


def _targets(w: Workload, kinds: Sequence[str] = (), *, compare_cost: bool = False) -> tuple[Target, ...]:
    """auto at the workload's target and never below `FLOOR`, lookahead's, the second passes', the learned
    heads' (`kinds`) and, with compare_cost, auto's on other curves."""
    def over_greedy(name: str, what: str, value: float) -> Target:
        return Target(f"{w.name}: {what}", (f"{name}_vs", GREEDY, "speedup"), ">=", value)

    targets = [over_greedy(OURS_AUTO, "auto over plain greedy", w.target)]
    if w.target > FLOOR:
        targets.append(over_greedy(OURS_AUTO, f"auto never below {FLOOR}x", FLOOR))
    targets.append(over_greedy(OURS_LOOKAHEAD, f"lookahead at least lade's best ({LOOKAHEAD_FLOOR}x)",
                               LOOKAHEAD_FLOOR))
    if w.name == "code_edit":
        targets.append(over_greedy(OURS_LOOKAHEAD, "lookahead over plain greedy", 1.3))
    targets += [over_greedy(name, f"{LABELS[name][1]} over plain greedy", value) for name, value in TARGETS.items()]
    targets.append(over_greedy(OURS_AUTO_2ND, "auto 2nd pass over plain greedy", FLOOR))
    for kind in kinds if w.name in LEARNED_TARGETS else ():
        targets.append(over_greedy(LEARNED_METHODS[kind], f"{kind} over plain greedy", LEARNED_TARGETS[w.name]))
    if kinds:
        targets.append(Target(f"{w.name}: auto with the heads no worse than without",
                              (f"{OURS_AUTO}_vs", OURS_AUTO_TOKENS, "speedup"), ">=", NO_WORSE))
    for name in (OURS_AUTO, OURS_AUTO_QUICK) if compare_cost else ():
        targets.append(Target(f"{w.name}: {LABELS[name][1]} no worse than on a full measurement",
                              (f"{name}_vs", OURS_AUTO_MEASURED, "speedup"), ">=", NO_WORSE))
    return tuple(targets)
