"""`multidecode generate --server URL`: the request sent to a running server gives the tokens the
command gives when it loads the model itself, the command imports no torch on that path, and a
server whose model is not the one asked for (or a setting the protocol cannot carry) is refused
before anything is sent."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from serving import MODEL, running_server, tiny_loader

from multidecode.cli import main
from multidecode.cli.common import SAMPLING_OPTIONS, model_source
from multidecode.sampling_params import SAMPLING_SWITCHES, per_branch_sampling

pytestmark = pytest.mark.xdist_group("cli")

PROMPT = "hello, the router is old"


@pytest.fixture(scope="module")
def served(model_dir):
    """A server of the tiny model that says how it was loaded, as `multidecode serve` does."""
    with running_server(tiny_loader(model_dir), source={"model": model_source(str(model_dir)),
                                                         "precision": "auto"}) as running:
        yield running


def _generate(*args) -> dict:
    result = CliRunner().invoke(main, ["generate", "--max-new-tokens", "12", "--json", *map(str, args)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("settings", [
    [], ["--no-chat"], ["--seed", "7", "--temperature", "0.9"], ["--top-k", "5", "--seed", "3"],
    ["--presence-penalty", "1.5", "--logit-bias", "5=3"], ["--stop", "e", "--echo"], ["--speculate", "lookup"],
    ["--top-k", "0"], ["--temperature", "0", "--top-p", "0.5"], ["--temperature", "1e-7", "--seed", "5"],
], ids=["greedy", "no-chat", "sampled", "top-k", "penalties", "stop-echo", "speculating", "top-k-0-is-off",
        "temperature-0-is-greedy", "tiny-temperature-samples"])
def test_a_served_generate_equals_the_local_one(served, model_dir, settings):
    here = _generate("--model", model_dir, "-p", PROMPT, *settings)
    there = _generate("--server", served.url, "-p", PROMPT, *settings)
    for key in ("text", "token_ids", "finish_reason", "prompt_tokens", "seed"):
        assert there[key] == here[key], key
    assert there["server"] == served.url and there["stats"]["forward_passes"] >= 1


def test_streamed_text_and_stats_come_from_the_server(served, model_dir, monkeypatch):
    monkeypatch.setenv("MULTIDECODE_SERVER", served.url)  # the variable stands for --server
    here = _generate("--model", model_dir, "-p", PROMPT)
    result = CliRunner().invoke(main, ["generate", "-p", PROMPT, "--max-new-tokens", "12", "--stats"])
    assert result.exit_code == 0, result.output
    assert result.stdout == here["text"] + "\n"
    assert f"on the server at {served.url}" in result.stderr and "tokens per forward" in result.stderr


def test_token_ids_stream_one_a_chunk_and_come_whole(served):
    client = served.client()
    extra = {"return_token_ids": True}
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, extra_body=extra)
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       extra_body=extra)
    streamed = [i for chunk in chunks for choice in chunk.choices for i in choice.model_extra["token_ids"]]
    ids = whole.choices[0].model_extra["token_ids"]
    assert streamed == ids and len(ids) == whole.usage.completion_tokens
    assert "token_ids" not in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                                        temperature=0).choices[0].model_extra


@pytest.mark.parametrize("args, message", [
    (["--model", "HuggingFaceTB/SmolLM2-360M"], "serves"),
    (["--precision", "int8"], "runs --precision auto, not int8"),
    (["--device", "cuda"], "runs --device cpu, not cuda"),
    (["--regex", "[a-z]+"], "--regex cannot be sent to a server"),
    (["--draft-budget", "3"], "--draft-budget cannot be sent"),
    (["--temperature", "3"], "refused the request"),
])
def test_a_server_that_cannot_give_the_asked_tokens_is_refused(served, args, message):
    result = CliRunner().invoke(main, ["generate", "--server", served.url, "-p", PROMPT, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "hint:" in result.output and "Traceback" not in result.output


def test_a_url_with_no_multidecode_server_at_it_says_so(served):
    """A path after the port (or another program) answered 404, told to "change what it names"."""
    result = CliRunner().invoke(main, ["generate", "--server", served.url + "/foo", "-p", PROMPT])
    assert result.exit_code == 2, result.output
    assert "no multidecode server answers at" in result.output and "no path after them" in result.output


def test_precisions_and_devices_are_compared_in_any_spelling(served):
    """A server reports its precision canonical (auto); --precision AUTO or --device CPU is that one,
    not a mismatch, and an unknown name is said to be unknown."""
    assert _generate("--server", served.url, "-p", PROMPT, "--precision", "AUTO", "--device", "CPU")["token_ids"]
    result = CliRunner().invoke(main, ["generate", "--server", served.url, "-p", PROMPT, "--precision", "bogus"])
    assert result.exit_code == 2 and "unknown precision 'bogus'" in result.output, result.output


def test_a_folder_here_named_as_the_served_model_is_that_folder(served, tmp_path, monkeypatch):
    """--model tiny, where ./tiny is another model folder, was taken as the server's model "tiny"."""
    (tmp_path / MODEL).mkdir()
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["generate", "--server", served.url, "-p", PROMPT, "--model", MODEL])
    assert result.exit_code == 2 and "serves" in result.output, result.output


def test_a_blank_server_variable_is_no_server(model_dir, monkeypatch):
    """MULTIDECODE_SERVER=" " (a variable set from an empty one, with a space) was an AttributeError."""
    monkeypatch.setenv("MULTIDECODE_SERVER", " ")
    result = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "-p", PROMPT, "--max-new-tokens", "3"])
    assert result.exit_code == 0 and "on the server" not in result.stderr, result.output


def test_a_negative_top_k_is_refused_here_and_on_the_way_to_a_server(served, model_dir):
    """-1 turned sampling on through a server (where it means off) and was refused here."""
    for where in (["--model", str(model_dir)], ["--server", served.url]):
        result = CliRunner().invoke(main, ["generate", *where, "-p", PROMPT, "--top-k", "-1"])
        assert result.exit_code == 2 and "--top-k must be 0 (off) or a positive integer" in result.output, where



@pytest.mark.parametrize("args", [["--max-new-tokens", "0"], ["--top-p", "2"], ["--seed", "-5"], ["--min-p", "1.5"],
                                  ["--repetition-penalty", "0"], ["--presence-penalty", "3"], ["--logit-bias", "5=200"]])
def test_a_setting_refused_here_is_refused_in_the_same_words_on_the_way_to_a_server(served, model_dir, args):
    """They reached the server and came back as its fields ("max_tokens: Input should be greater
    than or equal to 1" for --max-new-tokens 0)."""
    said = []
    for where in (["--model", str(model_dir)], ["--server", served.url]):
        result = CliRunner().invoke(main, ["generate", *where, "-p", PROMPT, *args])
        assert result.exit_code == 2, result.output
        said.append([line for line in result.output.splitlines() if line.startswith(("error:", "hint:"))])
    assert said[0] == said[1] and said[0], said

@pytest.mark.parametrize("health, models", [
    (b"<html>hello</html>", b""),  # a web server
    (b"", b'{"object": "list", "data": [{"id": "llama", "object": "model"}]}'),  # another OpenAI-compatible server
    (b'{"status": "ok"}', b'[1, 2]'),
])
def test_a_server_that_is_not_multidecodes_is_named_as_such(health, models):
    """Its /health or /v1/models read as JSON failed with a traceback, and another OpenAI-compatible
    server answered with text and no token ids: an empty line and "0 tokens", or a KeyError."""
    import http.server
    import threading

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = health if self.path == "/health" else models
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        result = CliRunner().invoke(main, ["generate", "--server", f"127.0.0.1:{other.server_port}", "-p", PROMPT])
        other.shutdown()
    assert result.exit_code == 2 and "is not multidecode serve" in result.output, result.output
    assert "Traceback" not in result.output


def test_no_server_at_the_address_is_a_clear_error():
    result = CliRunner().invoke(main, ["generate", "--server", "http://127.0.0.1:1", "-p", PROMPT])
    assert result.exit_code == 2 and "no server answers at http://127.0.0.1:1" in result.output


def test_the_served_path_imports_no_torch(served):
    """Nor does loading the decoding commands' modules (each imports its strategy when it runs)."""
    code = ("import sys; from multidecode.cli import main, decoding\n"
            f"sys.argv = ['multidecode', 'generate', '--server', {served.url!r}, '-p', {PROMPT!r}, "
            "'--max-new-tokens', '4']\n"
            "try:\n    main()\nexcept SystemExit as exit:\n    assert not exit.code, exit.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')")
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("no torch")


@pytest.mark.parametrize("option", [name for name, _, _ in SAMPLING_OPTIONS] + ["--logit-bias"])
def test_the_commands_sampling_switches_are_the_librarys(option):
    key = option[2:].replace("-", "_")
    value = {"logit_bias": {1: 1.0}, "top_k": 5, "seed": 1}.get(key, 0.5 if key != "repetition_penalty" else 1.2)
    assert per_branch_sampling(1, {key: value})[0].do_sample == (key in SAMPLING_SWITCHES)



@pytest.mark.parametrize("temperature", [0, 1e-7, 9e-6, 0.5])
def test_the_servers_greedy_temperature_is_the_librarys(temperature):
    """One rule: only temperature 0 is greedy, on the server as in the library and the command (a
    server that took a tiny temperature as greedy left `generate --server` reporting a seed it never used)."""
    from local_models import tiny_tokenizer

    from multidecode.serving.protocol import CompletionBody, parse_body, to_job

    tokenizer = tiny_tokenizer()
    body = parse_body(json.dumps({"model": "tiny", "prompt": PROMPT, "temperature": temperature, "seed": 4}).encode(),
                 "application/json", CompletionBody)
    served = to_job(body, tokenizer, vocab_size=len(tokenizer), max_positions=None).sampling[0]
    local = per_branch_sampling(1, {"temperature": temperature, "seed": 4})[0]
    assert (served.do_sample, served.seed) == (local.do_sample, local.seed) == ((True, 4) if temperature else (False, None))

@pytest.mark.embedded
def test_the_embedded_models_chat_reply_is_the_same_on_its_server():
    """The chat route (the embedded model has a chat template; the tiny one has none)."""
    from multidecode.models.loading import load_model_and_tokenizer

    prompt = "What is the capital of France? Answer in one word."
    with running_server(load_model_and_tokenizer, source={"model": None, "precision": "auto"}) as running:
        there = _generate("--server", running.url, "-p", prompt, "--max-new-tokens", "8")
    here = _generate("-p", prompt, "--max-new-tokens", "8")
    assert there["token_ids"] == here["token_ids"] and there["text"] == here["text"]
    assert there["prompt_tokens"] == here["prompt_tokens"] > 20  # the chat template's turn around the prompt


@pytest.mark.embedded
def test_ask_on_the_server_answers_as_ask_here(tmp_path):
    """`ask --server`: the questions as one request (the server's questions extension), the same
    answers, token ids and prompt lengths as ask run here; streamed, the same text."""
    from multidecode.models.loading import load_model_and_tokenizer

    document = tmp_path / "call.txt"
    document.write_text("Caller: Dana Reyes. Her router drops the connection every evening since Monday. "
                        "The agent reset the line and booked a technician for Friday.", encoding="utf-8")
    args = ["ask", "--document", str(document), "-q", "Who called?", "-q", "When does the technician come?",
            "--max-new-tokens", "10"]
    runner = CliRunner()
    here = runner.invoke(main, [*args, "--json"])
    with running_server(load_model_and_tokenizer, source={"model": None, "precision": "auto"}) as running:
        there = runner.invoke(main, [*args, "--json", "--server", running.url])
        streamed = runner.invoke(main, [*args, "--server", running.url])
        sampled_there = runner.invoke(main, [*args, "--json", "--seed", "5", "--server", running.url])
    sampled_here = runner.invoke(main, [*args, "--json", "--seed", "5"])
    assert here.exit_code == there.exit_code == streamed.exit_code == 0, there.output
    assert json.loads(there.stdout) == json.loads(here.stdout)
    assert json.loads(sampled_there.stdout) == json.loads(sampled_here.stdout)  # question i drew with seed 5 + i
    assert [row["seed"] for row in json.loads(sampled_here.stdout)] == [5, 6]
    for row in json.loads(here.stdout):
        assert row["answer"].strip() in streamed.stdout


def _complete(*args) -> list[dict]:
    result = CliRunner().invoke(main, ["complete", "--max-new-tokens", "8", "--json", *map(str, args)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("settings", [["--n", "3", "--seed", "3"], ["--n", "2", "--greedy"], ["--n", "2", "--temperature", "0"],
                                      ["--n", "2", "--temperature", "0.7", "--top-p", "0.9", "--seed", "11"],
                                      ["--n", "3", "--seed", "3", "--logprobs"], ["--n", "2", "--no-chat", "--seed", "4", "--logprobs"]],
                         ids=["seeded", "greedy", "temperature-0", "warped", "logprobs", "logprobs-no-chat"])
def test_a_served_complete_equals_the_local_one(served, model_dir, settings):
    here = _complete("--model", model_dir, "-p", PROMPT, *settings)
    there = _complete("--server", served.url, "-p", PROMPT, *settings)
    assert there == here  # every field the command prints
    if "--logprobs" in settings:
        assert all(len(c["logprobs"]) == len(c["token_ids"]) and c["logprob"] == sum(c["logprobs"]) for c in here)


def test_the_seeds_a_served_complete_reports_reproduce_it_here(served, model_dir):
    there = _complete("--server", served.url, "-p", PROMPT, "--n", "2")
    assert there[1]["seed"] == there[0]["seed"] + 1
    here = _complete("--model", model_dir, "-p", PROMPT, "--n", "2", "--seed", there[0]["seed"])
    assert [c["token_ids"] for c in here] == [c["token_ids"] for c in there]


def test_a_command_waits_for_a_server_that_is_loading_its_model(model_dir):
    def slow_loader():
        time.sleep(1.5)
        return tiny_loader(model_dir)()

    with running_server(slow_loader, background=True, source={"model": model_source(str(model_dir))}) as running:
        result = CliRunner().invoke(main, ["generate", "--server", running.url, "-p", PROMPT, "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert "Waiting for the server" in result.stderr


def test_a_server_whose_model_failed_to_load_is_a_clear_error():
    def broken_loader():
        raise RuntimeError("no such weights")

    with running_server(broken_loader, background=True) as running:
        result = CliRunner().invoke(main, ["generate", "--server", running.url, "-p", PROMPT])
    assert result.exit_code == 2 and "its /health says failed" in result.output and "Traceback" not in result.output


def test_a_schema_holds_the_served_output_as_it_holds_the_local_one(served, model_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}), encoding="utf-8")
    here = _generate("--model", model_dir, "-p", PROMPT, "--json-schema", schema, "--max-new-tokens", "24")
    there = _generate("--server", served.url, "-p", PROMPT, "--json-schema", schema, "--max-new-tokens", "24")
    for key in ("text", "token_ids", "finish_reason", "parsed"):
        assert there[key] == here[key], key
    assert here["finish_reason"] == "stop" and isinstance(here["parsed"]["ok"], bool)


def test_a_number_an_eos_ended_is_whole_with_stop_strings_too(served, model_dir, tmp_path):
    """With --stop, the client could not tell an eos from a stop string, and gave "parsed": null
    where the local run gave the number: the server names its eos ids, and the last token id says."""
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"type": "integer", "minimum": 10, "maximum": 99}), encoding="utf-8")
    asked = ("-p", PROMPT, "--json-schema", path, "--max-new-tokens", "8", "--stop", "zzz")
    here, there = _generate("--model", model_dir, *asked), _generate("--server", served.url, *asked)
    assert here["finish_reason"] == "stop" and isinstance(here["parsed"], int)
    assert (there["token_ids"], there["parsed"]) == (here["token_ids"], here["parsed"])


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "integer", "minimum": 1000000},
], ids=["object", "integer"])
def test_a_served_output_cut_at_max_tokens_is_parsed_as_the_local_one(served, model_dir, tmp_path, schema):
    """Cut before its eos (the value whole) or inside its value: `parsed` the same here and there,
    null where the value may have gone on, and the note on stderr only then."""
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema), encoding="utf-8")
    whole = _generate("--model", model_dir, "-p", PROMPT, "--json-schema", path, "--max-new-tokens", "40")
    assert whole["finish_reason"] == "stop" or schema["type"] == "integer"
    for budget in (len(whole["token_ids"]) - 1, 1):
        asked = ("-p", PROMPT, "--json-schema", path, "--max-new-tokens", budget)
        here, there = _generate("--model", model_dir, *asked), _generate("--server", served.url, *asked)
        assert (there["token_ids"], there["finish_reason"], there["parsed"]) == \
               (here["token_ids"], here["finish_reason"], here["parsed"])
        value_whole = whole["finish_reason"] == "stop" and budget == len(whole["token_ids"]) - 1
        if value_whole and schema["type"] == "object":  # only its eos was cut
            assert here["finish_reason"] == "length" and here["parsed"] == whole["parsed"] is not None
        if budget == 1 or schema["type"] == "integer":  # a number cut at max_tokens may have gone on
            assert here["parsed"] is None
        for where in (("--model", model_dir), ("--server", served.url)):
            printed = CliRunner().invoke(main, ["generate", *map(str, where + asked)])
            assert printed.exit_code == 0, printed.output
            assert ("reached --max-new-tokens" in printed.stderr) == (here["parsed"] is None), where


def test_a_schema_file_that_is_not_json_is_refused_before_the_server_is_asked(tmp_path):
    for schema in ("not json {", "[1, 2]"):
        (tmp_path / "bad.json").write_text(schema, encoding="utf-8")
        result = CliRunner().invoke(main, ["generate", "--server", "http://127.0.0.1:1", "-p", PROMPT,
                                           "--json-schema", str(tmp_path / "bad.json")])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert "JSON schema" in result.output and "hint:" in result.output


def test_ask_checks_its_seed_for_every_question_on_the_way_to_a_server(served, model_dir, tmp_path):
    """The seed was checked for one branch: 2**64 - 1 with two questions reached the server."""
    document = tmp_path / "doc.txt"
    document.write_text("A short document.")
    said = []
    for where in (["--model", str(model_dir)], ["--server", served.url]):
        result = CliRunner().invoke(main, ["ask", *where, "--document", str(document), "-q", "why?", "-q", "how?",
                                           "--seed", str(2**64 - 1)])
        assert result.exit_code == 2, result.output
        said.append([line for line in result.output.splitlines() if line.startswith(("error:", "hint:"))])
    assert said[0] == said[1] and "past 2**64 - 1" in said[0][0], said
