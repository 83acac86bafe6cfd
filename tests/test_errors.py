"""Bad input gets a clear message and a non-zero exit, never a traceback.

Each case runs through the CLI (in-process, with click's runner) against an offline tiny model
folder, and checks the exit code, the `error:` line, and that no traceback escaped. The library
side raises a `MultiDecodeError` subclass that names the problem.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from click.testing import CliRunner
from local_models import tiny_tokenizer
from tiny_models import NO_EOS, reference_generate

import multidecode
import multidecode.models.converted
from multidecode.cli import main


@pytest.fixture(scope="module")
def model_dir(model_dir_of):
    """The shared tiny model folder with a short context (96 positions), which the prompt-length
    tests overflow."""
    return model_dir_of(96)


@pytest.fixture()
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("Here is a document about support calls, routers and cables.\n")
    return path


def run(*args, stdin: str | None = None):
    result = CliRunner().invoke(main, [str(a) for a in args], input=stdin)
    return result


def assert_clean_error(result, *needles: str) -> None:
    """Exit code 2, an `error:` line naming the problem, and no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert "error:" in text
    assert "Traceback" not in text
    for needle in needles:
        assert needle in text, (needle, text)


def test_a_good_run_works(model_dir, doc):
    """The fixture itself: a plain question gets a JSON answer (so the failures below are about the input)."""
    result = run("ask", "--model", model_dir, "--document", doc, "-q", "what is it?", "--max-new-tokens", 4, "--json")
    assert result.exit_code == 0, result.output
    answers = json.loads(result.stdout)
    assert len(answers) == 1 and len(answers[0]["token_ids"]) <= 4


def test_empty_document(model_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    assert_clean_error(run("ask", "--model", model_dir, "--document", empty, "-q", "why?"), "document is empty")


def test_empty_document_from_stdin(model_dir):
    assert_clean_error(run("ask", "--model", model_dir, "--document", "-", "-q", "why?", stdin=""), "document is empty")


def test_no_questions(model_dir, doc):
    assert_clean_error(run("ask", "--model", model_dir, "--document", doc), "no questions")


def test_questions_file_with_only_blank_lines(model_dir, doc, tmp_path):
    questions = tmp_path / "q.txt"
    questions.write_text("\n   \n")
    assert_clean_error(run("ask", "--model", model_dir, "--document", doc, "--questions-file", questions), "no questions")


def test_empty_question(model_dir, doc):
    assert_clean_error(run("ask", "--model", model_dir, "--document", doc, "-q", "why?", "-q", "  "), "question 2 is empty")


def test_prompt_longer_than_the_model_positions(model_dir, tmp_path):
    long_doc = tmp_path / "long.txt"
    long_doc.write_text("routers and cables " * 200)
    result = run("ask", "--model", model_dir, "--document", long_doc, "-q", "why?")
    assert_clean_error(result, "at most 96 positions")
    assert "the prompt is" in result.output + result.stderr


def test_prompt_plus_new_tokens_past_the_model_positions(model_dir, tmp_path):
    mid_doc = tmp_path / "mid.txt"
    mid_doc.write_text("routers " * 20)
    result = run("ask", "--model", model_dir, "--document", mid_doc, "-q", "why?", "--max-new-tokens", 90)
    assert_clean_error(result, "lower --max-new-tokens to")  # the option, as the command spells it


def test_a_negative_temperature_on_the_command_line_speaks_of_the_option(doc):
    """Its hint said 'do_sample=False; on the command line, --temperature 0': Python's words to a
    command-line user."""
    for value in ("-1", "nan"):  # nan passed the check and reached the library's do_sample hint
        result = run("ask", "--document", doc, "-q", "why?", "--temperature", value)
        assert_clean_error(result, f"--temperature must be 0 (greedy) or more, got {value}")
        assert "do_sample" not in result.output + result.stderr
    for value in ("inf", "1e-40"):  # past what float32 logits can be divided by: the library's do_sample hint too
        result = run("ask", "--document", doc, "-q", "why?", "--temperature", value)
        assert_clean_error(result, f"--temperature {value} cannot divide float32 logits", "--temperature 0")
        assert "do_sample" not in result.output + result.stderr


@pytest.mark.parametrize("columns", ["0", "-3"])
def test_errors_show_where_columns_is_zero(tmp_path, columns):
    """COLUMNS=0 (some CI runners, a pty sized 0x0) made rich write nothing at all: no `error:`
    line, only the exit status."""
    env = {**os.environ, "COLUMNS": columns}
    result = subprocess.run([sys.executable, "-m", "multidecode", "generate", "--model", str(tmp_path / "nope"),
                             "-p", "hi"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 2 and "error: no model at" in result.stderr and "hint:" in result.stderr


def test_missing_model_path(doc, tmp_path):
    assert_clean_error(run("ask", "--model", tmp_path / "nope", "--document", doc, "-q", "why?"), "does not exist")


def test_a_file_that_is_not_a_model(doc, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    assert_clean_error(run("ask", "--model", notes, "--document", doc, "-q", "why?"), "not a .gguf model")


def test_a_gguf_file_that_is_not_gguf(doc, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not really a model")
    assert_clean_error(run("ask", "--model", fake, "--document", doc, "-q", "why?"), "not a GGUF file")


@pytest.mark.parametrize("kept", ["3000 bytes", "all but the last 2000 bytes", "a header alone"])
def test_a_gguf_file_cut_short_says_so(doc, tmp_path, cache, kept):
    """A download cut short: the header, or a tensor, ends before the file does (it was a traceback
    of struct.error, or a reshape's numbers, with a hint to pass a .gguf file)."""
    from gguf_files import write_tiny_gguf

    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole)
    data = whole.read_bytes()
    cut = tmp_path / "model.gguf"
    cut.write_bytes({"3000 bytes": data[:3000], "all but the last 2000 bytes": data[:-2000],
                     "a header alone": b"GGUFgarbage"}[kept])
    assert_clean_error(run("ask", "--model", cut, "--document", doc, "-q", "why?"), "may be cut short or damaged",
                       "fetch it again")


@pytest.mark.parametrize(("architecture", "reason"), [("mamba", "recurrent layers"), ("bloom", "ALiBi positions")])
def test_a_gguf_model_no_forest_runs_is_refused_for_what_it_is_at_the_default_precision(doc, tmp_path, cache,
                                                                                      architecture, reason):
    """Read as packed codes (the default), such a file was refused with transformers' words about
    sdpa and a hint to pass a .gguf file (at float32 it was refused for what it is). The file's
    tensors are a Llama's: the model is refused from its config, before any weight is read."""
    from gguf_files import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / f"{architecture}.gguf", architecture=architecture)
    assert_clean_error(run("ask", "--model", path, "--document", doc, "-q", "why?"), reason, "cannot run exactly")


def test_a_folder_named_like_a_gguf_file_is_called_a_folder(doc, tmp_path):
    folder = tmp_path / "model.gguf"
    folder.mkdir()
    assert_clean_error(run("ask", "--model", folder, "--document", doc, "-q", "why?"), "is a folder, not a .gguf file")


def test_an_empty_precision_is_refused_not_taken_for_auto(model_dir):
    with pytest.raises(multidecode.InvalidArgument, match="unknown precision ''"):
        multidecode.load(str(model_dir), precision="")


def test_small_byte_counts_are_written_in_their_own_unit():
    from multidecode.memory import gigabytes

    assert [gigabytes(n) for n in (0, 50, 512, 23_040, 5_000_000, 3_000_000_000)] == [
        "0 bytes", "50 bytes", "0.5 kB", "23.0 kB", "5.0 MB", "3.00 GB"]  # a budget of 0 read "0.0 MB"


def test_a_folder_without_config(doc, tmp_path):
    assert_clean_error(run("ask", "--model", tmp_path, "--document", doc, "-q", "why?"), "no config.json")


def _damaged_copy(model_dir, tmp_path, damage: str):
    """A copy of the tiny model folder with one fault a published or downloaded folder can have."""
    folder = Path(shutil.copytree(model_dir, tmp_path / "model"))
    config = json.loads((folder / "config.json").read_text())
    if damage == "flash attention in its config":
        config["_attn_implementation"] = "flash_attention_2"
    elif damage == "a config value of the wrong type":
        config["hidden_size"] = "big"
    elif damage == "weights cut short":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no tokenizer":
        for name in multidecode.models.loading.TOKENIZER_FILES:
            (folder / name).unlink(missing_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_folder_whose_config_asks_for_flash_attention_loads_with_ours(model_dir, doc, tmp_path):
    """Many published folders carry "_attn_implementation": "flash_attention_2" in config.json:
    transformers took it over the attention asked for and failed to import flash-attn (a traceback
    on the command line, an ImportError from `load`). The weights are the same whatever reads them."""
    folder = _damaged_copy(model_dir, tmp_path, "flash attention in its config")
    loaded = multidecode.load(str(folder), exact=True)
    plain = multidecode.load(str(model_dir), exact=True)
    assert loaded.generate("hi", max_new_tokens=4).token_ids == plain.generate("hi", max_new_tokens=4).token_ids


@pytest.mark.parametrize("damage, needles", [
    ("a config value of the wrong type", ("expected int, got str", "config.json")),
    ("weights cut short", ("deserializing header", "may be cut short or damaged")),
    ("no tokenizer", ("has no tokenizer", "copy the tokenizer's files")),
])
def test_a_damaged_folder_is_a_clean_error(model_dir, doc, tmp_path, damage, needles):
    """The first two were tracebacks (huggingface_hub's and safetensors' own errors); the third
    sent the user to install sentencepiece or tiktoken."""
    folder = _damaged_copy(model_dir, tmp_path, damage)
    assert_clean_error(run("ask", "--model", folder, "--document", doc, "-q", "why?"), *needles)
    with pytest.raises(multidecode.ModelNotFound):
        multidecode.load(str(folder))


def test_an_encoder_decoder_architecture(doc, tmp_path):
    config = tf.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    tf.T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert_clean_error(run("ask", "--model", tmp_path, "--document", doc, "-q", "why?"), "not a causal language model")


def test_a_recurrent_architecture(doc, tmp_path):
    config = tf.MambaConfig(vocab_size=400, hidden_size=16, state_size=4, num_hidden_layers=1)
    tf.MambaForCausalLM(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert_clean_error(run("ask", "--model", tmp_path, "--document", doc, "-q", "why?"), "recurrent layers")


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention"])
def test_an_unsupported_attention_implementation_is_refused(impl):
    config = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)
    model = tf.LlamaForCausalLM(config)
    model.config._attn_implementation = impl
    with pytest.raises(multidecode.UnsupportedModel, match="attn_implementation='sdpa'"):
        multidecode.decode(model, [1, 2], [[3]], max_new_tokens=1)


def test_sliding_chunked_and_bidirectional_models_are_refused():
    config = tf.Gemma3TextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                 use_bidirectional_attention=True)
    with pytest.raises(multidecode.UnsupportedModel, match="bidirectional"):
        multidecode.MultiDecoder(tf.Gemma3ForCausalLM(config), None)


@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_max_new_tokens(model_dir, doc, value):
    assert_clean_error(
        run("ask", "--model", model_dir, "--document", doc, "-q", "why?", "--max-new-tokens", value),
        "--max-new-tokens must be a positive integer",  # the option, not the library's name for it
    )


def test_library_rejects_non_positive_max_new_tokens():
    config = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(multidecode.InvalidArgument):
        multidecode.decode(tf.LlamaForCausalLM(config).eval(), [1], [[2]], max_new_tokens=0)


def test_a_document_that_is_not_text(model_dir, tmp_path):
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    assert_clean_error(run("ask", "--model", model_dir, "--document", binary, "-q", "why?"), "not a text file")


@pytest.mark.parametrize(("data", "said", "fix"), [
    ("Qu'a dit le client ?".encode("utf-16"), "is UTF-16 (or UTF-32) text, not UTF-8", "iconv"),
    ("Qu'a dit le client ?".encode("utf-16-le"), "is UTF-16 (or UTF-32) text, not UTF-8", "iconv"),
    ("Qu'a dit le client ?".encode("utf-16-be"), "is UTF-16 (or UTF-32) text, not UTF-8", "iconv"),
    (gzip.compress(b"some text"), "is not a text file (it is gzip-compressed)", "gunzip"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), "is not a text file (it holds binary data)",
     "plain UTF-8 text")], ids=["utf-16 with its mark", "utf-16-le", "utf-16-be", "gzip", "png"])
def test_a_file_that_is_not_utf8_text_says_what_it_is(model_dir, tmp_path, data, said, fix):
    """A UTF-16 file (Windows' "Unicode" text) was "binary data, gunzip it first" to batch and "bad
    byte at offset 0" to ask: each says what the file is, and how to make it UTF-8."""
    document, source = tmp_path / "document.txt", tmp_path / "in.jsonl"
    document.write_bytes(data)
    source.write_bytes(data)
    assert_clean_error(run("ask", "--model", model_dir, "--document", document, "-q", "why?"), said, fix)
    assert_clean_error(run("batch", source, "-o", tmp_path / "out.jsonl", "--model", model_dir, "-q", "why?"), said,
                       fix)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_file_that_cannot_be_read(model_dir, tmp_path, monkeypatch):
    """A file the user may not read (or that fails to read) is an error naming it, not a traceback."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the document")

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(type(secret), "read_bytes", refuse)
    assert_clean_error(run("ask", "--model", model_dir, "--document", secret, "-q", "why?"),
                       f"cannot read the document file {secret}: Permission denied")


@pytest.mark.parametrize("given, url", [("127.0.0.1:8000", "http://127.0.0.1:8000"),
                                        ("http://localhost:8000/v1/", "http://localhost:8000"),
                                        ("https://example.org/llm/v1", "https://example.org/llm")])
def test_a_server_url_as_users_write_it(given, url):
    from multidecode.cli.remote import server_url

    assert server_url(given) == url


@pytest.mark.parametrize("given, message", [("http://[::1", "is not a URL"), ("ftp://host", "not an http(s) URL")])
def test_a_malformed_server_url(given, message):
    assert_clean_error(run("generate", "-p", "hi", "--server", given), message)


@pytest.mark.parametrize("extra, message", [(["--draft-model", "/no/such/model"], "no model at /no/such/model"),
                                            (["--draft-head", "/no/such/head"], "is not a folder")])
def test_a_missing_draft_is_refused_before_the_model_loads(model_dir, extra, message):
    result = run("generate", "--model", model_dir, "-p", "hi", *extra)
    assert_clean_error(result, message)
    assert "Loaded" not in result.output


def test_an_empty_prompt_file_is_refused_before_the_model_loads(model_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    result = run("generate", "--model", model_dir, "--prompt-file", empty)
    assert_clean_error(result, "the prompt is empty")
    assert "Loaded" not in result.output


def test_too_little_to_train_a_drafter_on_is_a_clear_error():
    from multidecode.training.trainees import check_enough

    with pytest.raises(multidecode.InvalidInput, match="too few prompts to train on"):
        check_enough(0)


def test_a_document_in_another_encoding(model_dir, tmp_path):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    assert_clean_error(run("ask", "--model", model_dir, "--document", latin, "-q", "why?"), "not UTF-8 text")


def test_a_missing_document_file(model_dir, tmp_path):
    assert_clean_error(run("ask", "--model", model_dir, "--document", tmp_path / "nope.txt", "-q", "why?"),
                       "does not exist")


def test_bad_sampling_settings(model_dir, doc):
    assert_clean_error(run("ask", "--model", model_dir, "--document", doc, "-q", "why?", "--temperature", -1),
                       "--temperature must be 0 (greedy) or more")  # (0 is greedy here, as on the server)
    assert_clean_error(run("ask", "--model", model_dir, "--document", doc, "-q", "why?", "--top-p", 1.5),
                       "--top-p must be in (0, 1]", "hint: 1, or leaving it unset, turns it off")
    assert_clean_error(run("ask", "--model", model_dir, "--document", doc, "-q", "why?", "--min-p", 1.5),
                       "--min-p must be in [0, 1]", "hint: 0, or leaving it unset, turns it off")


def test_the_temperature_help_says_what_a_sampling_command_samples_at():
    """complete and vote sample by default, yet their help said --temperature "turns sampling on"."""
    for command, default in (("complete", "default 1;"), ("vote", "default 0.7;"), ("ask", "turns sampling on")):
        assert default in " ".join(run(command, "--help").output.split()), command


def test_every_error_the_library_raises_is_exported_by_the_package():
    """multidecode.NotBitExact (named in MultiDecoder's docstring) and MissingExtra raised AttributeError."""
    import inspect

    from multidecode import errors

    defined = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, errors.MultiDecodeError)}
    assert defined <= set(multidecode.__all__), defined - set(multidecode.__all__)
    assert all(getattr(multidecode, name) is getattr(errors, name) for name in defined)


def test_text_without_a_tokenizer_is_refused_naming_the_fix():
    """MultiDecoder(model, None) took token ids, but text ended in "'NoneType' object is not callable"."""
    decoder = _small_decoder(tokenizer=None)
    for call in (lambda: decoder.generate("hi"), lambda: decoder.complete("hi", n=2),
                 lambda: decoder.ask("a document", ["why?"])):
        with pytest.raises(multidecode.InvalidArgument, match="no tokenizer, so it cannot read text") as caught:
            call()
        assert "token ids" in caught.value.hint
    assert decoder.generate([1, 2, 3], max_new_tokens=2).token_ids  # ids need no tokenizer


def test_a_model_or_a_switch_of_the_wrong_type_is_named():
    """load(5) was "'5' is not a local path ... the hub is unreachable" after a network probe;
    exact="no" ran as True; decode("gpt2", ...) was told to pass a tokenizer second."""
    with pytest.raises(multidecode.InvalidArgument, match="load takes a model's name or path, got int"):
        multidecode.load(5)
    for call in (lambda: multidecode.load(exact="no"), lambda: multidecode.load(compile=1),
                 lambda: multidecode.decode(_tiny_llama(400), [1, 2], [[3]], max_new_tokens=1, exact="x")):
        with pytest.raises(multidecode.InvalidArgument, match="must be True or False"):
            call()
    with pytest.raises(multidecode.InvalidArgument, match="got the name 'gpt2'") as caught:
        multidecode.decode("gpt2", [1, 2], [[3]], max_new_tokens=1)
    assert "multidecode.load('gpt2')" in caught.value.hint


def test_vote_refuses_logprobs_it_would_drop():
    decoder = _small_decoder()
    with pytest.raises(multidecode.InvalidArgument, match="vote keeps no log-probabilities") as caught:
        decoder.vote("why?", n=2, max_new_tokens=2, logprobs=1)
    assert "complete(" in caught.value.hint


def test_start_given_text_or_one_prompt_says_what_it_takes():
    """start("hello") said "prompt 0 must be a sequence of token ids, got 'h'": the text cut into letters."""
    decoder = _small_decoder()
    with pytest.raises(multidecode.InvalidInput, match="got text") as caught:
        decoder.start("hello", max_new_tokens=2)
    assert "generate" in caught.value.hint
    with pytest.raises(multidecode.InvalidInput, match="got one prompt's token ids") as caught:
        decoder.start([1, 2, 3], max_new_tokens=2)
    assert "start([ids])" in caught.value.hint
    assert len(decoder.start([[1, 2, 3]], max_new_tokens=2).branches) == 1


@pytest.mark.parametrize("settings", [dict(max_ngram=0), dict(min_ngram=3, max_ngram=2), dict(min_ngram=1.5),
                                      dict(max_matches=0)])
def test_prompt_lookup_settings_are_checked_with_a_hint(settings):
    """PromptLookup(max_ngram=0) raised a bare ValueError; max_matches=0 was taken."""
    with pytest.raises(multidecode.InvalidArgument) as caught:
        multidecode.PromptLookup(**settings)
    assert caught.value.hint


def test_library_errors_name_the_problem():
    """The same checks hold for library callers, as typed exceptions."""
    decoder = _small_decoder()
    with pytest.raises(multidecode.InvalidInput, match="document is empty"):
        decoder.ask("", ["why?"])
    with pytest.raises(multidecode.InvalidInput, match="no questions"):
        decoder.ask("text", [])
    with pytest.raises(multidecode.InvalidInput, match="one string"):
        decoder.ask("text", "why?")
    with pytest.raises(multidecode.PromptTooLong, match="at most 64 positions") as caught:
        decoder.ask("routers and cables " * 100, ["why?"])
    assert "margins" in caught.value.hint  # the strategy made for documents longer than the window
    with pytest.raises(multidecode.InvalidInput, match="unknown setting.s. temprature: neither an argument"):
        decoder.ask("text", ["why?"], temprature=0.5)
    with pytest.raises(multidecode.InvalidInput, match="speculate: neither an argument of this call nor a sampling"):
        decoder.margins("text", "why?", speculate="lookup")  # was called an unknown *sampling* setting
    for only_complete in ({"n": 2}, {"sample": True}):  # was a TypeError: generate passes both itself
        with pytest.raises(multidecode.InvalidArgument, match=f"one completion and takes no {next(iter(only_complete))}="):
            decoder.generate("text", **only_complete)
        with pytest.raises(multidecode.InvalidArgument, match="one completion"):
            decoder.stream_generate("text", **only_complete)
    with pytest.raises(multidecode.PromptTooLong, match="more than the model's 64") as caught:  # not NotEnoughMemory
        decoder.generate("text", max_new_tokens=10**12)
    assert "never fed back" in caught.value.message  # prompt + new - 1 positions read as an off-by-one
    with pytest.raises(multidecode.PromptTooLong, match="more than the model's 64"):
        decoder.complete("text", n=2, max_new_tokens=10**12)
    with torch.no_grad():
        assert decoder.ask("text", ["why?"], max_new_tokens=2)[0].finish_reason in ("stop", "length")


def test_what_is_not_a_model_is_named_as_such():
    """MultiDecoder(tokenizer, model), decode(None, ...) and decode(tokenizer, ...) were
    AttributeErrors from inside ('TokenizersBackend has no attribute config'); two precisions at
    once (load(precision=, dtype=)) were resolved silently for one of them."""
    model, tokenizer = _tiny_llama(400), tiny_tokenizer()
    with pytest.raises(multidecode.InvalidArgument, match="got TokenizersBackend.*model first, then its tokenizer"):
        multidecode.MultiDecoder(tokenizer, model)
    with pytest.raises(multidecode.InvalidArgument, match="must be a transformers causal LM.*got None"):
        multidecode.decode(None, [1], [[2]], max_new_tokens=2)
    with pytest.raises(multidecode.InvalidArgument, match="got TokenizersBackend"):
        multidecode.decode(tokenizer, [1], [[2]], max_new_tokens=2)
    with pytest.raises(multidecode.InvalidArgument, match="ask for two precisions"):
        multidecode.load("unused", precision="float32", dtype="bfloat16")
    with pytest.raises(multidecode.ModelNotFound):  # two spellings of one precision: on to the (missing) model
        multidecode.load("/nonexistent/model", precision="bf16", dtype=torch.bfloat16)


def test_a_model_without_weights_is_named_as_such():
    """A model built under torch.device("meta") failed inside transformers ("Tensor.item() cannot be
    called on meta tensors"), or inside multidecode with exact=False ("Cannot copy out of meta tensor")."""
    with torch.device("meta"):
        model = _tiny_llama(400)
    for call in (lambda: multidecode.decode(model, [1, 2], [[3]], max_new_tokens=2),
                 lambda: multidecode.decode(model, [1, 2], [[3]], max_new_tokens=2, exact=False),
                 lambda: multidecode.MultiDecoder(model, None)):
        with pytest.raises(multidecode.InvalidArgument, match="weights are on the meta device") as caught:
            call()
        assert "load its weights first" in caught.value.hint


def test_decode_takes_branches_from_a_generator():
    """A generator of branches failed with "object of type 'generator' has no len()" (ask takes one)."""
    model = _tiny_llama(400)
    branches = [[3], [4, 5], []]
    assert multidecode.decode(model, [1, 2], (b for b in branches), max_new_tokens=3) == \
        multidecode.decode(model, [1, 2], branches, max_new_tokens=3)


def test_token_level_settings_are_checked_before_the_prompt_is_read():
    """`stream_decode` passed a misspelt setting on to an internal function ('admit() got an
    unexpected keyword argument'), and a logprobs out of range failed inside torch's topk after the
    prefill; now both are named, as `MultiDecoder`'s methods name theirs."""
    from multidecode.api import stream_decode

    model = _tiny_llama(400)
    with pytest.raises(multidecode.InvalidArgument, match="unknown setting.*: temprature") as typo:
        list(stream_decode(model, [1, 2], [[3]], max_new_tokens=2, temprature=0.5))
    assert "temperature" in typo.value.hint and "logprobs" in typo.value.hint
    for wrong in (-1, 401, "5", 2.0):
        with pytest.raises(multidecode.InvalidArgument, match="logprobs must be a whole number from 0 to .* 400"):
            list(stream_decode(model, [1, 2], [[3]], max_new_tokens=2, logprobs=wrong))
    with pytest.raises(multidecode.InvalidArgument, match="sampling= and temperature were both given"):
        list(stream_decode(model, [1, 2], [[3]], max_new_tokens=2, sampling=[None], temperature=0.5))
    events = list(stream_decode(model, [1, 2], [[3]], max_new_tokens=2, logprobs=400))
    assert [len(e.top_logprobs) for e in events] == [400, 400]


def test_arguments_of_the_wrong_kind_are_named_not_taken(tmp_path):
    """Each of these was taken silently (chat="x" as True, an instruction of 5 as text, strict="x"
    as strict, eos id -1 as an id, a negative forest budget) or said something else ("the grammar
    is empty" for 5, ". holds no config.json" for load(""))."""
    from multidecode.batch import BatchSettings, open_batch

    decoder = _small_decoder()
    with pytest.raises(multidecode.InvalidArgument, match="chat must be True, False or None"):
        decoder.generate("text", max_new_tokens=2, chat="x")
    with pytest.raises(multidecode.InvalidArgument, match="instruction must be text, got int"):
        decoder.ask("text", ["why?"], max_new_tokens=2, instruction=5)
    with pytest.raises(multidecode.InvalidArgument, match="eos_token_id must name token ids"):
        decoder.generate([1, 2], max_new_tokens=2, eos_token_id=-1)
    with pytest.raises(multidecode.InvalidArgument, match="strict must be True or False"):
        multidecode.Constraint.json_schema({"type": "string"}, strict="x")
    with pytest.raises(multidecode.InvalidArgument, match="a grammar must be text, got int"):
        multidecode.Constraint.grammar(5)
    with pytest.raises(multidecode.ModelNotFound, match="the model name is empty"):
        multidecode.load("")
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"document": "text", "questions": ["why?"]}) + "\n")
    with open_batch(source, tmp_path / "out.jsonl", BatchSettings(max_new_tokens=2)) as job:
        for budget, message in ((dict(forest_tokens=-1), "forest_tokens must be 0 or"),
                                (dict(forest_branches=0), "forest_branches must be a positive")):
            with pytest.raises(multidecode.InvalidArgument, match=message):
                next(job.run(decoder, **budget))
    events = list(decoder.start([[1, 2, 3]], max_new_tokens=2, logprobs=1).events)
    assert [len(e.top_logprobs) for e in events] == [1, 1] and all(e.logprob is not None for e in events)


def test_questions_and_prompts_may_come_as_any_sequence_or_iterable():
    """A generator or a `map` of questions was consumed by the check and then 'there are no
    prompts'; a NumPy array of questions or ids, or a 2-d tensor of ids, raised its truth-value
    error; a generator of prompts, 'object of type generator has no len()'."""
    import numpy as np

    decoder = _small_decoder()
    questions = ["why?", "who?"]
    expected = [a.text for a in decoder.ask("text", questions, max_new_tokens=3)]
    for given in ((q for q in questions), map(str.strip, questions), np.array(questions), tuple(questions)):
        assert [a.text for a in decoder.ask("text", given, max_new_tokens=3)] == expected, type(given)

    def decoded(prompts) -> list[list[int]]:
        run = decoder.start(prompts, max_new_tokens=3, eos_token_id=[])
        out = [[], []]
        for event in run.events:
            out[event.branch].append(event.token_id)
        return out

    ids = [[5, 6, 7], [8, 9, 10]]
    for given in (np.array(ids), torch.tensor(ids), (row for row in ids)):
        assert decoded(given) == decoded(ids), type(given)
    decoder = multidecode.MultiDecoder(_tiny_llama(400, max_position_embeddings=512),  # margins' prompts are longer
                                       tiny_tokenizer())
    chunks = ["The router drops.", "The cable was cut."]  # margins' chunks, given as a list or not
    expected = repr(decoder.margins(chunks, "why?", max_new_tokens=2))
    for given in ((c for c in chunks), np.array(chunks)):
        assert repr(decoder.margins(given, "why?", max_new_tokens=2)) == expected, type(given)


@pytest.mark.parametrize("how", ["one", "branches", "beam", "speculating"])
def test_a_prompt_and_its_new_tokens_may_fill_the_model_to_its_last_position(how):
    """The last new token is never fed: P + max_new_tokens - 1 positions suffice, as transformers'
    `generate` has them (it was refused one token early, with a hint of 'lower max_new_tokens to
    0'). GPT-2's learned positions fail past the last, so this also shows none is fed past it."""
    from multidecode.exact import exact_kernels
    from multidecode.strategies.beam import run_beam_search

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=400, n_positions=32, n_embd=16, n_layer=1, n_head=2)).eval()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8] * 2  # 24 tokens: 9 new ones reach position 31, the last
    if how == "one":
        got = multidecode.decode(model, prompt, [[]], max_new_tokens=9, eos_token_id=[])[0]
    elif how == "branches":
        got = multidecode.decode(model, prompt[:22], [prompt[22:], prompt[22:]], max_new_tokens=9, eos_token_id=[])[1]
    elif how == "beam":
        got = run_beam_search(model, prompt, num_beams=1, max_new_tokens=9, eos_token_id=[]).beams[0].token_ids
    else:
        got = multidecode.decode(model, prompt, [[]], max_new_tokens=9, eos_token_id=[], speculate="lookup")[0]
    with exact_kernels(model):
        assert got == reference_generate(model, prompt, max_new_tokens=9)
    with pytest.raises(multidecode.PromptTooLong, match="lower max_new_tokens to 9"):
        multidecode.decode(model, prompt, [[]], max_new_tokens=10, eos_token_id=[])


def _tiny_llama(vocab_size: int = 64, **config):
    """A one-layer random Llama (`config`: other settings of its `LlamaConfig`)."""
    config = tf.LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, **config)
    return tf.LlamaForCausalLM(config).eval()


_KEEP = object()


def _small_decoder(tokenizer=_KEEP):
    """A decoder of a one-layer Llama of 400 tokens and 64 positions, with the tiny byte tokenizer
    unless another (or None) is given."""
    return multidecode.MultiDecoder(_tiny_llama(400, max_position_embeddings=64),
                                    tiny_tokenizer() if tokenizer is _KEEP else tokenizer)


def test_a_model_whose_forward_takes_no_position_ids_is_refused():
    """BART's decoder is a causal LM, but it derives positions from the cache length, so tree
    positions would be silently ignored: refuse it rather than decode wrong tokens."""
    config = tf.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                           is_encoder_decoder=False)
    model = tf.BartForCausalLM(config).eval()
    with pytest.raises(multidecode.UnsupportedModel, match="position_ids"):
        multidecode.decode(model, [1, 2], [[3], [4, 5]], max_new_tokens=2)


@pytest.mark.parametrize("prefix, branches, needle", [
    ([1, 2], [7, 8, 9], "branch 0 must be a sequence of token ids"),      # flat, not one list per branch
    (torch.tensor([[1, 2]]), [[3]], "shape (1, 2)"),                      # a batch tensor as the prefix
    ([1, 2], [["hello"]], "must be a sequence of token ids"),             # text, not ids
    ([1, 64], [[3]], "token id 64, outside the model's vocabulary of 64"),
    ([1, 2], [[-1]], "token id -1"),
    ([1, 2], [[True]], "must be a sequence of token ids"),
])
def test_token_ids_that_cannot_be_fed_are_named(prefix, branches, needle):
    with pytest.raises(multidecode.InvalidInput, match=re.escape(needle)):
        multidecode.decode(_tiny_llama(), prefix, branches, max_new_tokens=1)


def test_token_ids_may_be_tensors():
    model = _tiny_llama()
    as_lists = multidecode.decode(model, [1, 2], [[3], [4, 5]], max_new_tokens=3)
    as_tensors = multidecode.decode(model, torch.tensor([1, 2]), [torch.tensor([3]), torch.tensor([4, 5])],
                                    max_new_tokens=3)
    assert as_tensors == as_lists


@pytest.mark.parametrize("settings, needle", [
    ({"seed": "3"}, "seed must be an integer"),
    ({"temperature": "0.7"}, "temperature must be a number"),
    ({"do_sample": "yes"}, "do_sample must be True or False"),
    ({"top_k": 2.5}, r"top_k must be 0 \(off\) or a positive integer"),
])
def test_sampling_settings_of_the_wrong_kind_are_named(settings, needle):
    with pytest.raises(multidecode.InvalidArgument, match=needle):
        multidecode.decode(_tiny_llama(), [1, 2], [[3]], max_new_tokens=1, **settings)


@pytest.mark.parametrize("eos, needle", [("12", "eos_token_id must be a token id"), ([1.5], "eos_token_id")])
def test_eos_ids_of_the_wrong_kind_are_named(eos, needle):
    with pytest.raises(multidecode.InvalidArgument, match=needle):
        multidecode.decode(_tiny_llama(), [1, 2], [[3]], max_new_tokens=1, eos_token_id=eos)


@pytest.mark.parametrize("stop", [[""], [3], ["ok", None]])
def test_stop_strings_must_be_non_empty_text(stop):
    decoder = multidecode.MultiDecoder(_tiny_llama(vocab_size=400), tiny_tokenizer())
    with pytest.raises(multidecode.InvalidArgument, match="a stop string must be non-empty text, got "):
        decoder.ask("text", ["why?"], max_new_tokens=2, stop=stop)


def test_brackets_in_user_text_are_printed_as_they_are(model_dir, tmp_path):
    """Error lines are rich markup: a path with brackets must neither crash the printer nor lose text."""
    assert_clean_error(run("ask", "--model", model_dir, "--document", tmp_path / "notes[draft].txt", "-q", "why?"),
                       "notes[draft].txt does not exist")
    assert_clean_error(run("ask", "--model", model_dir, "--document", tmp_path / "x[/b]", "-q", "why?"),
                       "x[/b] does not exist")


@pytest.mark.parametrize("device, needle", [("meta", "not supported"), ("tpu", "unknown device")]
                         + ([] if torch.cuda.is_available() else [("cuda", "no usable CUDA")]))
def test_a_device_that_cannot_be_used(model_dir, doc, device, needle):
    assert_clean_error(run("ask", "--model", model_dir, "--document", doc, "-q", "why?", "--device", device), needle)


def test_a_seed_out_of_range(model_dir, doc):
    assert_clean_error(run("ask", "--model", model_dir, "--document", doc, "-q", "why?", "--seed", 2**70),
                       "--seed must be an integer from 0 to 2**64 - 1")


def test_text_with_a_lone_surrogate_is_refused():
    decoder = multidecode.MultiDecoder(_tiny_llama(vocab_size=400), tiny_tokenizer())
    with pytest.raises(multidecode.InvalidInput, match="not valid Unicode"):
        decoder.ask("text", ["caf\udce9?"])


def test_stdin_cannot_feed_both_the_document_and_the_questions(model_dir):
    assert_clean_error(run("ask", "--model", model_dir, "--document", "-", "--questions-file", "-", stdin="hi\n"),
                       "cannot both read standard input")


@pytest.mark.parametrize("args", [["ask", "--document", "-", "-q", "q?"], ["generate", "--prompt-file", "-"]])
def test_stdin_cannot_feed_both_the_text_and_the_schema(model_dir, args):
    assert_clean_error(run(*args, "--model", model_dir, "--json-schema", "-", stdin='{"type": "object"}'),
                       "JSON schema cannot both read standard input")


def test_a_huge_n_is_checked_at_once(model_dir):
    """The early check reads the settings once, not once per completion: n = 10^8 whose last seed
    overflows is refused in a moment (it built 10^8 settings first, for minutes)."""
    assert_clean_error(run("complete", "--model", model_dir, "-p", "hi", "-n", 10**8, "--seed", 2**64 - 2),
                       f"seed {2**64 - 2} gives the last of 100000000 branches the seed", "2**64 - 100000000")


def test_a_seed_in_range_whose_last_completion_is_not_is_named_as_given(model_dir):
    """--seed 2**64 - 1 with -n 2 said "--seed must be ... got 18446744073709551616": a seed nobody typed."""
    result = run("complete", "--model", model_dir, "-p", "hi", "-n", 2, "--seed", 2**64 - 1)
    assert_clean_error(result, f"seed {2**64 - 1} gives the last of 2 branches the seed {2**64 - 1} + 1")
    assert str(2**64) not in result.output


@pytest.mark.parametrize(("args", "needle"), [
    (["complete", "-p", "hi", "-n"], "n 100000000000000000000 is past 2**63 - 1"),
    (["vote", "-q", "hi", "-n"], "n 100000000000000000000 is past 2**63 - 1"),
    (["beam", "-p", "hi", "-b"], "--num-beams 100000000000000000000 is past 2**63 - 1"),
    (["generate", "-p", "hi", "--top-k"], "--top-k must be 0 (off) or a positive integer below 2**63"),
])
def test_counts_past_what_a_list_or_int64_holds_are_named(model_dir, args, needle):
    """Counts of 2**63 or more passed the checks and ended in an OverflowError traceback (a list
    of settings per branch, torch's int64 top-k)."""
    assert_clean_error(run(args[0], "--model", model_dir, *args[1:], 10**20, "--max-new-tokens", 2), needle)


def test_greedy_and_sampling_flags_together_are_refused(model_dir):
    assert_clean_error(run("complete", "--model", model_dir, "-p", "hi", "--greedy", "--temperature", 0.5),
                       "--greedy cannot be combined with --temperature")


@pytest.mark.parametrize("args, needle", [
    (["sample", "--ns", "0"], "--ns needs positive integers"),
    (["beam", "--beams", "x"], "--beams must be comma-separated integers"),
    (["ask", "--threads", "0"], "--threads must be 1 or more"),
    (["ask", "--max-new-tokens", "0"], "--max-new-tokens must be 1 or more"),
    (["margins", "--repeats", "0"], "--repeats must be 1 or more"),
    (["beam", "--precision", "fp8"], "unknown precision 'fp8'"),
    (["ask", "--dtype", "float16"], "float16 has no fast kernels on a CPU"),
    (["beam", "--beams", "1,4"], "--beams needs 2 beams or more each, got 1,4"),
    (["speculate", "--budget", "nan"], "--budget must be a positive number of seconds, got nan"),
])
def test_bench_settings_are_checked_before_the_run(args, needle, tmp_path):
    """... and a refused run leaves no --output folder behind (the folder was made first)."""
    out = tmp_path / "out" / "deep"
    assert_clean_error(run("bench", *args, "--output", out, "--model", tmp_path / "no-model"), needle)
    assert not (tmp_path / "out").exists()


def test_bench_startup_refuses_a_model_that_is_no_gguf_file_before_any_process(tmp_path):
    """It started its processes, and their failure came back as a RuntimeError traceback."""
    text = tmp_path / "model.txt"
    text.write_text("not a model")
    for model, needle in ((tmp_path / "none.gguf", "the path does not exist"), (text, "is not a GGUF file")):
        assert_clean_error(run("bench", "startup", "--model", model, "--no-llama", "--repeats", 1, "--output",
                               tmp_path / "out"), needle)


def test_bench_redraw_draws_every_result_it_can_and_names_the_rest(tmp_path):
    """It stopped at the first file that was not a result, and a damaged one ended in a traceback."""
    import json
    import shutil

    shipped = Path(__file__).resolve().parents[1] / "docs" / "results" / "bench_sample.json"
    good = Path(shutil.copy(shipped, tmp_path / "a_good.json"))
    damaged = tmp_path / "b_damaged.json"
    damaged.write_text(json.dumps({**json.loads(shipped.read_text()), "metadata": None}))
    blocked = Path(shutil.copy(shipped, tmp_path / "c_blocked.json"))
    (tmp_path / "c_blocked.md").mkdir()
    result = run("bench", "redraw", damaged, good, blocked)
    assert_clean_error(result, "b_damaged.json is not a multidecode benchmark result (AttributeError",
                       "c_blocked.json: cannot write", "Is a directory")
    assert "wrote" in result.stdout and (tmp_path / "a_good.md").is_file()


def test_a_result_that_cannot_be_drawn_leaves_its_pair_as_it_was_and_a_full_disk_names_the_file(tmp_path, monkeypatch):
    """redraw wrote the PNG, then failed on the markdown (a result without `metadata.date`): the
    new PNG beside the old .md; a full disk said "cannot write  (No space left on device)"."""
    import json
    import shutil

    from multidecode.bench import results

    shipped = Path(__file__).resolve().parents[1] / "docs" / "results" / "bench_sample.json"
    for suffix in (".json", ".png", ".md"):
        shutil.copy(shipped.with_suffix(suffix), tmp_path / f"r{suffix}")
    data = json.loads(shipped.read_text())
    del data["metadata"]["date"]
    (tmp_path / "r.json").write_text(json.dumps(data))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert_clean_error(run("bench", "redraw", tmp_path / "r.json"), "is not a multidecode benchmark result")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    shutil.copy(shipped, tmp_path / "r.json")

    def full(path, chunks, **settings):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results, "replace_atomically", full)
    assert_clean_error(run("bench", "redraw", tmp_path / "r.json"), f"cannot write {tmp_path / 'r.png'} (No space")


def test_a_finished_bench_run_whose_files_cannot_be_written_keeps_its_result(tmp_path, capsys):
    """Its files written at the end of a run that may take an hour: a path taken by a folder ended
    in a traceback; the JSON is kept (or printed) and the error says where."""
    import json

    from multidecode.cli.bench import run_and_report

    shipped = Path(__file__).resolve().parents[1] / "docs" / "results" / "bench_sample.json"
    result = json.loads(shipped.read_text())
    (tmp_path / "bench_sample.md").mkdir()
    with pytest.raises(multidecode.InvalidInput, match="cannot write .*bench_sample.md") as caught:
        run_and_report("sample", lambda progress: result, tmp_path, None)
    assert f"the result is in {tmp_path / 'bench_sample.json'}" in caught.value.hint
    (tmp_path / "other.json").mkdir()  # the JSON itself cannot be written: printed, and nothing half-written stays
    with pytest.raises(multidecode.InvalidInput, match="cannot write the result in") as caught:
        run_and_report("sample", lambda progress: result, tmp_path, "other")
    assert "printed above as JSON" in caught.value.hint and json.loads(capsys.readouterr().out) == result
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_sample.json", "bench_sample.md", "bench_sample.png",
                                                          "other.json"]


def test_demo_settings_are_checked_before_the_model_loads(tmp_path):
    """demo --max-new-tokens 0 loaded the model and printed its header before it was refused."""
    result = run("demo", "--max-new-tokens", 0, "--model", tmp_path / "no-model")
    assert_clean_error(result, "--max-new-tokens must be a positive integer")
    assert "no-model" not in result.output and "support-call" not in result.output


def test_bench_output_that_is_a_file(tmp_path):
    taken = tmp_path / "results"
    taken.write_text("not a folder")
    assert_clean_error(run("bench", "ask", "--output", taken), "is a file, not a folder")


def test_a_bench_stem_with_folders_is_refused_before_the_run(tmp_path):
    """--stem names the files, --output the folder: a stem with a folder in it failed only when
    the finished run wrote its results, and the measurements were lost."""
    assert_clean_error(run("bench", "sample", "--stem", "a/b", "--output", tmp_path / "out", "--model",
                           tmp_path / "no-model"), "--stem 'a/b' is not a file name")


@pytest.mark.parametrize("content", ["{}", "not json", '{"benchmark": "sample"}'])
def test_redrawing_a_file_that_is_no_result_is_a_clean_error(tmp_path, content):
    path = tmp_path / "result.json"
    path.write_text(content)
    assert_clean_error(run("bench", "redraw", path), "is not a multidecode benchmark result")


def test_an_unwritable_model_cache_is_named(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MULTIDECODE_CACHE", str(blocker / "cache"))
    with pytest.raises(multidecode.CacheUnwritable, match="cannot write the float32 copy") as whole:
        multidecode.models.converted.embedded_copy()
    assert "MULTIDECODE_CACHE" in whole.value.hint and "4 bytes per parameter" in whole.value.hint
    with pytest.raises(multidecode.CacheUnwritable, match="cannot write the config and tokenizer") as described:
        multidecode.models.converted.embedded_copy(described=True)  # what a packed load writes: no weights
    assert "a few MB" in described.value.hint


def _tiny(config, model_class, impl="eager"):
    config._attn_implementation = impl
    torch.manual_seed(0)
    return model_class(config).eval()


SMALL = dict(vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
REFUSED_CONFIGS = {
    "bert, bidirectional": (lambda: _tiny(tf.BertConfig(**SMALL, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                        num_attention_heads=2, is_decoder=False), tf.BertLMHeadModel, "sdpa"),
                            "bidirectional"),
    "gpt-neo, local layers": (lambda: _tiny(tf.GPTNeoConfig(**SMALL, hidden_size=16, num_layers=2, num_heads=2,
                                                            attention_types=[[["global", "local"], 1]], window_size=4),
                                            tf.GPTNeoForCausalLM), "window by cache slot"),
    "llama 4, temperature": (lambda: _tiny(tf.Llama4TextConfig(**SMALL, hidden_size=16, intermediate_size=32,
                                                               intermediate_size_mlp=32, num_hidden_layers=2,
                                                               num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                                               num_local_experts=2, num_experts_per_tok=1,
                                                               attention_chunk_size=None),
                                           tf.Llama4ForCausalLM, "sdpa"), "temperature"),
    "openai-gpt": (lambda: _tiny(tf.OpenAIGPTConfig(**SMALL, n_embd=16, n_layer=1, n_head=2), tf.OpenAIGPTLMHeadModel),
                   "4D mask"),
    "bigbird, bidirectional": (lambda: _tiny(tf.BigBirdConfig(**SMALL, hidden_size=16, intermediate_size=32,
                                                              num_hidden_layers=1, num_attention_heads=2,
                                                              attention_type="original_full", sep_token_id=3),
                                             tf.BigBirdForCausalLM), "bidirectional"),
    "megatron-bert, bidirectional": (lambda: _tiny(tf.MegatronBertConfig(**SMALL, hidden_size=16, intermediate_size=32,
                                                                         num_hidden_layers=1, num_attention_heads=2),
                                                   tf.MegatronBertForCausalLM), "bidirectional"),
    "rembert, bidirectional": (lambda: _tiny(tf.RemBertConfig(**SMALL, hidden_size=16, input_embedding_size=16,
                                                              output_embedding_size=16, intermediate_size=32,
                                                              num_hidden_layers=1, num_attention_heads=2),
                                             tf.RemBertForCausalLM), "bidirectional"),
    "reformer, hashed": (lambda: _tiny(tf.ReformerConfig(**SMALL, hidden_size=16, attention_head_size=8,
                                                         num_attention_heads=2, feed_forward_size=32,
                                                         axial_pos_embds=False, max_position_embeddings=64,
                                                         attn_layers=["local", "lsh"], is_decoder=True,
                                                         local_attn_chunk_length=8, lsh_attn_chunk_length=8),
                                       tf.ReformerModelWithLMHead), "hashed and chunked"),
    "xlm, own mask": (lambda: _tiny(tf.XLMConfig(**SMALL, emb_dim=16, n_layers=1, n_heads=2, causal=True),
                                    tf.XLMWithLMHeadModel), "mask from lengths"),
    "dory, last_loop": (lambda: _tiny(tf.DoryConfig(**SMALL, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                                    num_key_value_heads=1, head_dim=8, n_input_layers=1,
                                                    n_output_layers=1, recurrent_kv_cache_mode="last_loop",
                                                    sliding_window=8), tf.DoryForCausalLM, "sdpa"),
                        "last_loop"),
}


@pytest.mark.parametrize("name", REFUSED_CONFIGS)
@pytest.mark.parametrize("exact", [True, False])
def test_models_that_read_cache_slots_or_see_ahead_are_refused_in_both_modes(name, exact):
    """Each of these ran as a forest and gave other tokens than alone, silently (GPT-Neo's local
    layers, Llama 4's attention temperature and Dory's last_loop window read cache slots, not
    positions; BERT, BigBird, MegatronBERT and RemBERT as causal LMs without `is_decoder` attend
    both ways), or failed inside transformers (OpenAI GPT's and XLM's own attention, Reformer's
    hashed buckets): refused, with
    the kernels (exact=True) and without them, since without them is where a refusal's hint leads."""
    make, reason = REFUSED_CONFIGS[name]
    with pytest.raises(multidecode.UnsupportedModel, match=reason):
        multidecode.decode(make(), [1, 5, 6, 7], [[], [9, 10]], max_new_tokens=3, eos_token_id=[], exact=exact)


def test_the_same_families_configured_to_read_positions_still_run():
    """The refusals above read the configuration, not the family: GPT-Neo with global layers only
    and BERT as a decoder run, and exactly."""
    for model in (_tiny(tf.GPTNeoConfig(**SMALL, hidden_size=16, num_layers=2, num_heads=2,
                                        attention_types=[[["global"], 2]]), tf.GPTNeoForCausalLM),
                  _tiny(tf.BertConfig(**SMALL, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, is_decoder=True), tf.BertLMHeadModel, "sdpa")):
        prefix, branches = [1, 5, 6, 7], [[], [9, 10]]
        together = multidecode.decode(model, prefix, branches, max_new_tokens=5, eos_token_id=[], exact=False)
        for branch, got in zip(branches, together):
            assert got == reference_generate(model, prefix + branch, max_new_tokens=5, eos_token_id=[NO_EOS])


def _command(*arguments: str, **popen) -> subprocess.CompletedProcess:
    """`python -m multidecode ARGUMENTS` in a process of its own, this checkout's source first."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    return subprocess.run([sys.executable, "-m", "multidecode", *arguments], text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": src}, **popen)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("arguments", [("--help",), ("cache", "list")])
def test_standard_output_that_cannot_be_written_is_an_error_line(arguments, cache):
    """`> /dev/full` (a full disk) ended every command, --help too, with an OSError's traceback."""
    with open("/dev/full", "w") as full:
        done = _command(*arguments, stdout=full, stderr=subprocess.PIPE)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "cannot write the output: No space left on device" in done.stderr


@pytest.mark.xdist_group("cli")
def test_a_reader_of_standard_error_that_leaves_does_not_end_the_work(model_dir, tmp_path):
    """`multidecode batch ... 2>&1 | head -1` ended the job with status 1 before it began: the line
    that said the model had loaded found the pipe gone (rich's default). The job now goes on quietly."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": i, "document": f"Caller {i} asked about a cable."}) + "\n"
                              for i in "ab"))
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as gone:
        done = _command("batch", str(source), "-q", "Who called?", "-o", str(out), "--model", str(model_dir),
                        "--max-new-tokens", "3", stdout=subprocess.PIPE, stderr=gone)
    assert done.returncode == 0
    assert len(out.read_text().splitlines()) == 2


def test_a_reader_that_leaves_ends_the_command_quietly_with_0():
    """`multidecode ask ... | head -1` exited 1 without a word: rich's console ends a command whose
    pipe is gone with 1, which a pipeline reads as a failure. Standard output's console ends it with 0."""
    import subprocess
    import sys
    from pathlib import Path

    from multidecode.cli import common

    assert isinstance(common.stdout, common.Output)
    code = ("import os\nfrom multidecode.cli.common import Output\nread, write = os.pipe()\nos.close(read)\n"
            "Output(file=os.fdopen(write, 'w')).print('an answer ' * 10000)\n")
    src = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": src})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_only_a_leading_setting_of_the_command_is_written_as_its_option():
    """The option's name stands for the library's at the head of an error (the user typed the
    option); a message that only starts with the same word, or a setting the command lacks, stays."""
    import click

    from multidecode.cli.common import in_option_terms

    command = click.Command("c", params=[click.Option(["--max-new-tokens"]), click.Option(["-q", "--question"])])
    with click.Context(command):
        assert in_option_terms("max_new_tokens must be a positive integer, got 0") == \
            "--max-new-tokens must be a positive integer, got 0"
        assert in_option_terms("question 1 is empty") == "question 1 is empty"
        assert in_option_terms("top_k must be 0 (off)") == "top_k must be 0 (off)"
    assert in_option_terms("max_new_tokens must be a positive integer") == "max_new_tokens must be a positive integer"


def test_a_schema_or_grammar_file_that_cannot_be_used_is_named(model_dir, tmp_path):
    """"the JSON schema is not valid JSON: ..." named no file, among the command's several inputs."""
    schema, grammar = tmp_path / "answer.schema.json", tmp_path / "answer.lark"
    schema.write_text("{not json")
    grammar.write_text("start: (((")
    assert_clean_error(run("generate", "--model", model_dir, "-p", "hi", "--json-schema", schema),
                       f"{schema}: the JSON schema is not valid JSON")
    assert_clean_error(run("generate", "--model", model_dir, "-p", "hi", "--json-schema", "-", stdin="{not json"),
                       "standard input: the JSON schema is not valid JSON")
    assert_clean_error(run("generate", "--model", model_dir, "-p", "hi", "--grammar", grammar), f"{grammar}: ")
