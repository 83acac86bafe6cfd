"""Shared test setup: one CPU thread per xdist worker, and cost curves kept apart from the user's.

`make test` runs `pytest -n 2` on two cores; two workers each spawning a full intra-op thread pool
would oversubscribe the machine (tiny models gain nothing from those threads anyway). A plain
`pytest` run keeps torch's default.
"""

import os
import tempfile

import torch


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    # Cost curves that "auto" measures for test models go to a folder of this run, never to the
    # user's cache (tests that check the keeping of curves point it elsewhere themselves).
    os.environ["MULTIDECODE_COSTS"] = tempfile.mkdtemp(prefix="multidecode-costs-")
