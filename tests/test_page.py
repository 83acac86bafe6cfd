"""The live page (`GET /`) in a real headless browser: Debian's Chromium driven by Playwright.

A tiny random model serves on a free loopback port; the page is loaded from it and used as a
person would: it loads, a question streams an answer (text in a card, a finish reason, a drawing
of the forest with nodes) and an empty document shows the server's error. `make test-browser`
installs Chromium when it is missing and runs these tests; without Chromium or the playwright
package they are skipped, with the reason.
"""

from __future__ import annotations

import os
import shutil

import pytest
from serving import MODEL, running_server, tiny_loader

pytestmark = pytest.mark.browser

# Without the background-networking flags Chromium reaches out to Google's services at start,
# and a closed network refuses those connections.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOCUMENT = "Here is a document about routers, cables and support tickets."
QUESTIONS = ["What is the document about?", "Who answers the tickets?"]
TIMEOUT_MS = 30_000


def chromium_path() -> str | None:
    return (os.environ.get("MULTIDECODE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
            or (os.path.exists("/usr/bin/chromium") and "/usr/bin/chromium") or None)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the browser tests need the playwright package (pip install -e '.[browser]')")
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium: `make test-browser` installs it (apt-get install chromium), "
                    "or point MULTIDECODE_CHROMIUM at one")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_page(browser, url: str, model: str | None = MODEL):
    """A fresh tab on the page; JavaScript errors and requests leaving the server are recorded."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.problems = []
    page.on("pageerror", lambda error: page.problems.append(f"JavaScript error: {error}"))
    page.on("request", lambda request: request.url.startswith((url, "data:"))
            or page.problems.append(f"a request off the server: {request.url}"))
    response = page.goto(url + "/")
    assert response.status == 200
    assert response.headers["content-type"].startswith("text/html")
    if model is not None:
        page.wait_for_function("(name) => document.getElementById('model-name').textContent === name", arg=model)
    return page


@pytest.fixture
def page(browser, server):
    page = open_page(browser, server.url)
    yield page
    problems = page.problems
    page.context.close()
    assert not problems


def ask(page, document: str, questions: list[str], *, max_tokens: int = 8) -> None:
    page.fill("#document", document)
    page.fill("#questions", "\n".join(questions))
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.click("#run")


def wait_finished(page) -> str:
    page.wait_for_function("document.body.dataset.state !== 'running' && document.body.dataset.state !== 'idle'")
    return page.evaluate("document.body.dataset.state")


def test_the_page_loads(page):
    assert "multidecode" in page.title()
    for selector in ("#document", "#questions", "#max-tokens", "#temperature", "#api-key", "#run"):
        assert page.is_visible(selector), selector
    assert page.input_value("#temperature") == "0"
    assert page.is_hidden("#error")
    page.click("#mode-n")  # one prompt and n instead of a document and questions
    assert page.is_visible("#prompt") and page.is_visible("#n") and page.is_hidden("#document")
    page.click("#mode-questions")
    assert page.is_visible("#document") and page.is_hidden("#prompt")


def test_a_question_streams_an_answer(page, server):
    # Count the updates of the answer cards, to see text arrive in pieces rather than at the end.
    page.evaluate("""() => {
        window.updates = 0;
        new MutationObserver((records) => { window.updates += records.length; })
            .observe(document.getElementById('cards'), {subtree: true, childList: true, characterData: true});
    }""")
    ask(page, DOCUMENT, QUESTIONS)
    assert wait_finished(page) == "done"
    assert page.is_hidden("#error")

    cards = page.locator(".card")
    assert cards.count() == len(QUESTIONS)
    texts = [cards.nth(i).locator(".text").inner_text() for i in range(len(QUESTIONS))]
    reasons = [cards.nth(i).locator(".finish").inner_text() for i in range(len(QUESTIONS))]
    assert all(reason in ("stop", "length") for reason in reasons), reasons
    assert any(texts), "no card got any text"
    assert page.evaluate("window.updates") > 2 * len(QUESTIONS)

    # The page shows what the API answers (greedy, so the same text), leading whitespace aside.
    reply = server.client().completions.create(model=MODEL, prompt=DOCUMENT, max_tokens=8, temperature=0,
                                               extra_body={"questions": QUESTIONS})
    by_index = sorted(reply.choices, key=lambda c: c.index)
    assert texts == [c.text.lstrip() for c in by_index]
    assert reasons == [c.finish_reason for c in by_index]

    # The forest: the prompt as compressed boxes, generated tokens as nodes, every branch finished.
    assert page.locator("#forest .seg-box").count() >= 1
    assert page.locator("#forest .tok").count() >= 1
    assert page.locator("#forest .end").count() == len(QUESTIONS)
    shared = page.locator("#forest .seg-box").first.locator("title").text_content()
    assert "shared by 2 branches" in shared

    # The summary line: tokens (the usage's count), forwards and time.
    assert page.inner_text("#s-tokens").split()[0] == str(reply.usage.completion_tokens)
    assert int(page.inner_text("#s-forwards").split()[0]) >= 1
    assert page.inner_text("#s-time").split()[0] != "–"


def test_an_empty_document_shows_the_error(page):
    ask(page, "", QUESTIONS)
    assert wait_finished(page) == "error"
    assert page.is_visible("#error")
    message = page.inner_text("#error")
    assert "400" in message and "document" in message and "empty" in message  # the server's own words
    assert page.locator(".card .finish").first.inner_text() == "error"
    # the next request goes through, and the error goes away
    ask(page, DOCUMENT, QUESTIONS[:1], max_tokens=4)
    assert wait_finished(page) == "done"
    assert page.is_hidden("#error")


def test_one_prompt_and_n_choices(page):
    page.click("#mode-n")
    page.fill("#prompt", "The quick brown fox")
    page.fill("#n", "3")
    page.fill("#max-tokens", "5")
    page.click("#run")
    assert wait_finished(page) == "done"
    assert page.locator(".card").count() == 3
    assert all(reason in ("stop", "length") for reason in page.locator(".card .finish").all_inner_texts())
    assert page.locator("#forest .end").count() == 3


@pytest.mark.parametrize("max_tokens", [2, 5])
def test_the_chat_endpoint(page, max_tokens):
    page.select_option("#endpoint", "chat")
    ask(page, DOCUMENT, QUESTIONS, max_tokens=max_tokens)
    assert wait_finished(page) == "done"
    assert all(reason in ("stop", "length") for reason in page.locator(".card .finish").all_inner_texts())
    assert page.locator("#forest .end").count() == len(QUESTIONS)
    # each card counts its tokens, not its chunks (a chat choice ends on a chunk of its own)
    counts = [int(text.split()[0]) for text in page.locator(".card .count").all_inner_texts()]
    assert sum(counts) == int(page.inner_text("#s-tokens").split()[0]) and max(counts) <= max_tokens


def test_the_api_key_is_sent(browser, model_dir):
    with running_server(tiny_loader(model_dir), api_key="sesame") as locked:
        page = open_page(browser, locked.url, model=None)
        page.wait_for_function("document.getElementById('model-name').textContent === 'API key needed'")
        ask(page, DOCUMENT, QUESTIONS[:1], max_tokens=4)
        assert wait_finished(page) == "error"
        assert "API key needed" in page.inner_text("#error")
        page.fill("#api-key", "sesame")
        page.click("#run")
        assert wait_finished(page) == "done", page.inner_text("#error")
        assert page.is_hidden("#error")
        assert page.inner_text("#model-name") == MODEL
        assert not page.problems
        page.context.close()


def sent_bodies(page) -> list[dict]:
    """The JSON bodies the page posts from now on."""
    import json

    bodies: list[dict] = []
    page.on("request", lambda request: request.method == "POST" and bodies.append(json.loads(request.post_data)))
    return bodies


def test_any_temperature_and_n_are_sent_and_a_hidden_modes_fields_hold_nothing_back(page):
    """Temperature 0.75 was refused by the browser (steps of 0.1), n past 64 too (the server takes
    up to --max-branches), and an n the browser refused in the hidden mode silently kept the other
    mode's Run from sending anything."""
    bodies = sent_bodies(page)
    page.click("#mode-n")
    page.fill("#n", "100")
    page.fill("#prompt", "The quick brown fox")
    page.fill("#max-tokens", "1")
    page.fill("#temperature", "0.75")
    page.click("#run")
    assert wait_finished(page) == "done", page.inner_text("#error")
    assert bodies[-1]["n"] == 100 and bodies[-1]["temperature"] == 0.75
    page.fill("#n", "0")  # out of range, in the mode about to be hidden
    page.click("#mode-questions")
    ask(page, DOCUMENT, QUESTIONS, max_tokens=2)
    assert wait_finished(page) == "done", page.inner_text("#error")
    assert bodies[-1]["questions"] == QUESTIONS and "n" not in bodies[-1]


def test_speculate_off_is_sent_and_the_servers_default_is_left_to_it(page):
    """"off" was left out of the request, so a server started with --speculate speculated."""
    bodies = sent_bodies(page)
    for choice, sent in (("off", "off"), ("", None)):
        page.select_option("#speculate", choice)
        ask(page, DOCUMENT, QUESTIONS[:1], max_tokens=2)
        assert wait_finished(page) == "done", page.inner_text("#error")
        assert bodies[-1].get("speculate") == sent, bodies[-1]


def test_each_run_asks_the_model_served_now(page):
    """The page read /v1/models once: after a restart under another name every run was a 404 until
    the tab was reloaded, under a green badge with the old name."""
    bodies = sent_bodies(page)
    page.route("**/v1/models", lambda route: route.fulfill(
        status=200, content_type="application/json",
        body='{"object": "list", "data": [{"id": "renamed", "object": "model"}]}'))
    ask(page, DOCUMENT, QUESTIONS[:1], max_tokens=2)
    assert wait_finished(page) == "error"  # this server serves MODEL, not "renamed": its 404, in its words
    assert bodies[-1]["model"] == "renamed" and "does not exist" in page.inner_text("#error")
    assert page.inner_text("#model-name") == "renamed"
    page.unroute("**/v1/models")
    ask(page, DOCUMENT, QUESTIONS[:1], max_tokens=2)
    assert wait_finished(page) == "done", page.inner_text("#error")
    assert bodies[-1]["model"] == MODEL and page.inner_text("#model-name") == MODEL


def test_an_api_key_a_header_cannot_carry_is_named(page):
    """A key with a curly quote made fetch throw: the page said the server was unreachable."""
    page.fill("#api-key", "s\u00e9same\u2019")
    ask(page, DOCUMENT, QUESTIONS[:1], max_tokens=2)
    assert wait_finished(page) == "error"
    assert "API key holds a character" in page.inner_text("#error")
    assert page.inner_text("#model-name") == "API key unusable"
