"""One meaning for `speculate=`: `SpeculationSettings` parsed and checked before a model loads,
built into a fresh `Speculation` per run, and taken alike by Python, the CLI and the server."""

from __future__ import annotations

import socket

import pytest
import torch
from click.testing import CliRunner
from serving import MODEL, running_server, tiny_loader

import multidecode
from multidecode import InvalidArgument
from multidecode.cli import main
from multidecode.proposers.lookahead import Lookahead
from multidecode.speculation import SpeculationSettings, build_speculation

F32, BF16 = torch.float32, torch.bfloat16


def test_modes_and_their_details_parse():
    assert SpeculationSettings.parse(None) == SpeculationSettings.parse("off") == SpeculationSettings()
    assert SpeculationSettings.parse(" Lookup ", budget=4) == SpeculationSettings("lookup", 4)
    assert SpeculationSettings.parse("lookahead", lookahead="7,5,3").lookahead == (7, 5, 3)
    assert SpeculationSettings.parse("lookahead", lookahead=[4, 3, 2]).lookahead == (4, 3, 2)
    assert SpeculationSettings.parse(skip_layers="1,3-5") == SpeculationSettings("draft", skip_layers=(1, 3, 4, 5))
    assert SpeculationSettings.parse("auto", draft_model="m").mode == "draft"  # a draft implies "draft"
    assert SpeculationSettings.parse(skip_layers="auto").skip_layers == "auto"


@pytest.mark.parametrize("arguments, message", [
    (dict(mode="hydra"), "unknown speculation mode"),
    (dict(mode="off", budget=4), "^budget needs speculation, and speculate is 'off'"),  # parse's own name, not draft_budget
    (dict(mode="lookup", skip_layers="1"), "but speculate is 'lookup'"),
    (dict(mode="lookup", lookahead="7,5,7"), "lookahead sets lookahead decoding"),
    (dict(mode="lookahead", lookahead="7,5"), "is not three integers"),
    (dict(mode="lookahead", lookahead="1,2,1"), "W=1 with N=2 leaves no lookahead window"),  # was refused at the run
    (dict(mode="lookahead", lookahead="7,5,0"), "need W >= 1, N >= 2 and G >= 1"),  # was refused at the run
    (dict(mode="draft", skip_layers="1-x"), "not a list of layer numbers"),
    (dict(mode="draft", skip_layers="5-2"), r"runs backwards \(5-2\).*2-5"),  # was (): the target as its own draft
    (dict(mode="draft", skip_layers="1-"), "not a list of layer numbers"),  # was (1,)
    (dict(draft_model="a", skip_layers="1"), "both name a draft"),
    (dict(mode="lookup", budget=0), "positive integer"),
    (dict(mode="off", draft_model="m"), "draft_model names a draft, but speculate is 'off'"),  # off said: not overridden
    (dict(mode="off", skip_layers="1"), "names a draft, but speculate is 'off'"),
    (dict(mode=" OFF ", head="h"), "names a draft, but speculate is 'off'"),
])
def test_bad_settings_are_refused_in_python_terms(arguments, message):
    with pytest.raises(InvalidArgument, match=message):
        SpeculationSettings.parse(**arguments)


def test_the_examples_in_the_hints_are_python_too():
    """The hints wrote examples as options ("write e.g. lookahead 7,5,7") to Python callers."""
    for arguments, example in ((dict(mode="lookahead", lookahead="0,5,7"), "lookahead='7,5,7'"),
                               (dict(mode="draft", skip_layers="1-x"), "skip_layers='4,6,8-12'")):
        with pytest.raises(InvalidArgument) as caught:
            SpeculationSettings.parse(**arguments)
        assert example in caught.value.hint, caught.value.hint


def test_a_proposer_must_be_one_and_a_self_draft_must_skip_a_layer():
    """A class with `propose` and `observe` that is no `Proposer` was 'unknown speculation mode
    <__main__.Plain object at 0x...>'; a self-draft asked to skip no layer ran the target as its
    draft (`self_draft(model, [])` itself stays: the identity draft the tests check acceptance with)."""
    from tiny_models import tiny_model

    from multidecode import self_draft
    from multidecode.speculation import build_speculation

    class Plain:
        def propose(self, context, budget):
            return None

        def observe(self, context, accepted):
            pass

    for value in (Plain(), True, 3):
        with pytest.raises(InvalidArgument, match="neither a mode's name nor a proposer") as refused:
            build_speculation(value, torch.float32)
        assert "subclass of multidecode.Proposer" in refused.value.hint
    model = tiny_model("llama", "sdpa")
    for draft in (model, self_draft(model, [1])):  # its repr was the message: every layer, kilobytes of it
        with pytest.raises(InvalidArgument, match=r"got a model \(LlamaForCausalLM\)") as refused:
            build_speculation(draft, torch.float32)
        assert len(refused.value.message) < 100 and "DraftModel(model)" in refused.value.hint
    with pytest.raises(InvalidArgument, match="names no layer"):
        SpeculationSettings.parse("draft", skip_layers=[])
    with pytest.raises(InvalidArgument, match="7, 8, 9, 10, 11 and 95 more are not layer indices"):
        self_draft(model, range(7, 107))


def test_check_refuses_what_cannot_run_before_anything_loads():
    SpeculationSettings("auto").check(BF16)  # auto then does not speculate
    with pytest.raises(InvalidArgument, match="cannot be exact in bfloat16"):
        SpeculationSettings("lookup").check(BF16)
    with pytest.raises(InvalidArgument, match="needs a draft model"):
        SpeculationSettings("draft").check(F32)
    SpeculationSettings("draft").check(F32, draft=object())  # the caller's own draft model


def test_build_gives_a_fresh_proposer_with_the_details():
    settings = SpeculationSettings.parse("lookahead", budget=5, lookahead="4,3,2")
    first, second = build_speculation(settings, F32), build_speculation(settings, F32)
    assert isinstance(first.proposer, Lookahead) and first.proposer is not second.proposer
    assert (first.proposer.window, first.proposer.ngram, first.proposer.guesses, first.budget) == (4, 3, 2, 5)
    assert build_speculation(SpeculationSettings(), F32) is None and build_speculation("off", F32) is None
    assert build_speculation(SpeculationSettings("auto"), BF16) is None


def test_with_mode_keeps_the_details_that_apply():
    server = SpeculationSettings.parse("lookahead", budget=3, lookahead="4,3,2")
    assert server.with_mode("lookup") == SpeculationSettings("lookup", 3)
    assert server.with_mode("lookahead") == server
    assert server.with_mode("off") == SpeculationSettings()
    drafting = SpeculationSettings.parse(skip_layers="1")
    assert drafting.with_mode("draft") == drafting and drafting.with_mode("suffix").skip_layers is None


def test_python_takes_what_the_cli_offers_a_self_draft_by_its_layers(model_dir):
    decoder = multidecode.load(str(model_dir))
    settings = SpeculationSettings.parse(skip_layers=[1])
    plain = decoder.generate("hello there", max_new_tokens=12, speculate=None, eos_token_id=[])
    drafted = decoder.generate("hello there", max_new_tokens=12, speculate=settings, eos_token_id=[])
    assert drafted.token_ids == plain.token_ids and drafted.stats["speculate"] == "draft"
    assert drafted.stats["drafted"] > 0
    assert decoder.draft_for(settings) is decoder.draft_for(SpeculationSettings.parse("draft", skip_layers="1"))
    lookahead = decoder.generate("hello there", max_new_tokens=12, eos_token_id=[],
                                 speculate=SpeculationSettings.parse("lookahead", lookahead="3,3,3"))
    assert lookahead.token_ids == plain.token_ids


def test_the_server_drafts_with_its_own_draft_model_when_a_request_asks(model_dir):
    settings = SpeculationSettings.parse(skip_layers="1")
    with running_server(tiny_loader(model_dir)) as plain_server, \
            running_server(tiny_loader(model_dir), speculate=settings) as drafting:
        asked = dict(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0)
        expected = plain_server.client().completions.create(**asked).choices[0].text
        reply = drafting.client().completions.create(**asked, extra_body={"speculate": "draft"})
        assert reply.choices[0].text == expected and reply.model_extra["multidecode"]["speculate"] == "draft"
        by_default = drafting.client().completions.create(**asked)  # the server's own setting
        assert by_default.model_extra["multidecode"]["speculate"] == "draft"
        off = drafting.client().completions.create(**asked, extra_body={"speculate": "off"})
        assert off.choices[0].text == expected and off.model_extra["multidecode"]["speculate"] is None
        with pytest.raises(Exception, match="has none"):
            plain_server.client().completions.create(**asked, extra_body={"speculate": "draft"})


@pytest.mark.parametrize("port, message", [("99999", "--port must be from 0 to 65535"),
                                           ("-1", "--port must be from 0 to 65535")])
def test_serve_refuses_a_port_out_of_range(port, message):
    result = CliRunner().invoke(main, ["serve", "--port", port])
    assert result.exit_code == 2 and message in result.output and "hint:" in result.output
    assert "Traceback" not in result.output and "Serving" not in result.output


def test_serve_refuses_a_port_in_use_before_loading_anything():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        result = CliRunner().invoke(main, ["serve", "--port", str(busy.getsockname()[1])])
    assert result.exit_code == 2 and "cannot listen on 127.0.0.1" in result.output
    assert "another program is using that port" in result.output and "Serving" not in result.output


@pytest.mark.parametrize("option, message", [(["--precision", "float64"], "unknown precision"),
                                             (["--device", "tpu"], "unknown device")])
def test_serve_refuses_a_bad_precision_or_device_before_saying_where_it_listens(option, message):
    result = CliRunner().invoke(main, ["serve", "--port", "0", *option])
    assert result.exit_code == 2 and message in result.output and "Serving" not in result.output


@pytest.mark.parametrize("make, message", [(lambda tmp: tmp / "missing", "the path does not exist"),
                                           (lambda tmp: tmp, "holds no config.json"),
                                           (lambda tmp: tmp / "notes.txt", "is a file but not a .gguf model")])
def test_serve_refuses_a_model_path_that_holds_no_model_before_saying_where_it_listens(tmp_path, make, message):
    (tmp_path / "notes.txt").write_text("not a model")
    result = CliRunner().invoke(main, ["serve", "--port", "0", "--model", str(make(tmp_path))])
    assert result.exit_code == 2 and message in result.output and "Serving" not in result.output, result.output


@pytest.mark.parametrize("origin", ["localhost:3000", "http://localhost:3000/app", "https://*.example.org",
                                    "http://user@localhost:3000", "http://localhost:abc", "notanorigin"])
def test_serve_refuses_an_allowed_origin_no_browser_sends_before_saying_where_it_listens(origin):
    result = CliRunner().invoke(main, ["serve", "--port", "0", "--allowed-origin", origin])
    assert result.exit_code == 2 and "is not an origin a browser sends" in result.output, result.output
    assert "Serving" not in result.output and "http://localhost:3000" in result.output


def test_allowed_origins_are_kept_as_browsers_send_them():
    from multidecode.serving.app import ServeState

    sent = ["*", "null", "http://localhost:3000/", "https://chat.example.org:8443", "HTTP://LocalHost:80",
            "https://a.example:443", "http://[::1]:3000", "chrome-extension://abcdef", "tauri://localhost"]
    assert ServeState("m", allowed_origins=sent).allowed_origins == (
        "*", "null", "http://localhost:3000", "https://chat.example.org:8443", "http://localhost", "https://a.example",
        "http://[::1]:3000", "chrome-extension://abcdef", "tauri://localhost")


def test_serve_refuses_an_address_of_another_machine():
    result = CliRunner().invoke(main, ["serve", "--host", "192.0.2.1", "--port", "0"])  # TEST-NET-1: never ours
    assert result.exit_code == 2 and "cannot listen on 192.0.2.1" in result.output
