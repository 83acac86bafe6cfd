"""`MultiDecoder.generate`, `speculate=` on every strategy, and the CLI's `generate` and
`--speculate`: on a tiny model folder (Llama + a BPE tokenizer made offline) and the embedded model."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from local_models import tiny_model_folder

import multidecode
import multidecode.cost
from multidecode.cli import main
from multidecode.cost import CostCurve

FLAT = CostCurve.from_relative({1: 1.0, 2: 1.02, 64: 1.5})
DOCUMENT = ("The router is old and the light is red. The cable is red. The ticket is open. "
            "The router is old and the cable is red.")


@pytest.fixture(scope="module")
def decoder(model_dir):
    md = multidecode.load(str(model_dir))
    md.cost = FLAT
    return md


def hf_greedy(model, ids, n):
    prompt = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.xdist_group("cli")
@pytest.mark.parametrize("speculate", [None, "lookup", "auto"])
def test_generate_equals_transformers_generate(decoder, speculate):
    done = decoder.generate("hello, the router is old and the cable", max_new_tokens=24, speculate=speculate)
    assert done.token_ids == hf_greedy(decoder.model, done.prompt_ids, 24)
    assert done.finish_reason == ("stop" if done.token_ids[-1] in decoder.eos_ids else "length")
    assert done.text == decoder.tokenizer.decode(done.token_ids, skip_special_tokens=True)
    assert done.finish_reason in ("stop", "length") and done.seed is None
    stats = done.stats
    assert stats["speculate"] == speculate and stats["tokens"] == len(done.token_ids)
    assert stats["forward_passes"] >= 1 and stats["tokens_per_forward"] > 0
    if speculate is None:
        assert stats["forward_passes"] == len(done.token_ids) and stats["drafted"] == 0


@pytest.mark.xdist_group("cli")
def test_generate_takes_ids_as_given_and_streams(decoder):
    ids = decoder.tokenizer("The cable is red. The cable", add_special_tokens=False)["input_ids"]
    done = decoder.generate(ids, max_new_tokens=12, speculate="lookup", chat=False)
    assert done.prompt_ids == ids and done.token_ids == hf_greedy(decoder.model, ids, 12)
    events = list(decoder.stream_generate(ids, max_new_tokens=12, speculate="lookup"))
    assert [e.token_id for e in events] == done.token_ids
    assert "".join(e.text for e in events) == done.text


@pytest.mark.xdist_group("cli")
def test_speculation_never_changes_ask_complete_or_vote(decoder):
    questions = ["What colour is the cable?", "Is the ticket open?", "How old is the router?"]
    plain = decoder.ask(DOCUMENT, questions, max_new_tokens=16)
    for speculate in ("lookup", "auto"):
        assert [a.token_ids for a in decoder.ask(DOCUMENT, questions, max_new_tokens=16, speculate=speculate)] == \
            [a.token_ids for a in plain]
    sampled = decoder.complete("The cable is", n=3, max_new_tokens=12, seed=4, temperature=0.8)
    again = decoder.complete("The cable is", n=3, max_new_tokens=12, seed=4, temperature=0.8, speculate="lookup")
    assert [c.token_ids for c in again] == [c.token_ids for c in sampled]
    assert again[0].stats["speculate"] == "lookup"
    votes = decoder.vote("What is 2 + 2?", n=3, max_new_tokens=10, seed=1)
    assert decoder.vote("What is 2 + 2?", n=3, max_new_tokens=10, seed=1, speculate="auto").traces == votes.traces


@pytest.mark.xdist_group("cli")
def test_every_strategy_takes_the_ids_that_end_a_branch(decoder):
    """eos_token_id was taken by generate, complete and vote, refused by ask and stream as an
    unknown setting and a TypeError in beam_search. Each answer ends at the first id given, as the
    same question's generate does; [] runs to max_new_tokens."""
    questions = ["What colour is the cable?", "Is the ticket open?"]
    free = decoder.ask(DOCUMENT, questions, max_new_tokens=12, eos_token_id=[])
    assert all(len(a.token_ids) == 12 for a in free)
    stop_at = free[0].token_ids[3]  # an id the first answer holds: it ends there
    answers = decoder.ask(DOCUMENT, questions, max_new_tokens=12, eos_token_id=stop_at)
    streamed = list(decoder.stream(DOCUMENT, questions, max_new_tokens=12, eos_token_id=stop_at))
    for i, answer in enumerate(answers):
        alone = decoder.generate(answer.prompt_ids, max_new_tokens=12, eos_token_id=stop_at, speculate=None)
        assert answer.token_ids == alone.token_ids
        assert [e.token_id for e in streamed if e.branch == i] == answer.token_ids
    assert answers[0].token_ids[-1] == stop_at and answers[0].finish_reason == "stop"
    beams = decoder.beam_search(DOCUMENT, num_beams=2, max_new_tokens=8, eos_token_id=[])
    assert all(len(b.token_ids) == 8 for b in beams)


# ---------------------------------------------------------------------- the CLI
@pytest.mark.xdist_group("cli")
def test_cli_generate_json_stats_and_streaming(model_dir, decoder, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIDECODE_COSTS", str(tmp_path / "costs"))  # where "auto" keeps its cost curve
    monkeypatch.setattr(multidecode.cost, "_CURVES", {})  # measured in this test, whatever ran before
    runner = CliRunner()
    args = ["generate", "--model", str(model_dir), "-p", "hello, the router is old", "--max-new-tokens", "10"]
    result = runner.invoke(main, [*args, "--speculate", "lookup", "--draft-budget", "3", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.strip().splitlines()[-1])
    expected = decoder.generate("hello, the router is old", max_new_tokens=10, speculate=None)
    assert row["token_ids"] == expected.token_ids and row["text"] == expected.text
    assert row["stats"]["speculate"] == "lookup" and row["stats"]["forward_passes"] >= 1
    human = runner.invoke(main, [*args, "--speculate", "auto", "--stats"])
    assert human.exit_code == 0, human.output
    assert expected.text.strip() in human.stdout
    assert "tokens per forward" in human.stderr and "speculate=auto" in human.stderr
    assert "Measuring what a forward costs" in human.stderr and "kept, and refined by every run" in human.stderr
    assert list(tmp_path.glob("costs/*.json"))  # measured once, kept for the next run
    (tmp_path / "a-file").write_text("")  # a folder that cannot be made: the curve is measured, and said not kept
    monkeypatch.setenv("MULTIDECODE_COSTS", str(tmp_path / "a-file" / "costs"))
    monkeypatch.setattr(multidecode.cost, "_CURVES", {})
    unkept = runner.invoke(main, [*args, "--speculate", "auto"])
    assert unkept.exit_code == 0 and unkept.stdout == human.stdout, unkept.output
    assert f"not kept: {tmp_path / 'a-file' / 'costs'} cannot be written" in unkept.stderr.replace("\n", "")
    assert "kept, and refined" not in unkept.stderr
    prompt_file = tmp_path / "prompt.txt"
    for ending in ("", "\n", "\r\n"):  # a file's last line break (echo's, an editor's) is not the prompt's
        prompt_file.write_bytes(f"hello, the router is old{ending}".encode())
        from_file = runner.invoke(main, ["generate", "--model", str(model_dir), "--prompt-file", str(prompt_file),
                                         "--max-new-tokens", "10", "--json"])
        assert json.loads(from_file.stdout.strip().splitlines()[-1])["token_ids"] == expected.token_ids, ending


@pytest.mark.xdist_group("cli")
def test_echo_separates_a_chat_message_from_its_reply(model_dir):
    """With the chat template the echo ran the message into the reply ("Say helloI'm glad"): the
    model answers a message, it does not continue its text. Without the template, text continues."""
    runner = CliRunner()
    args = ["generate", "--model", str(model_dir), "-p", "Say hello", "--max-new-tokens", "6", "--echo"]
    for chat, head in (([], "Say hello\n\n"), (["--no-chat"], "Say hello")):
        plain = json.loads(runner.invoke(main, [*args[:-1], *chat, "--json"]).stdout.strip().splitlines()[-1])
        echoed = json.loads(runner.invoke(main, [*args, *chat, "--json"]).stdout.strip().splitlines()[-1])
        assert echoed["text"] == head + plain["text"] and echoed["token_ids"] == plain["token_ids"], chat
        streamed = runner.invoke(main, [*args, *chat])
        assert streamed.exit_code == 0 and streamed.stdout == head + plain["text"] + "\n", chat


@pytest.mark.xdist_group("cli")
@pytest.mark.parametrize("extra, message", [
    (["--speculate", "hydra"], "unknown speculation mode"),
    (["--speculate", "lookup", "--draft-budget", "0"], "positive integer"),
    (["--speculate", "off", "--draft-budget", "4"], "--draft-budget needs speculation"),
    (["--speculate", "draft"], "--speculate draft needs a draft model"),
    (["--speculate", "lookup", "--draft-skip-layers", "1"], "but --speculate is lookup"),
    (["--draft-skip-layers", "1-x"], "not a list of layer numbers"),
    (["--draft-model", "a", "--draft-skip-layers", "1"], "both name a draft"),
    (["--speculate", "lookahead", "--lookahead", "7,5"], "is not three integers"),
    (["--speculate", "lookahead", "--lookahead", "0,5,7"], "need W >= 1"),
    # a window of 1e20 was built token by token before any check: the run stalled, its memory grew
    (["--speculate", "lookahead", "--lookahead", "99999999999999999999,5,7"], "tokens a step, past 65536"),
    (["--speculate", "lookup", "--lookahead", "7,5,7"], "--lookahead sets lookahead decoding"),
])
def test_cli_bad_speculation_settings_exit_2_before_loading(model_dir, extra, message):
    for command in (["generate", "-p", "hi"], ["ask", "--document", "-", "-q", "Why?"],
                    ["complete", "-p", "hi"], ["vote", "-q", "Why?"]):
        result = CliRunner().invoke(main, [*command, "--model", str(model_dir), *extra], input="A document.")
        assert result.exit_code == 2, (command, result.output)
        assert message in result.output and "hint:" in result.output and "Traceback" not in result.output
        assert "Loaded" not in result.output  # refused before the model loads


@pytest.mark.xdist_group("cli")
def test_cli_ask_complete_vote_take_speculate(model_dir, tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text(DOCUMENT, encoding="utf-8")
    runner = CliRunner()
    base = ["ask", "--model", str(model_dir), "--document", str(document), "-q", "What colour is the cable?",
            "--max-new-tokens", "8", "--json"]
    plain = runner.invoke(main, base)
    spec = runner.invoke(main, [*base, "--speculate", "lookup", "--stats"])
    assert spec.exit_code == 0, spec.output
    assert json.loads(spec.stdout) == json.loads(plain.stdout)
    assert "speculate=lookup" in spec.stderr
    comp = runner.invoke(main, ["complete", "--model", str(model_dir), "-p", "The cable", "--n", "2", "--seed", "3",
                                "--max-new-tokens", "6", "--speculate", "lookup", "--json"])
    assert comp.exit_code == 0, comp.output
    vote = runner.invoke(main, ["vote", "--model", str(model_dir), "-q", "What is 2 + 2?", "--n", "2",
                                "--max-new-tokens", "6", "--seed", "1", "--speculate", "lookup", "--json"])
    assert vote.exit_code == 0, vote.output


# ---------------------------------------------------------------------- the embedded model
@pytest.fixture(scope="module")
def embedded():
    md = multidecode.load()
    md.cost = CostCurve.from_relative({1: 1.0, 2: 1.04, 3: 1.15, 4: 1.44, 8: 1.82, 16: 2.08, 64: 4.07})  # this CPU's
    return md


@pytest.mark.embedded
@pytest.mark.xdist_group("embedded")
def test_embedded_generate_with_speculation_equals_plain_greedy(embedded):
    """SmolLM2 copying from its prompt: prompt lookup and auto give plain greedy's tokens, in fewer
    forwards."""
    text = ("Repeat this list exactly: apples, pears, plums, cherries, apricots, peaches, figs, dates, "
            "grapes, lemons, limes, oranges.")
    plain = embedded.generate(text, max_new_tokens=40, speculate=None)
    assert plain.token_ids == hf_greedy(embedded.model, plain.prompt_ids, 40)[: len(plain.token_ids)]
    for speculate in ("lookup", "auto"):
        done = embedded.generate(text, max_new_tokens=40, speculate=speculate)
        assert done.token_ids == plain.token_ids
        assert done.stats["forward_passes"] < plain.stats["forward_passes"]


@pytest.mark.xdist_group("cli")
def test_cli_generate_with_every_proposer_gives_plain_greedy(model_dir, decoder):
    """lookahead (with settings), suffix and a self-draft (one of the two layers skipped): the
    tokens of plain greedy decoding."""
    expected = decoder.generate("hello, the router is old", max_new_tokens=10, speculate=None).token_ids
    args = ["generate", "--model", str(model_dir), "-p", "hello, the router is old", "--max-new-tokens", "10", "--json"]
    for extra in (["--speculate", "lookahead", "--lookahead", "3,3,3"], ["--speculate", "suffix"],
                  ["--draft-skip-layers", "1"], ["--speculate", "draft", "--draft-model", str(model_dir)]):
        result = CliRunner().invoke(main, [*args, *extra, "--stats"])
        assert result.exit_code == 0, (extra, result.output)
        row = json.loads(result.stdout.strip().splitlines()[-1])
        assert row["token_ids"] == expected, extra
        assert row["stats"]["speculate"] in ("lookahead", "suffix", "draft")


@pytest.mark.xdist_group("cli")
@pytest.mark.parametrize("settings", [{"temperature": 0.9}, {"top_k": 5}, {"top_p": 0.9}, {"do_sample": True}])
def test_a_sampled_result_without_a_seed_reports_the_one_that_reproduces_it(decoder, settings):
    """Where no seed is given a base seed is drawn and reported, for every way of sampling."""
    done = decoder.generate("hello there", max_new_tokens=8, speculate=None, **settings)
    assert done.seed is not None
    assert decoder.generate("hello there", max_new_tokens=8, speculate=None, seed=done.seed, **settings) == done
    answers = decoder.ask("A short document.", ["one?", "two?"], max_new_tokens=6, **settings)
    assert answers[1].seed == answers[0].seed + 1
    again = decoder.ask("A short document.", ["one?", "two?"], max_new_tokens=6, seed=answers[0].seed, **settings)
    assert [a.token_ids for a in again] == [a.token_ids for a in answers]
    assert decoder.generate("hello there", max_new_tokens=4).seed is None  # greedy


def test_cli_refuses_a_draft_model_with_another_tokenizer(model_dir, tmp_path):
    other = tiny_model_folder(tmp_path / "other", vocab_size=300)
    result = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "-p", "hi", "--max-new-tokens", "3",
                                       "--draft-model", str(other)])
    assert result.exit_code == 2, result.output
    assert "tokenizer differs" in result.output and "hint:" in result.output and "Traceback" not in result.output



def test_cli_says_when_an_output_held_to_a_grammar_was_cut_short(model_dir, tmp_path):
    """Printed as text, an output cut at --max-new-tokens before its grammar completes gets a note
    (it may not parse); one that completes gets none."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}))
    args = ["generate", "--model", str(model_dir), "-p", "A person:", "--no-chat", "--json-schema", str(schema)]
    cut = CliRunner().invoke(main, [*args, "--max-new-tokens", "3"])
    assert cut.exit_code == 0, cut.output
    assert "before its grammar was complete" in cut.stderr
    plain = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "-p", "A person:", "--no-chat",
                                      "--max-new-tokens", "3"])
    assert plain.exit_code == 0 and "grammar" not in plain.stderr


def test_results_held_to_a_json_schema_carry_their_parsed_value(decoder):
    """`parsed` is the output's JSON value (as the command line's and batch records' "parsed"), None
    without a schema and when the output was cut short."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    done = decoder.generate("Is it fine?", max_new_tokens=40, json_schema=schema, speculate=None)
    assert done.finish_reason == "stop" and done.parsed == json.loads(done.text) and set(done.parsed) == {"ok"}
    cut = decoder.generate("Is it fine?", max_new_tokens=2, json_schema=schema, speculate=None)
    assert cut.finish_reason == "length" and cut.parsed is None
    assert decoder.generate("Is it fine?", max_new_tokens=4, speculate=None).parsed is None
    answers = decoder.ask("A short text.", ["Fine?", "Sure?"], max_new_tokens=40, json_schema=schema)
    assert [a.parsed for a in answers] == [json.loads(a.text) for a in answers]


def test_the_live_board_wraps_long_answers_and_says_which_were_cut(monkeypatch):
    """On a terminal the board is redrawn in place; a line wider than the terminal is wrapped, not
    cropped (the command's soft-wrapped console would crop it), and an answer cut at the limit says so."""
    import io

    from rich.console import Console

    from multidecode.branches import TokenEvent
    from multidecode.cli import decoding

    screen = io.StringIO()
    monkeypatch.setattr(decoding, "stdout", Console(file=screen, force_terminal=True, soft_wrap=True, highlight=False))
    monkeypatch.setenv("COLUMNS", "30")
    words = [f"word{i} " for i in range(20)]
    events = [TokenEvent(0, i, text, None) for i, text in enumerate(words[:-1])] + [TokenEvent(0, 19, words[-1], "length")]
    events.append(TokenEvent(1, 0, "short", "stop"))
    decoding.show_stream(events, ["a question?", "another?"])
    shown = screen.getvalue()
    assert all(word.strip() in shown for word in words), shown
    assert "cut at" in shown and " done" in shown


@pytest.mark.xdist_group("cli")
def test_temperature_0_says_the_sampling_settings_it_does_not_use(model_dir, tmp_path):
    """--temperature 0 --seed 3 dropped the seed without a word, where --greedy --seed 3 is refused."""
    args = ["generate", "--model", str(model_dir), "-p", "hi", "--max-new-tokens", "3", "--temperature", "0"]
    greedy = CliRunner().invoke(main, args[:-2])
    for extra, named in ((["--seed", "3"], "--seed is not used"), (["--seed", "3", "--top-p", "0.5"],
                                                                    "--seed, --top-p are not used")):
        result = CliRunner().invoke(main, [*args, *extra])
        assert result.exit_code == 0 and result.stdout == greedy.stdout, result.output
        assert f"--temperature 0 decodes greedily, so {named}" in result.stderr.replace("\n", " ")
    assert "not used" not in CliRunner().invoke(main, args).stderr
    (tmp_path / "note.txt").write_text("A note.")
    asked = CliRunner().invoke(main, ["ask", "--model", str(model_dir), "-d", str(tmp_path / "note.txt"), "-q", "Why?",
                                      "--max-new-tokens", "2", "--temperature", "0", "--seed", "3"])
    assert asked.exit_code == 0 and asked.stderr.count("--seed is not used") == 1, asked.output  # once
