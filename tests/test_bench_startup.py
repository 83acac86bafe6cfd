"""`bench startup`: every run a fresh process, cold (an empty user cache but the kernels) and warm
(and warm on a resident server), on a tiny random GGUF. Timings are not asserted, only that every figure and target is there."""

from __future__ import annotations

import pytest

from multidecode import kernels
from multidecode.bench.results import tables
from multidecode.bench.startup import LLAMA, MD, MD_COMMAND, MD_SERVED, run_startup_benchmark
from multidecode.kernels.build import KERNELS_FOLDER
from multidecode.models.random_gguf import write_random_gguf


@pytest.mark.slow
def test_cold_and_warm_starts_report_each_wait(cache, tmp_path):
    # The test's cache holds the compiled kernels `cache` loaded, as a user's does after setup:
    # without them every process of the run (the cold ones, the server) compiled them again, 30 s each.
    library = kernels.status().library  # <real cache>/kernels/<build>/<library>
    if library is not None:
        cache.mkdir()
        (cache / KERNELS_FOLDER).symlink_to(library.parent.parent)
    path = write_random_gguf(tmp_path / "tiny.gguf", shape="tiny")["path"]
    result = run_startup_benchmark(str(path), threads=1, repeats=1, with_llama=False)
    cold, warm = result["starts"]
    assert (cold["start"], warm["start"]) == ("cold", "warm")
    for row in (cold, warm):
        figures = row["methods"][MD]["extra"]
        assert all(figures[k] > 0 for k in ("import_s", "load_s", "first_token_s", "process_s", "peak_mb"))
        assert row["methods"][MD_COMMAND]["extra"]["process_s"] > 0
        assert LLAMA in row["skipped"]
    assert warm["methods"][MD_SERVED]["extra"]["process_s"] > 0 and MD_SERVED not in cold["methods"]
    assert {t["name"] for t in result["targets"]} == {"import (multidecode, torch, transformers), warm", "load() of the model, warm",
                                                      "the whole command, warm",
                                                      "the whole command, warm, on a resident server"}
    assert any("wait before the first token" in table.title for table in tables(result))
