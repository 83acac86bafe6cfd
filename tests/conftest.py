"""Shared test setup: one CPU thread per xdist worker.

`make test` runs `pytest -n 2` on two cores; two workers each spawning a full intra-op thread pool
would oversubscribe the machine (tiny models gain nothing from those threads anyway). A plain
`pytest` run keeps torch's default.
"""

import os

import torch


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
