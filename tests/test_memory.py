"""Memory accounting (`multidecode.memory`): what a request needs is known before it runs, wide
forwards are cut to fit, too many completions run in waves, and what cannot fit is refused with a
message, never killed by the operating system.

Budgets are set small through MULTIDECODE_MEMORY so that a tiny model meets them.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from tiny_models import tiny_model

import multidecode
from multidecode import exact, memory
from multidecode.branches import memory_need
from multidecode.cli import main
from multidecode.engine import Engine
from multidecode.errors import InvalidArgument, NotEnoughMemory
from multidecode.memory import Footprint, parse_bytes
from multidecode.runtime.jobs import Job, Limits, Overloaded, TooLarge
from multidecode.strategies.complete import Waves, wave_size

PROMPT = [5, 17, 42, 99, 7, 3, 150, 23]


@pytest.fixture(scope="module")
def exact_decoder():
    """A tiny Llama on token ids with batch-invariant attention."""
    import copy

    model = copy.deepcopy(tiny_model("llama"))
    exact.use_exact_kernels(model)
    return multidecode.MultiDecoder(model, None)


def test_parse_bytes():
    assert parse_bytes("6GB") == 6 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5g") == 1_500_000_000
    assert parse_bytes("1000") == 1000
    for bad in ("lots", "6 parsecs", "", "-1GB"):
        with pytest.raises(InvalidArgument, match="not an amount of memory"):
            parse_bytes(bad)


def test_the_environment_caps_what_is_available(monkeypatch):
    monkeypatch.delenv(memory.ENVIRONMENT, raising=False)
    free = memory.available_bytes()
    assert free > 0
    monkeypatch.setenv(memory.ENVIRONMENT, "10MB")
    assert memory.available_bytes() == 10**7


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_kv_bytes_per_slot_is_what_the_cache_holds(arch):
    model = tiny_model(arch)
    engine = Engine(model)
    engine.feed_chain(PROMPT, logits=False)
    per_slot = engine.cache.layers[0].used_bytes * len(engine.cache.layers) // engine.cache.num_slots
    assert Footprint.of(model).kv_per_slot == per_slot


def test_visibility_rows_grow_with_the_square_of_the_width():
    engine = Engine(tiny_model("llama"))
    small = memory_need(engine, 30, [0] * 1000, 4, 0)
    large = memory_need(engine, 30, [0] * 10000, 4, 0)
    assert large.rows > 90 * small.rows
    assert 9 * small.kv < large.kv < 11 * small.kv


def test_a_wide_forest_forward_is_cut_and_gives_the_same_logits(exact_decoder, monkeypatch):
    """Cut into forwards of a few rows each (the budget shrunk), a step's logits are bit for bit
    those of one forward: the rows of one step see only their ancestors, and exact kernels do not
    depend on the rows beside them."""

    def step_logits() -> tuple[torch.Tensor, int]:
        engine = Engine(exact_decoder.model)
        last = engine.feed_chain(PROMPT, logits=False).nodes[-1]
        nodes = engine.feed(list(range(10, 40)), [last] * 30, logits_for=range(30)).nodes
        before = engine.stats.forward_passes
        logits = engine.feed(list(range(50, 80)), nodes, logits_for=range(30)).logits
        return logits, engine.stats.forward_passes - before

    whole, forwards = step_logits()
    assert forwards == 1
    small = Footprint.of(exact_decoder.model).per_kept_row * 7
    monkeypatch.setattr(memory, "FORWARD_BYTES", small)
    cut, forwards = step_logits()
    assert forwards >= 4
    assert torch.equal(whole, cut)


def test_a_long_prompt_is_read_in_pieces_under_a_budget(exact_decoder, monkeypatch):
    """MULTIDECODE_MEMORY capped the cache and the logits, but a prompt was read in one forward
    whatever its scratch (446 MB for a 3,500-token prompt under a 150 MB budget): a forward's
    scratch is now held to a share of the budget, the prompt read in pieces, with the same tokens,
    and a request counts its prompt's scratch, cut."""
    prompt = [(7 * i) % 250 + 1 for i in range(300)]
    monkeypatch.delenv(memory.ENVIRONMENT, raising=False)
    whole = exact_decoder.generate(prompt, max_new_tokens=4, speculate=None)
    footprint = Footprint.of(exact_decoder.model)
    row = 300 * footprint.per_row_slot + footprint.per_row + footprint.per_kept_row
    assert memory_need(exact_decoder.scheduler().engine, 300, [0], 4, 0).scratch >= 300 * row - 300 * footprint.per_kept_row
    budget = int(20 * row / (memory.HEADROOM * memory.SCRATCH_SHARE))  # about 20 rows a forward
    monkeypatch.setenv(memory.ENVIRONMENT, str(budget))
    assert 15 <= footprint.rows_per_forward(300) <= 25
    cut = exact_decoder.generate(prompt, max_new_tokens=4, speculate=None)
    assert cut.token_ids == whole.token_ids
    assert cut.stats["forward_passes"] >= whole.stats["forward_passes"] + 10
    assert memory_need(exact_decoder.scheduler().engine, 300, [0], 4, 0).scratch <= memory.forward_bytes() + row

def test_completions_run_in_waves_with_the_same_tokens(exact_decoder, monkeypatch):
    settings = dict(n=12, max_new_tokens=6, temperature=0.9, seed=7)
    monkeypatch.delenv(memory.ENVIRONMENT, raising=False)
    together = exact_decoder.complete(PROMPT, **settings)
    engine = exact_decoder.scheduler().engine
    budget = memory_need(engine, len(PROMPT), [0] * 5, 6, 0).total  # five branches fit, not six
    monkeypatch.setenv(memory.ENVIRONMENT, str(int(budget / memory.HEADROOM) + 1))
    assert wave_size(engine, len(PROMPT), 12, 6, 0) == 5
    run = multidecode.strategies.complete.start(exact_decoder.scheduler(), None, PROMPT, **settings)
    assert isinstance(run, Waves)
    events = list(run.events)
    assert len(run.runs) == 3
    assert sorted({e.branch for e in events}) == list(range(12))
    waves = exact_decoder.complete(PROMPT, **settings)
    assert [c.token_ids for c in waves] == [c.token_ids for c in together]
    assert [c.seed for c in waves] == list(range(7, 19))
    assert waves[0].stats["tokens"] == sum(len(c.token_ids) for c in waves)


def test_waves_hold_each_completion_to_its_own_constraint(model_dir, monkeypatch):
    """A list of one constraint per completion was handed whole to every wave, which refused it
    ("12 constraints for 6 branches"): each wave takes its completions' own."""
    from multidecode.strategies.complete import prompt_ids

    decoder = multidecode.load(str(model_dir), precision="float32")
    settings = dict(n=12, seed=1, max_new_tokens=8, regex=[r"(yes|no)", r"[0-9]{3}"] * 6)
    monkeypatch.delenv(memory.ENVIRONMENT, raising=False)
    together = decoder.complete("Answer:", **settings)
    need = memory_need(decoder.scheduler().engine, len(prompt_ids(decoder.tokenizer, "Answer:")), [0] * 6, 8, 0).total
    monkeypatch.setenv(memory.ENVIRONMENT, str(int(need / memory.HEADROOM) + 1))  # six at a time
    waves = decoder.complete("Answer:", **settings)
    assert [c.text for c in waves] == [c.text for c in together]
    assert all(c.text in ("yes", "no") for c in waves[::2]) and all(c.text.isdigit() for c in waves[1::2])

def test_later_waves_keep_the_budget_the_first_was_sized_by(exact_decoder, monkeypatch):
    """The memory a wave frees stays with the process (its allocator keeps it), so the machine's
    free memory reads lower after the first wave: the later waves must not be refused for it."""
    settings = dict(n=12, max_new_tokens=6, temperature=0.9, seed=7)
    monkeypatch.delenv(memory.ENVIRONMENT, raising=False)
    together = exact_decoder.complete(PROMPT, **settings)
    engine = exact_decoder.scheduler().engine
    budget = int(memory_need(engine, len(PROMPT), [0] * 5, 6, 0).total / memory.HEADROOM) + 1
    reads = iter([budget, budget])  # what the machine has: the sizing's and the first wave's reads

    def shrinking(device="cpu"):
        return next(reads, budget // 4)  # then a quarter: the first wave's memory still held

    monkeypatch.setattr(memory, "available_bytes", shrinking)
    waves = exact_decoder.complete(PROMPT, **settings)
    assert [c.token_ids for c in waves] == [c.token_ids for c in together]


def test_a_request_that_cannot_fit_is_refused_before_it_runs(exact_decoder, monkeypatch):
    monkeypatch.setenv(memory.ENVIRONMENT, "10kB")
    with pytest.raises(NotEnoughMemory, match=r"needs about .* KV cache .* but .* is available") as caught:
        exact_decoder.complete(PROMPT, n=4, max_new_tokens=8, seed=1)
    assert "MULTIDECODE_MEMORY" in caught.value.hint
    assert "decoding even 1 branch of the 4 asked for" in caught.value.message  # waves: not even one fits
    assert multidecode.NotEnoughMemory is NotEnoughMemory  # exported beside the other errors
    engine = exact_decoder.scheduler().engine
    one = memory_need(engine, len(PROMPT), [3], 8, 0).total
    monkeypatch.setenv(memory.ENVIRONMENT, str(int(one * 3 / memory.HEADROOM)))
    with pytest.raises(NotEnoughMemory, match="branches") as caught:  # questions do not run in waves
        exact_decoder.start([PROMPT + [1, 2, 3]] * 200, max_new_tokens=8)
    assert "any " in caught.value.hint and " of these branches fit at once" in caught.value.hint


def test_a_draft_budget_too_large_to_fit_is_named_as_the_cause(exact_decoder, monkeypatch):
    """One branch whose draft tree alone overflows the budget was told to lower max_new_tokens or
    shorten the prompts, neither of which was the cause."""
    from multidecode.speculation import SpeculationSettings

    engine = exact_decoder.scheduler().engine
    plain = memory_need(engine, len(PROMPT), [3], 8, 0).total
    monkeypatch.setenv(memory.ENVIRONMENT, str(int(plain * 2 / memory.HEADROOM)))
    with pytest.raises(NotEnoughMemory) as caught:
        exact_decoder.start([PROMPT + [1, 2, 3]], max_new_tokens=8,
                            speculate=SpeculationSettings("lookup", budget=100_000))
    assert "lower the draft budget or turn speculation off" in caught.value.hint  # "auto" is on by default
    assert "100,000 draft tokens" in caught.value.hint
    monkeypatch.setenv(memory.ENVIRONMENT, "10kB")  # not even the branch alone fits: the old advice stands
    with pytest.raises(NotEnoughMemory) as caught:
        exact_decoder.start([PROMPT + [1, 2, 3]], max_new_tokens=8,
                            speculate=SpeculationSettings("lookup", budget=100_000))
    assert "draft" not in caught.value.hint and "lower max_new_tokens" in caught.value.hint


def test_the_branches_a_refusal_says_fit_do_fit(exact_decoder, monkeypatch):
    """The count was worked out at the mean suffix length, rounded down: asking for that many was
    refused again, with the same count. Now it is what the longest of them need."""
    import re

    prompts = [PROMPT + [1 + (i + j) % 50 for j in range(i % 7)] for i in range(40)]  # own suffixes of 0-6 tokens
    engine = exact_decoder.scheduler().engine
    checked = 0
    for share in (0.2, 0.35, 0.5, 0.65, 0.8):
        whole = memory_need(engine, len(PROMPT), [i % 7 for i in range(40)], 8, 0).total
        monkeypatch.setenv(memory.ENVIRONMENT, str(int(share * whole / memory.HEADROOM)))
        with pytest.raises(NotEnoughMemory) as caught:
            exact_decoder.start(prompts, max_new_tokens=8)
        fit = int(re.search(r"any ([\d,]+) of these", caught.value.hint)[1].replace(",", ""))
        longest = sorted(prompts, key=len, reverse=True)[:fit]
        exact_decoder.start(longest, max_new_tokens=8)  # not refused
        checked += 1
    assert checked == 5


def test_the_cli_says_what_does_not_fit(model_dir, monkeypatch):
    monkeypatch.setenv(memory.ENVIRONMENT, "10kB")
    result = CliRunner().invoke(main, ["complete", "--model", str(model_dir), "-p", "hi", "--n", "100000",
                                       "--max-new-tokens", "4", "--json"])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "is available" in result.output and "Traceback" not in result.output


def least_budget(fits, monkeypatch) -> int:
    """The least MULTIDECODE_MEMORY under which `fits()` (the budget caps a forward's scratch too,
    so what fits is not what a need measured without the variable says)."""
    low, high = 1, 1 << 40
    while low < high:
        middle = (low + high) // 2
        monkeypatch.setenv(memory.ENVIRONMENT, str(middle))
        low, high = (low, middle) if fits() else (middle + 1, high)
    return low


def test_the_cli_runs_waves(model_dir, monkeypatch):
    runner = CliRunner()
    args = ["complete", "--model", str(model_dir), "-p", "hi", "--n", "6", "--max-new-tokens", "3", "--seed", "3", "--json"]
    monkeypatch.delenv(memory.ENVIRONMENT, raising=False)
    together = runner.invoke(main, args)
    assert together.exit_code == 0, together.output
    decoder = multidecode.load(str(model_dir), device="cpu")
    engine = decoder.scheduler().engine
    prompt = multidecode.strategies.complete.prompt_ids(decoder.tokenizer, "hi")
    monkeypatch.setenv(memory.ENVIRONMENT, str(least_budget(lambda: wave_size(engine, len(prompt), 6, 3, 0) >= 2,
                                                            monkeypatch)))
    assert wave_size(engine, len(prompt), 6, 3, 0) == 2
    waves = runner.invoke(main, args)
    assert waves.exit_code == 0, waves.output
    assert "in 3 waves of up to 2" in waves.stderr
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (together, waves))
    assert [c["token_ids"] for c in first] == [c["token_ids"] for c in second]


# ---------------------------------------------------------------------- the runtime's admission
def test_the_runtime_admits_by_bytes(exact_decoder):
    from multidecode.runtime.forest_runtime import ForestRuntime
    from multidecode.sampling_params import per_branch_sampling

    def job(branches: int) -> Job:
        return Job(prompts=[PROMPT] * branches, max_new_tokens=16, sampling=per_branch_sampling(branches, {}))

    runtime = ForestRuntime(exact_decoder.model, None, limits=Limits(max_live_bytes=1))
    one = runtime.job_bytes(job(1))
    runtime = ForestRuntime(exact_decoder.model, None, limits=Limits(max_live_bytes=int(one * 2.5)))
    with pytest.raises(TooLarge, match="bytes"):
        runtime.submit(job(3))
    runtime.submit(job(1))
    runtime.submit(job(1))
    with pytest.raises(Overloaded, match="at capacity"):
        runtime.submit(job(1))
    assert ForestRuntime(exact_decoder.model, None).limits.max_live_bytes is None
    assert ForestRuntime(exact_decoder.model, None).budget_bytes > 0


def test_a_job_reserves_its_common_prefix_once_and_its_refusals_name_no_driver(exact_decoder):
    """The one admission counts tokens as the forest holds them (the prompts' common prefix once),
    and speaks of the job and the runtime: each driver words a refusal in its own terms."""
    from multidecode.runtime.forest_runtime import ForestRuntime

    job = Job(prompts=[PROMPT, PROMPT[:5] + [1, 2]], max_new_tokens=4)
    assert job.reserved_tokens == 5 + 3 + 2 + 2 * 4
    runtime = ForestRuntime(exact_decoder.model, None, limits=Limits(max_live_tokens=10, max_branches=4))
    with pytest.raises(TooLarge) as caught:
        runtime.submit(job)
    assert "18 cache tokens" in caught.value.message and "server" not in str(caught.value)
    assert "max_tokens" not in str(caught.value)
    assert "branches" not in caught.value.message  # under that limit: only the one it is over is named
    assert (caught.value.need.tokens, caught.value.limit.tokens) == (18, 10) and not caught.value.over_bytes
    wide = ForestRuntime(exact_decoder.model, None, limits=Limits(max_live_tokens=1000, max_branches=1))
    with pytest.raises(TooLarge) as caught:
        wide.submit(job)
    assert caught.value.message == "the job needs 2 branches, over the runtime's limit of 1", caught.value.message


def test_a_model_whose_layers_differ_in_width_is_accounted_layer_by_layer():
    """Gemma 4's config refuses a global `head_dim` (its full-attention layers' heads are wider
    than its sliding ones'): reading it stopped every run before its first forward. Each layer's
    keys and values are counted at their own width, and the forest decodes as `generate` does."""
    import transformers as tf
    from tiny_models import COMMON, NO_EOS, ROPE, reference_generate

    config = tf.Gemma4TextConfig(**COMMON, **{**ROPE, "num_hidden_layers": 2}, head_dim=16, global_head_dim=32,
                                 sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.Gemma4ForCausalLM(config).eval()
    kv_heads = config.num_key_value_heads
    assert Footprint.of(model).kv_per_slot == 2 * kv_heads * (16 + 32) * 4  # float32 keys and values
    prefix, branches = [1, 5, 6, 7, 8, 9, 10, 11], [[], [9], [20, 21, 22]]
    together = multidecode.decode(model, prefix, branches, max_new_tokens=8, eos_token_id=[])
    for branch, got in zip(branches, together):
        assert got == reference_generate(model, prefix + branch, max_new_tokens=8, eos_token_id=[NO_EOS])


def test_a_model_that_gives_a_width_per_layer_as_a_list_is_accounted_and_exact():
    """Gemma 3n's configs give `intermediate_size` as a list, one per layer: the accounting took
    the list for one width and every run stopped in a TypeError. The widest layer counts, and the
    forest decodes as `generate` does."""
    import transformers as tf
    from tiny_models import COMMON, NO_EOS, ROPE, reference_generate

    config = tf.Gemma3nTextConfig(**COMMON, **{**ROPE, "num_hidden_layers": 4, "intermediate_size": [128, 96, 128, 64]},
                                  head_dim=16, activation_sparsity_pattern=[0.0] * 4,
                                  layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=6,
                                  hidden_size_per_layer_input=16, laurel_rank=8, num_kv_shared_layers=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.Gemma3nForCausalLM(config).eval()
    size = 4  # float32
    assert Footprint.of(model).per_row == (3 * 128 + 6 * config.hidden_size) * size
    prefix, branches = [1, 5, 6, 7, 8, 9, 10, 11], [[], [9], [20, 21, 22]]
    together = multidecode.decode(model, prefix, branches, max_new_tokens=8, eos_token_id=[])
    for branch, got in zip(branches, together):
        assert got == reference_generate(model, prefix + branch, max_new_tokens=8, eos_token_id=[NO_EOS])


def test_a_job_no_request_could_make_is_refused_when_made():
    """Job(prompts=[]) was a ValueError from min() when admitted, a Job without sampling an
    IndexError in its sink; now both are named, and no sampling means greedy."""
    from multidecode.errors import InvalidArgument, InvalidInput
    from multidecode.sampling_params import SamplingParams

    for prompts in ([], [[]], [PROMPT, []]):
        with pytest.raises(InvalidInput, match="at least one prompt"):
            Job(prompts=prompts, max_new_tokens=3)
    with pytest.raises(InvalidArgument, match="max_new_tokens must be a positive integer"):
        Job(prompts=[PROMPT], max_new_tokens=0)
    with pytest.raises(InvalidArgument, match="a job of 2 prompts has 1 sampling settings"):
        Job(prompts=[PROMPT, PROMPT], max_new_tokens=3, sampling=[SamplingParams()])
    assert Job(prompts=[PROMPT, PROMPT], max_new_tokens=3).sampling == [SamplingParams()] * 2



def test_beam_search_and_margins_say_the_fix_in_their_own_words(exact_decoder, model_dir, monkeypatch):
    """Both said "any 2 of these branches fit at once: split the work", which neither can do, and
    margins "lower max_new_tokens" for its notes, whose length is max_margin_tokens."""
    import re

    from multidecode.prompts import share_prefix
    from multidecode.strategies.margins import margin_prompts

    engine = exact_decoder.scheduler().engine
    monkeypatch.setenv(memory.ENVIRONMENT, str(least_budget(
        lambda: memory_need(engine, len(PROMPT), [0] * 2, 8, 0).total <= memory.budget_bytes(), monkeypatch)))
    with pytest.raises(NotEnoughMemory) as caught:
        exact_decoder.beam_search(PROMPT, num_beams=4, max_new_tokens=8)
    fit = re.search(r": lower num_beams to (\d+)$", caught.value.hint.split(", or set")[0])
    assert fit and 2 <= int(fit[1]) < 4 and "split the work" not in caught.value.hint, caught.value.hint

    decoder = multidecode.load(str(model_dir), device="cpu")
    chunks, question = [f"Line {i} of the minutes." for i in range(6)], "What was decided?"
    shared = share_prefix(margin_prompts(decoder.tokenizer, chunks, question))
    engine = decoder.scheduler().engine
    monkeypatch.setenv(memory.ENVIRONMENT, str(least_budget(
        lambda: memory_need(engine, len(shared.prefix_ids), [len(s) for s in shared.suffix_ids[:2]], 4, 0).total
        <= memory.budget_bytes(), monkeypatch)))
    with pytest.raises(NotEnoughMemory) as caught:
        decoder.margins(chunks, question, max_margin_tokens=4, max_new_tokens=4)
    assert "of these branches fit at once: give fewer chunks" in caught.value.hint, caught.value.hint
    monkeypatch.setenv(memory.ENVIRONMENT, "10kB")
    with pytest.raises(NotEnoughMemory) as caught:
        decoder.margins(chunks, question, max_margin_tokens=4, max_new_tokens=4)
    assert caught.value.hint.startswith("lower max_margin_tokens or shorten"), caught.value.hint


def test_the_budget_a_refusal_names_is_enough_and_no_less_is(exact_decoder, monkeypatch):
    """It said "needs about 6.3 MB"; MULTIDECODE_MEMORY=6.3MB then needed 7.0 MB (a budget is 85% of
    the setting, and a forward's scratch grows with it). The hint names a setting that fits."""
    import re

    prompts = [PROMPT + [1 + i, 2, 3] for i in range(8)]  # the shared PROMPT, then 3 ids of their own
    engine = exact_decoder.scheduler().engine
    least = memory_need(engine, len(PROMPT), [3] * 8, 8, 0).least_setting()
    for setting in ("10kB", str(least // 2), str(least - 1)):
        monkeypatch.setenv(memory.ENVIRONMENT, setting)
        with pytest.raises(NotEnoughMemory) as caught:
            exact_decoder.start(prompts, max_new_tokens=8)
        named = re.search(r"set MULTIDECODE_MEMORY=(\S+) \(or more\) if that much memory is free", caught.value.hint)
        assert named and least <= parse_bytes(named[1]) <= least * 1.02 + 1000, caught.value.hint
    for setting in (str(least), named[1]):
        monkeypatch.setenv(memory.ENVIRONMENT, setting)
        exact_decoder.start(prompts, max_new_tokens=8)  # not refused
