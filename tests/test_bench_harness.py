"""The declarative benchmark harness on a tiny random model: warm-up, rounds, parts measured once,
solo and skipped methods, identical answers, ratios, targets, the layout and the three files."""

from __future__ import annotations

import json

import pytest
from tiny_models import EOS, reference_generate, tiny_model

from multidecode.bench import AnswersDiffer
from multidecode.bench.common import hf_sequential
from multidecode.bench.harness import Benchmark, Case, Method, Part, Plot, Target, run
from multidecode.bench.results import markdown, rows_of, tables, write_results

MODEL = tiny_model("llama")
PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12, 13]]


def greedy(prompts, new: int = 4, calls: list | None = None, name: str = ""):
    """`generate` over `prompts` one by one, noting each run in `calls`."""
    def run_(counter):
        if calls is not None:
            calls.append(name)
        return hf_sequential(MODEL, prompts, counter, max_new_tokens=new, eos_ids=[EOS], pad_id=0)
    return run_


def toy(calls: list, *, ks=(1, 3), repeats: int = 2) -> Benchmark:
    def case(k: int) -> Case:
        return Case(
            {"k": k},
            (Method("one_by_one", "one prompt at a time", short="single",
                    parts=tuple(Part(i, greedy(PROMPTS[i:i + 1], calls=calls, name=f"part{i}")) for i in range(k))),
             Method("together", "all prompts in one run", short="together", run=greedy(PROMPTS[:k], calls=calls,
                                                                                       name="together")),
             Method("costly", "a costly method", run=greedy(PROMPTS[:k], calls=calls, name="costly"), solo=True),
             Method("future", "a method not built yet", run=greedy(PROMPTS[:k]), skip="not built yet")),
            budget_s=60.0, main=k == max(ks),
            targets=(Target("together over single", ("together_vs", "one_by_one", "speedup"), ">=", 0.0),
                     Target("a figure no row has", ("future_vs", "one_by_one", "speedup"), ">=", 1.0))
            if k == max(ks) else (),
            report=lambda got: {"measured": sorted(got)},
        )

    return Benchmark(
        name="toy", title="a toy benchmark", model=MODEL, cases=tuple(case(k) for k in ks), reference="one_by_one",
        pairs=(("together", "one_by_one"), ("costly", "one_by_one"), ("future", "one_by_one")), repeats=repeats,
        warmup=(Method("together", "warm", run=greedy(PROMPTS[:1], 1, calls, "warm")),),
        plot=Plot("sweep", figures=("wall_s", "forward_passes"), x="k"),
    )


def test_rounds_parts_solo_skip_and_layout(tmp_path):
    calls, messages = [], []
    result = run(toy(calls), progress=messages.append)
    # warm-up once; each part once although two cases name it; the others once per round, 2 rounds a case
    assert calls.count("warm") == 1
    assert [calls.count(f"part{i}") for i in range(3)] == [1, 1, 1]
    assert calls.count("together") == calls.count("costly") == 4
    assert [row["k"] for row in result["sweep"]] == [1, 3] and result["main"]["k"] == 3
    main = result["main"]
    assert list(main["methods"]) == ["one_by_one", "together", "costly"]
    assert main["skipped"] == {"future": "not built yet"} and main["measured"] == ["costly", "one_by_one", "together"]
    single = main["methods"]["one_by_one"]
    assert len(single["runs_s"]) == 3 and single["wall_s"] == pytest.approx(sum(single["runs_s"]))
    assert len(main["methods"]["together"]["runs_s"]) == 2
    assert main["answer_tokens"] == [len(trimmed(p)) for p in PROMPTS]
    assert set(main["together_vs"]["one_by_one"]) == {"speedup", "forward_passes_ratio", "tokens_per_s_ratio",
                                                      "kv_bytes_ratio"}
    assert "future_vs" not in main
    assert [t["name"] for t in result["targets"]] == ["together over single"] and result["targets"][0]["met"]
    assert result["answers_identical"] is True and result["config"]["reference"] == "one_by_one"
    assert result["labels"]["future"] == "a method not built yet"
    assert result["layout"]["short"]["one_by_one"] == "single"
    assert any(m.startswith("k=3 together") for m in messages)
    paths = write_results(result, tmp_path, stem="toy")
    assert [p.name for p in paths] == ["toy.json", "toy.png", "toy.md"]
    assert paths[1].stat().st_size > 10_000
    assert markdown(json.loads(paths[0].read_text())) == paths[2].read_text()
    titles = [t.title for t in tables(result)]
    assert titles == ["a toy benchmark (k = 3)", "a toy benchmark: sweep", "Targets"]
    assert "Not run: a method not built yet (not built yet)." in paths[2].read_text()


def trimmed(prompt):
    ids = reference_generate(MODEL, prompt, max_new_tokens=4)
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


def test_one_case_keeps_its_row_at_the_top_level(tmp_path):
    bench = toy([], ks=(2,), repeats=1)
    bars = Plot("bars", figures=("wall_s", "forward_passes"))
    bench = Benchmark(**{**bench.__dict__, "plot": bars, "rows_key": None})
    result = run(bench)
    assert "sweep" not in result and "main" not in result and rows_of(result) == [result]
    assert set(result["methods"]) == {"one_by_one", "together", "costly"}
    assert [t.title for t in tables(result)] == ["a toy benchmark (k = 2)", "Targets"]
    assert write_results(result, tmp_path)[1].read_bytes()[:4] == b"\x89PNG"


def test_a_method_that_differs_from_the_reference_is_refused():
    def off_by_one(counter):
        out = greedy(PROMPTS[:1])(counter)
        out.answers[0][0] += 1
        return out

    case = Case({"k": 1}, (Method("ref", "reference", run=greedy(PROMPTS[:1])), Method("bad", "bad", run=off_by_one)))
    with pytest.raises(AnswersDiffer, match="between ref and bad at token 0"):
        run(Benchmark(name="x", title="x", model=MODEL, cases=(case,), reference="ref", repeats=1))
    # without a reference (sampled outputs), methods are not compared with each other
    result = run(Benchmark(name="x", title="x", model=MODEL, cases=(case,), reference=None, repeats=1))
    assert "answers_identical" not in result


def test_a_method_whose_repeats_differ_is_refused():
    seen = []

    def drifting(counter):
        out = greedy(PROMPTS[:1])(counter)
        out.answers[0].append(len(seen))
        seen.append(1)
        return out

    case = Case({"k": 1}, (Method("drift", "drift", run=drifting),), budget_s=60.0)
    with pytest.raises(AnswersDiffer, match="repeat run"):
        run(Benchmark(name="x", title="x", model=MODEL, cases=(case,), reference=None, repeats=2))
