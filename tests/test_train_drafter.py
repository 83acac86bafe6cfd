"""`train-drafter` trains Medusa heads by self-distillation: the loss falls on a tiny model, the
heads land where speculate="medusa" finds them and decode exactly, an interrupted run resumes to
the very weights of an uninterrupted one, and a bad prompts file, a model without what the heads
read, and a work folder of other settings are refused with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from byte_tokenizer import ByteTokenizer
from click.testing import CliRunner
from hash_lm import HashLM
from speculation_cases import BRANCHES, NO_EOS, PREFIX, STEPS, outputs, run, tiny_references
from tiny_models import tiny_model

import multidecode
from multidecode.cli import main
from multidecode.errors import InvalidArgument
from multidecode.speculation import folder_mode
from multidecode.training.distill import DistillSettings, read_prompts, train_drafter

PROMPTS = [f"Tell me about the number {i}." for i in range(6)]


def _prompts(tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return str(path)


def _settings(tmp_path, **overrides) -> DistillSettings:
    base = dict(prompts=_prompts(tmp_path), heads=2, draft_vocab=128, max_new_tokens=12, batch=3, epochs=20,
                batch_positions=32, learning_rate=3e-3, checkpoint_every=10, output=str(tmp_path / "heads"),
                work=str(tmp_path / "work"))
    return DistillSettings(**{**base, **overrides})


def _decoder():
    return multidecode.MultiDecoder(tiny_model("llama", "sdpa"), ByteTokenizer())


@pytest.mark.slow
@pytest.mark.xdist_group("llama")
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_the_loss_falls_and_the_heads_decode_exactly(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("MULTIDECODE_CACHE", str(tmp_path / "cache"))
    decoder = _decoder()
    events = list(train_drafter(decoder, _settings(tmp_path, kind=kind, output=None, work=None)))
    losses = [e.info["loss"] for e in events if e.phase == "train" and "loss" in e.info]
    assert losses[-1] < 0.9 * losses[0]  # a random tiny target's distributions are broad: a high floor
    done = events[-1]
    assert done.phase == "done" and "head_top1" in done.info
    log = json.loads((tmp_path / "cache").joinpath(*_relative(done.info["folder"], tmp_path / "cache"),
                                                   "training.json").read_text())["log"]
    assert log and log[-1]["step"] == events[-2].total
    spec = decoder.speculation(kind)  # found in the user cache, for this model
    assert spec.proposer.name == kind
    assert [type(h).__name__ for h in decoder.learned_heads()] == [type(getattr(spec.proposer, "heads", None)
                                                                        or spec.proposer.head).__name__]
    forest = run(decoder.model, PREFIX, BRANCHES, speculate=spec, max_new_tokens=STEPS, eos=[NO_EOS])
    assert outputs(forest) == tiny_references("llama", "sdpa")


def _relative(folder: str, root) -> tuple[str, ...]:
    from pathlib import Path

    return Path(folder).relative_to(root).parts


@pytest.mark.slow
@pytest.mark.xdist_group("llama")
def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    decoder = _decoder()
    whole = list(train_drafter(decoder, _settings(tmp_path / "a")))
    assert whole[-1].phase == "done"
    settings = _settings(tmp_path / "b")
    events = train_drafter(decoder, settings)
    for event in events:  # stop in the write phase, after its first batch
        if event.phase == "write" and event.done > 0:
            break
    events.close()
    for event in (events := train_drafter(decoder, settings)):  # stop in the train phase, at a checkpoint
        if event.phase == "write":
            assert event.done >= 3  # the first batch was kept
        if event.phase == "train" and event.done == 20:
            break
    events.close()
    resumed = list(train_drafter(decoder, settings))
    first_train = next(e for e in resumed if e.phase == "train")
    assert first_train.done == 20  # from the checkpoint, not from the start
    assert all(e.done == e.total for e in resumed if e.phase in ("write",))
    a = torch.load(tmp_path / "a" / "work" / "medusa-checkpoint.pt", weights_only=False)["module"]
    b = torch.load(tmp_path / "b" / "work" / "medusa-checkpoint.pt", weights_only=False)["module"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.xdist_group("llama")
def test_two_fresh_eagle_runs_train_the_same_head(tmp_path):
    """The EAGLE layer's starting weights were drawn from the unseeded global generator: two runs of
    the same settings ended with other heads (the batches were seeded, the start was not)."""
    decoder = _decoder()
    heads = []
    for name in ("a", "b"):
        torch.manual_seed(ord(name))  # the caller's generator differs between the runs: the start must not
        assert list(train_drafter(decoder, _settings(tmp_path / name, kind="eagle", epochs=4)))[-1].phase == "done"
        heads.append({path.name: path.read_bytes() for path in (tmp_path / name / "heads").glob("*.safetensors")})
    assert heads[0] and heads[0] == heads[1]


def test_bad_prompts_a_model_without_an_lm_head_and_other_settings_are_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "not a prompt"}\n')
    with pytest.raises(InvalidArgument, match="line 2"):
        read_prompts(str(bad))
    with pytest.raises(InvalidArgument, match="cannot read"):
        read_prompts(str(tmp_path / "missing.jsonl"))
    model = HashLM()
    with pytest.raises(InvalidArgument, match="hidden state"):
        list(train_drafter(multidecode.MultiDecoder(model, ByteTokenizer(), exact=False), _settings(tmp_path)))
    decoder = _decoder()
    list(train_drafter(decoder, _settings(tmp_path, epochs=1)))
    with pytest.raises(InvalidArgument, match="other settings.*: epochs was 1, now 2"):  # what changed, named
        list(train_drafter(decoder, _settings(tmp_path, epochs=2)))
    result = CliRunner().invoke(main, ["train-drafter", "--prompts", str(bad)])
    assert result.exit_code != 0 and "line 2" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("setting", "value"), [("epochs", float("nan")), ("epochs", float("inf")), ("epochs", 0),
                                              ("learning_rate", float("nan")), ("heads", 0), ("batch", 2.5),
                                              ("limit", 0), ("seed", -1)])
def test_a_setting_no_run_could_use_is_refused_when_made(tmp_path, setting, value):
    """--epochs nan (or inf) passed click's range and ended in a traceback after the answers were written."""
    with pytest.raises(InvalidArgument, match=setting):
        _settings(tmp_path, **{setting: value})


def test_prompts_files_in_other_encodings_or_too_few_prompts_are_refused_before_loading(tmp_path):
    """A Latin-1 prompts file was a UnicodeDecodeError traceback; one with a byte-order mark was "line 1
    is not a prompt"; one prompt loaded the model and answered it before "too few prompts"."""
    good = json.dumps({"prompt": "hi there"}) + "\n" + json.dumps({"prompt": "and again"}) + "\n"
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + good.encode())
    assert read_prompts(str(marked)) == ["hi there", "and again"]
    cases = {"latin1.jsonl": ('{"prompt": "caf\xe9"}\n'.encode("latin-1"), "not UTF-8 text (bad byte at offset 15)"),
             "utf16.jsonl": (good.encode("utf-16"), "UTF-16"), "one.jsonl": (good.splitlines()[0].encode(), "got 1")}
    for name, (data, said) in cases.items():
        (tmp_path / name).write_bytes(data)
        result = CliRunner().invoke(main, ["train-drafter", "--prompts", str(tmp_path / name),
                                           "--model", str(tmp_path / "no-such-model")])
        assert result.exit_code == 2 and said in result.output and "Traceback" not in result.output, result.output
    result = CliRunner().invoke(main, ["train-drafter", "--prompts", str(marked), "--epochs", "nan",
                                       "--model", str(tmp_path / "no-such-model")])
    assert result.exit_code == 2 and "epochs must be a positive finite number" in result.output, result.output


def test_prompts_past_the_models_positions_are_left_out_and_named(tmp_path):
    """A prompt longer than the model's positions (the shipped set reaches about 1,100 tokens; a
    model may take 512) stopped the whole run with the document advice of `ask`. Those that do not
    fit, with their answers, are left out and named by number; none fitting is refused."""
    prompts = tmp_path / "long.jsonl"
    long_prompt = "the long one " * 40  # about 520 byte tokens: past the tiny model's 512 positions
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [*PROMPTS[:3], long_prompt, *PROMPTS[3:]]))
    events = list(train_drafter(_decoder(), _settings(tmp_path, prompts=str(prompts), epochs=1)))
    assert events[-1].info["left_out"] == [4]
    assert json.loads((tmp_path / "heads" / "training.json").read_text())["left_out"] == [4]
    prompts.write_text((json.dumps({"prompt": long_prompt}) + "\n") * 2)
    with pytest.raises(InvalidArgument, match="none of the 2 prompts fits the model's 512 positions"):
        list(train_drafter(_decoder(), _settings(tmp_path / "again", prompts=str(prompts), epochs=1)))


@pytest.mark.parametrize("option", ["--output", "--work"])
def test_folders_that_cannot_take_the_results_are_refused_before_the_model_loads(tmp_path, option):
    """--output (or --work) naming a file failed with a traceback, and for --output only after the
    whole training; now it is refused at once, and nothing is loaded."""
    taken = tmp_path / "afile"
    taken.write_text("")
    result = CliRunner().invoke(main, ["train-drafter", "--model", str(tmp_path / "no-model"), option, str(taken)])
    assert result.exit_code == 2, result.output
    assert f"{option} {taken} is a file, not a folder" in result.output and "Traceback" not in result.output


def _other_weights(decoder):
    """A decoder of a model of the same shape with other weights (a fine-tune of the same base)."""
    import copy

    model = copy.deepcopy(decoder.model)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.randn_like(model.get_input_embeddings().weight))
    return multidecode.MultiDecoder(model, ByteTokenizer())


def test_a_work_folder_or_an_output_of_another_model_is_refused(tmp_path, monkeypatch):
    """The default work folder is one per model shape: a second model of that shape resumed the
    first one's answers, trained on text it never wrote, and replaced the first one's head."""
    monkeypatch.setenv("MULTIDECODE_CACHE", str(tmp_path / "cache"))
    decoder, other = _decoder(), _other_weights(_decoder())
    assert list(train_drafter(decoder, _settings(tmp_path, epochs=1, output=None, work=None)))[-1].phase == "done"
    with pytest.raises(InvalidArgument, match="holds a head trained for a model of this shape with other weights"):
        list(train_drafter(other, _settings(tmp_path, epochs=1, output=None, work=None)))
    list(train_drafter(decoder, _settings(tmp_path, epochs=1)))  # a work folder of its own, named
    with pytest.raises(InvalidArgument, match="holds the answers of a model of this shape with other weights"):
        list(train_drafter(other, _settings(tmp_path, epochs=1, output=str(tmp_path / "other-heads"))))
    model_folder = tmp_path / "model"
    decoder.model.save_pretrained(model_folder)
    before = (model_folder / "config.json").read_bytes()
    with pytest.raises(InvalidArgument, match="not a head this trainer wrote"):  # --output the model's own folder
        list(train_drafter(decoder, _settings(tmp_path, epochs=1, output=str(model_folder), work=str(tmp_path / "w2"))))
    assert (model_folder / "config.json").read_bytes() == before
    medusa = tmp_path / "heads"  # a Medusa head of this model: an EAGLE head would be written beside it
    with pytest.raises(InvalidArgument, match="holds medusa weights and this run writes eagle weights"):
        list(train_drafter(decoder, _settings(tmp_path, epochs=1, kind="eagle")))
    assert folder_mode(medusa) == "medusa" and not list(medusa.glob("eagle*"))


def test_the_work_folder_holds_its_answers_to_the_prompts_not_to_their_files_name(tmp_path):
    """A prompts file rewritten with other prompts resumed the old answers (the file's name was the
    key), one grown crashed in training; the same prompts under another name were refused."""
    decoder = _decoder()
    settings = _settings(tmp_path, epochs=1)
    list(train_drafter(decoder, settings))
    copy = tmp_path / "elsewhere" / "copy.jsonl"
    copy.parent.mkdir()
    copy.write_bytes((tmp_path / "prompts.jsonl").read_bytes())
    resumed = list(train_drafter(decoder, _settings(tmp_path, epochs=1, prompts=str(copy))))
    assert all(e.done == e.total for e in resumed if e.phase in ("write", "train"))  # nothing redone
    Path(settings.prompts).write_text("".join(json.dumps({"prompt": p + " Again."}) + "\n" for p in PROMPTS * 2))
    with pytest.raises(InvalidArgument, match="answers to other prompts"):
        list(train_drafter(decoder, settings))


def test_an_answer_cut_by_an_interruption_is_written_again_on_a_line_of_its_own(tmp_path):
    """The next record was appended to the cut line, so its prompt was lost from training; and
    features were numbered by position, so a prompt redone later shifted every file after it."""
    decoder = _decoder()
    settings = _settings(tmp_path, epochs=1)
    list(train_drafter(decoder, settings))
    work = Path(settings.work)
    answers = work / "answers.jsonl"
    lines = answers.read_text().splitlines(keepends=True)
    answers.write_text("".join(lines[:2]) + "".join(lines[3:]) + lines[2][:25])  # prompt 2's record last, cut
    for stale in [*(work / "features").glob("*.pt"), work / "medusa-checkpoint.pt"]:
        stale.unlink()
    list(train_drafter(decoder, settings))
    records = [json.loads(line) for line in answers.read_text().splitlines()]
    assert sorted(r["i"] for r in records) == list(range(len(PROMPTS)))
    for record in records:  # each prompt's features hold its own tokens
        saved = torch.load(work / "features" / f"{record['i']:05d}.pt", weights_only=True)["tokens"].tolist()
        assert saved == record["prompt"] + record["answer"]
