"""Shared test setup: one CPU thread per xdist worker, cost curves kept apart from the user's, and
the tiny model folders that the text-level tests load.

`make test` runs `pytest -n 2` on two cores; two workers each spawning a full intra-op thread pool
would oversubscribe the machine (tiny models gain nothing from those threads anyway). A plain
`pytest` run keeps torch's default.

Fixtures:
- `model_dir_of(max_positions)`: the offline tiny model folder (`local_models.tiny_model_folder`:
  a random tiny Llama and a byte-level BPE tokenizer with a chat template) with that context
  length, written once per session (once per xdist worker) and shared by every module that asks
  for it. The folder's weights and tokenizer are the same at every length (a fixed seed); only
  `max_position_embeddings` differs. Tests read these folders and never write into them.
- `model_dir`: `model_dir_of(256)`, the folder most tests use. A module that needs another context
  length (a short one that long prompts overflow, a long one for long documents) overrides
  `model_dir` with `model_dir_of(n)` and says why.
- `cache`: a model cache folder of the test's own (MULTIDECODE_CACHE points at it), for the tests
  that load or convert GGUF files: the user's cache is never read or written.
- `server`: `multidecode serve` of the module's `model_dir`, one per test module (`serving.Running`).
- `embedded_decoder`: the embedded model (`multidecode.load()`), loaded once per test module.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Threads that wait for work sleep rather than spin, set before torch loads OpenMP (it reads this
# once). The tests at all of the machine's threads run beside the other worker's: spinning, each
# barrier of theirs waited on threads the other worker kept off the cores, and those tests ran 15
# times slower than at one thread. What each thread computes is unchanged (the kernels split work
# the same way whatever the wait), so only the time changes. Set in the environment, it reaches the
# workers and the servers, Ray workers and benchmark children the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from local_models import tiny_model_folder

from multidecode import kernels

DEFAULT_POSITIONS = 256


def pytest_report_header(config) -> str:
    """Say at the top of every run what it tests on: the engine must work on every transformers
    of `pyproject.toml`'s range, and its forward's arguments change between releases."""
    import platform

    import transformers

    return f"multidecode on Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    # A user's resident server or API key must not redirect or guard the commands the tests run
    # (the tests that use them set them themselves).
    for variable in ("MULTIDECODE_SERVER", "MULTIDECODE_API_KEY"):
        os.environ.pop(variable, None)
    # Cost curves that "auto" measures for test models go to a folder of this run, never to the
    # user's cache (tests that check the keeping of curves point it elsewhere themselves).
    os.environ["MULTIDECODE_COSTS"] = config._multidecode_costs = tempfile.mkdtemp(prefix="multidecode-costs-")


def pytest_unconfigure(config):
    """The run's cost-curve folder goes with the run (one per worker: they piled up in /tmp)."""
    folder = getattr(config, "_multidecode_costs", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir_of(tmp_path_factory):
    """`model_dir_of(max_positions)`: the tiny model folder with that context length, written on
    first use and shared for the rest of the session."""
    folders: dict[int, Path] = {}

    def folder(max_positions: int = DEFAULT_POSITIONS) -> Path:
        if max_positions not in folders:
            path = tmp_path_factory.mktemp(f"tiny-llama-{max_positions}")
            folders[max_positions] = tiny_model_folder(path, max_positions=max_positions)
        return folders[max_positions]

    return folder


@pytest.fixture(scope="session")
def model_dir(model_dir_of) -> Path:
    """The shared tiny model folder with 256 positions."""
    return model_dir_of(DEFAULT_POSITIONS)


@pytest.fixture(scope="module")
def embedded_decoder():
    """The embedded model (`multidecode.load()`), loaded once per test module."""
    import multidecode

    return multidecode.load()


@pytest.fixture(scope="module")
def server(model_dir):
    """`multidecode serve` of the tiny model, one per test module (`serving.Running`)."""
    from serving import running_server, tiny_loader

    with running_server(tiny_loader(model_dir)) as running:
        yield running


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """`tmp_path / "cache"`, named by MULTIDECODE_CACHE for this test. It is not created: a load
    creates it, as it would the user's, and the tests of a missing cache folder need it absent.
    The compiled kernels are loaded first, from the real user cache (once per process): a test run
    alone would otherwise build them into this folder, an entry its listing does not expect."""
    kernels.status()
    folder = tmp_path / "cache"
    monkeypatch.setenv("MULTIDECODE_CACHE", str(folder))
    return folder
