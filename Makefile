# Two commands do all set-up on a fresh machine:
#   make demo   runs the main job
#   make test   runs the test suite
# Both create (or reuse) .venv and install what they need into it.
#   make asan   runs the compiled reader's tests and fuzz tests against an AddressSanitizer build (gcc)
#   make lint   ruff over src/ and tests/, mypy over the public API (configured in pyproject.toml)
#   make docs   builds the documentation site and its API reference strictly (mkdocs.yml) into site/
#   make interface  writes stoker/engine/cpu/interface.py and csrc/interface_names.h from csrc/stoker_native.h

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# torch is pinned here only for installation on a fresh machine; pyproject keeps a range
# so users keep their own (CUDA) build.
TORCH_SPEC ?= torch==2.13.0
# test processes for make test and make asan (pytest-xdist; each takes whole files, so a file's fixtures are
# built once): most tests wait on servers, subprocesses and timeouts, so two keep a 2-core machine busy
TEST_WORKERS ?= 2
# a failed test runs once more (pytest-rerunfailures) and the run lists every rerun (-rR), passed or not: on a
# loaded 2-core CI machine a test that waits on threads, servers or subprocesses may miss a bound once in thousands
# of runs; a defect that fails twice still fails the run
RERUNS ?= 1

.PHONY: demo test asan bench lint docs venv clean interface

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml setup.py $(wildcard src/stoker/csrc/*.c src/stoker/csrc/*.h)
	@echo "make: installing stoker into $(VENV) (the first time takes a few minutes; later runs skip this)"
	@$(PY) -c "import torch" 2>/dev/null || { echo "make:   $(TORCH_SPEC)"; $(PY) -m pip install --quiet "$(TORCH_SPEC)"; }
	@echo "make:   stoker, its dependencies, test, lint and docs tools; building the compiled reader"
	@$(PY) -m pip install --quiet -e ".[test,bench,lint,docs]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/stoker demo --run-dir runs/demo

test: $(STAMP)
	$(PY) -m pytest -q -rR --reruns $(RERUNS) -n $(TEST_WORKERS) --dist loadfile

asan: $(STAMP)
	PY=$(PY) TEST_WORKERS=$(TEST_WORKERS) RERUNS=$(RERUNS) .ci/asan

interface:
	$(PYTHON) .ci/interface.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir site

bench: $(STAMP)
	$(VENV)/bin/stoker bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache build dist site src/*.egg-info
