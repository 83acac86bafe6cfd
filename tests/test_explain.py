"""`multidecode explain`: one verification step of a real run, recorded and drawn.

The library runs on the model-free `HashLM` with a proposer that knows the target's continuation
and spoils part of it, so every step has accepted and rejected draft nodes in a tree (a wrong
sibling beside the right first guess, a wrong token after the second). The recorded step is
checked against the run's own stats, the sequential oracle (`hash_lm.reference`) and the ancestor
rule of the mask. The CLI runs on a tiny model folder whose document holds every token of its
vocabulary, so prompt lookup always finds something to draft.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from hash_lm import VOCAB, HashLM, LetterTokenizer, reference
from local_models import tiny_tokenizer
from matplotlib.figure import Figure
from matplotlib.image import imread

from multidecode.cli import main
from multidecode.cli.explain import check_output
from multidecode.cost import CostCurve
from multidecode.errors import InvalidArgument
from multidecode.explain import explain_prompts, shown
from multidecode.proposers import BranchContext, DraftTree, Proposer
from multidecode.speculation import Speculation

PREFIX = [5, 6, 7, 8, 9, 10, 11, 12]
PROMPTS = [PREFIX + tail for tail in ([13, 14], [15], [16, 17, 18])]
NEW = 12
FUTURE = {tuple(p): reference(p, NEW) for p in PROMPTS}
FLAT = CostCurve.from_relative({1: 1.0, 64: 1.1})
"""A cost curve under which extra rows are nearly free, so "auto" drafts and nothing is timed."""


class PartlyRight(Proposer):
    """Under the head: the right token and a wrong sibling; under the right one, the right token
    again, then a wrong one. So two nodes are accepted and two rejected whenever three tokens remain."""

    name = "partly-right"

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        done = context.tokens[context.prompt_length :]
        future = FUTURE[tuple(context.tokens[: context.prompt_length])][len(done) :]
        draft = DraftTree()
        if len(future) < 3:
            return draft
        first = draft.add(future[0])
        draft.add((future[0] + 1) % VOCAB)
        second = draft.add(future[1], first)
        draft.add((future[2] + 1) % VOCAB, second)
        return draft.truncate(budget)


class PartlyRightWithSide(PartlyRight):
    """PartlyRight plus a chain of two side nodes under the head, as lookahead feeds its window
    (which "auto" adds where it is nearly free): fed for their logits, never verified."""

    name = "partly-right-with-side"

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        draft = super().propose(context, budget)
        if len(draft):
            draft.add_side(1, draft.add_side(2))
        return draft


def run_explain(**settings):
    settings = {"max_new_tokens": NEW, "speculate": Speculation(PartlyRight(), budget=4), "draft_budget": None,
                "eos_token_id": [], **settings}
    return explain_prompts(HashLM(), PROMPTS, tokenizer=LetterTokenizer(), labels=["one", "two", "three"], **settings)


@pytest.fixture(scope="module")
def explained():
    torch.set_num_threads(1)
    return run_explain()


# ---------------------------------------------------------------------- the library
def test_a_figure_and_a_json_summary(explained):
    assert isinstance(explained.figure, Figure)
    assert len(explained.figure.axes) == 2  # the forest, the mask
    summary = json.loads(json.dumps(explained.summary))
    assert summary["model"] == "hash-lm" and summary["speculate"] == "partly-right"
    assert [b["label"] for b in summary["branches"]] == ["one", "two", "three"]
    assert summary["prefix_tokens"] == len(PREFIX)


def test_counts_match_the_runs_stats(explained):
    stats, steps, summary = explained.stats, explained.steps, explained.summary
    assert len(steps) == stats.steps == summary["steps"]
    assert sum(c.drafts for c in steps) == stats.drafted
    assert sum(c.accepted for c in steps) == stats.accepted
    assert [c.drafts for c in steps] == stats.draft_budgets
    step = summary["step"]
    assert summary["drafted"] == stats.draft_budgets[step - 1] == steps[step - 1].drafts
    assert summary["accepted"] == steps[step - 1].accepted
    assert summary["rejected"] == steps[step - 1].rejected
    assert summary["fed"] == steps[step - 1].rows == len(PROMPTS) + summary["drafted"]
    assert sum(b["accepted"] for b in summary["branches"]) == summary["accepted"]
    assert sum(b["draft_size"] for b in summary["branches"]) == summary["drafted"]
    assert summary["run"] == stats.as_dict()


def test_the_default_step_shows_verification(explained):
    summary = explained.summary
    assert summary["step"] == 2  # the first decode step already has everything; equals stay first
    assert sum(b["draft_size"] > 0 for b in summary["branches"]) >= 2
    assert summary["accepted"] > 0 and summary["rejected"] > 0
    for branch in summary["branches"]:
        assert (branch["draft_size"], branch["accepted"], branch["rejected"]) == (4, 2, 2)


def test_accepted_drafts_are_the_targets_own_tokens(explained):
    for lane in explained.view.lanes:
        prompt = PROMPTS[lane.branch]
        truth = FUTURE[tuple(prompt)]
        k = len(lane.answer)
        head = lane.nodes[0]
        assert lane.tail == prompt[len(PREFIX) :] and lane.answer == truth[:k]
        assert head.token == truth[k] and head.position == len(prompt) + k
        assert [n.token for n in lane.accepted] == truth[k + 1 : k + 1 + len(lane.accepted)]
        assert lane.next_token == truth[k + 1 + len(lane.accepted)]
        for n in lane.rejected:  # a rejected node guessed something else than the target chose there
            assert n.token != truth[k + n.depth]
        assert [n.depth for n in lane.nodes][:1] == [0] and all(n.position == head.position + n.depth
                                                                 for n in lane.nodes)


def test_mask_rows_are_each_nodes_ancestors(explained):
    view = explained.view
    rows = view.rows
    visible = view.visible  # [rows, slots]
    assert visible.shape == (len(rows), view.num_slots)
    assert visible[:, : len(PREFIX)].all()  # the shared prefix: seen by every row
    slot_of = {n.node: n.slot for n in rows}
    for i, row in enumerate(rows):
        assert int(visible[i].sum()) == row.position + 1  # its whole root path, one slot per node
        assert visible[i, row.slot]
        if row.depth:
            assert visible[i, slot_of[row.parent]]
    lane = view.lanes[0]
    at = {n.node: rows.index(n) for n in rows}
    right, wrong = [n for n in lane.nodes if n.depth == 1]  # siblings never see each other
    assert not visible[at[right.node], wrong.slot] and not visible[at[wrong.node], right.slot]
    other = view.lanes[1].nodes[0]  # nor does any row see another branch's nodes
    assert not visible[[at[n.node] for n in lane.nodes], other.slot].any()
    assert not visible[at[other.node], lane.nodes[0].slot]


def test_an_explicit_step():
    explained = run_explain(step=3)
    assert explained.summary["step"] == explained.view.step == 3
    assert explained.summary["drafted"] == explained.stats.draft_budgets[2]


def test_auto_with_a_given_cost_curve():
    explained = run_explain(speculate=Speculation(PartlyRight(), budget=None, max_draft=4), cost=FLAT)
    assert explained.summary["speculate"] == "auto"
    assert explained.summary["drafted"] > 0


def test_side_nodes_are_no_drafts():
    """Side nodes are fed and taken back, but they are no draft tokens: the step's counts still
    agree with the run's, and the nodes are shown as side nodes."""
    explained = run_explain(speculate=Speculation(PartlyRightWithSide(), budget=4))
    stats, steps, summary = explained.stats, explained.steps, explained.summary
    assert sum(c.drafts for c in steps) == stats.drafted
    assert [c.drafts for c in steps] == stats.draft_budgets
    assert sum(c.accepted for c in steps) == stats.accepted
    step = summary["step"]
    assert summary["drafted"] == stats.draft_budgets[step - 1] == steps[step - 1].drafts
    assert summary["rejected"] == steps[step - 1].rejected
    assert summary["fed"] == steps[step - 1].rows == len(PROMPTS) + summary["drafted"] + summary["side_nodes"]
    for branch in summary["branches"]:
        assert (branch["draft_size"], branch["accepted"], branch["rejected"], branch["side_nodes"]) == (4, 2, 2, 2)
    for lane in explained.view.lanes:
        assert [n.depth for n in lane.side] == [1, 2] and not set(lane.side) & set(lane.drafts)


@pytest.mark.parametrize(("settings", "needle"), [
    ({"step": 1}, "step must be an integer of 2 or more"),
    ({"step": 99}, "so there is no step 99"),
    ({"speculate": None}, "would not speculate"),
    ({"speculate": "sideways", "draft_budget": 4}, "unknown speculation mode"),
])
def test_refused(settings, needle):
    with pytest.raises(InvalidArgument, match=needle):
        run_explain(**settings)


def test_token_text_made_visible():
    assert shown(" name\n", 10) == "␣name⏎"
    assert shown("  ", 10) == "␣␣"
    assert shown(" understanding", 8) == "␣unders…"
    assert shown("\x04a\x7f", 12) == "\\x04a\\x7f"  # no font draws a control character: matplotlib warned of it


# ---------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def tiny(model_dir_of, tmp_path_factory):
    """A tiny model folder and a document holding every (printable) token of its vocabulary."""
    folder = model_dir_of(1024)
    tokenizer = tiny_tokenizer()
    document = tmp_path_factory.mktemp("explain") / "document.txt"
    text = tokenizer.decode(list(range(3, len(tokenizer))))
    document.write_text("".join(c for c in text if c.isprintable() or c.isspace()), encoding="utf-8")
    return folder, document


def run(*args):
    return CliRunner().invoke(main, ["explain", *map(str, args)])


def test_the_command_writes_a_png(tiny, tmp_path):
    folder, document = tiny
    png = tmp_path / "pictures" / "step.png"
    result = run("--model", folder, "--document", document, "-q", "what is the answer?", "-q", "which cables?",
                 "--max-new-tokens", 12, "--output", png, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["drafted"] > 0 and len(summary["branches"]) == 2
    assert f"Wrote {png}" in result.stderr
    image = imread(png)
    assert image.shape[:2] == (840, 1680)  # 14 x 7 inches at 120 dpi
    assert image[..., :3].std() > 0.05  # something is drawn on the white


@pytest.mark.parametrize("args, mode", [(["--draft-budget", 2], "lookup"), (["--lookahead", "2,2,2"], "lookahead")])
def test_a_setting_of_the_default_mode_needs_no_mode(tiny, tmp_path, args, mode):
    """explain speculates by default (lookup): --draft-budget alone, or --lookahead, was refused as
    "needs speculation, and --speculate is off"."""
    folder, document = tiny
    result = run("--model", folder, "--document", document, "-q", "what?", "--max-new-tokens", 6, "--json",
                 "--output", tmp_path / "step.png", *args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["speculate"] == mode


@pytest.mark.parametrize(("args", "needle"), [
    (["--speculate", "sideways"], "unknown speculation mode"),
    (["--speculate", "off"], "has no draft tokens to draw"),
    (["--step", 1], "--step must be 2 or more"),
    (["--step", 99], "no step 99"),
    (["--draft-budget", 0], "--draft-budget must be a positive integer"),
    (["--output", "picture.jpg"], "does not end in .png"),
    (["--output", "."], "is a folder"),
    (["--output", ""], "--output is empty"),
])
def test_the_command_refuses_bad_input(tiny, tmp_path, args, needle):
    folder, document = tiny
    out = [] if "--output" in args else ["--output", tmp_path / "step.png"]
    result = run("--model", folder, "--document", document, "-q", "what?", "--max-new-tokens", 6, *out, *args)
    assert result.exit_code == 2, result.output
    assert "error:" in result.stderr and needle in result.stderr, result.stderr
    assert "Traceback" not in result.output


def test_an_unwritable_output_is_refused_before_the_model_loads(tiny, tmp_path):
    """The output is tried before the run (which takes minutes on a real model), not when saving."""
    _, document = tiny
    for output, needle in (("/proc/step.png", "(in /proc)"), (document / "step.png", "not a folder")):
        result = run("--model", tmp_path / "no-such-model", "--document", document, "--output", output)
        assert result.exit_code == 2, result.output
        assert f"cannot write --output {output}" in result.stderr and needle in result.stderr, result.stderr
        assert "hint:" in result.stderr and "Traceback" not in result.output
    assert check_output(str(tmp_path / "new" / "step.png")) == tmp_path / "new" / "step.png"
    assert not list(tmp_path.iterdir())  # trying a folder leaves nothing behind in it


def test_an_error_while_saving_is_reported(tiny, tmp_path, monkeypatch):
    import multidecode.explain

    def full(figure, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(multidecode.explain, "save", full)
    folder, document = tiny
    png = tmp_path / "step.png"
    result = run("--model", folder, "--document", document, "-q", "what?", "--max-new-tokens", 6, "--output", png)
    assert result.exit_code == 2, result.output
    assert f"cannot write --output {png}: No space left on device" in result.stderr, result.stderr
    assert "free some space there" in result.stderr  # not "a folder you may write to", a permission's fix
    assert "Traceback" not in result.output


def test_the_command_draws_a_learned_head_named_by_its_folder(tiny, tmp_path):
    """explain had no --draft-head, while its refusal of --speculate medusa without a head pointed
    to one: a head trained into a folder of one's own could not be drawn."""
    from learned_heads import random_heads

    import multidecode

    folder, document = tiny
    random_heads(multidecode.load(str(folder), exact=False).model).save(tmp_path / "heads")
    result = run("--model", folder, "--document", document, "-q", "what is the answer?", "--max-new-tokens", 8,
                 "--output", tmp_path / "step.png", "--json", "--draft-head", tmp_path / "heads")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["drafted"] > 0


class AllRight(Proposer):
    """The target's own continuation, every token of it."""

    name = "all-right"

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        done = context.tokens[context.prompt_length :]
        draft = DraftTree()
        parents = []
        for token in FUTURE[tuple(context.tokens[: context.prompt_length])][len(done) :][:budget]:
            parents.append(draft.add(token, *parents[-1:]))
        return draft


def test_a_branch_that_ends_on_a_draft_it_accepted_gains_no_next_token():
    """A draft that guessed the eos a branch then ended on was drawn rejected, beside a "next token"
    box holding the same eos, and the step said one token more was emitted than was."""
    future = FUTURE[tuple(PROMPTS[1])]
    end = next(i for i in range(6, NEW) if future[i] not in future[:i])  # an eos first generated after step 1
    settings = {"speculate": Speculation(AllRight(), budget=4), "eos_token_id": [future[end]]}
    views = [run_explain(**settings, step=step).view for step in range(2, run_explain(**settings).view.steps + 1)]
    lane = next(lane for view in views for lane in view.lanes if lane.branch == 1 and lane.finished)
    assert lane.finished and lane.accepted and lane.accepted[-1].token == future[end]
    assert lane.next_token is None and lane.gained == len(lane.accepted)
