# Two commands do all set-up on a fresh machine:
#   make demo   runs the main job
#   make test   runs the test suite
# Both create (or reuse) .venv and install what they need into it.
#   make asan   runs the compiled reader's tests and fuzz tests against an AddressSanitizer build (gcc)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# torch is pinned here only for installation on a fresh machine; pyproject keeps a range
# so users keep their own (CUDA) build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test asan bench venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml setup.py $(wildcard src/stoker/csrc/*.c src/stoker/csrc/*.h)
	@echo "make: installing stoker into $(VENV) (the first time takes a few minutes; later runs skip this)"
	@$(PY) -c "import torch" 2>/dev/null || { echo "make:   $(TORCH_SPEC)"; $(PY) -m pip install --quiet "$(TORCH_SPEC)"; }
	@echo "make:   stoker, its dependencies and test tools; building the compiled reader"
	@$(PY) -m pip install --quiet -e ".[test,bench]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/stoker demo --run-dir runs/demo

test: $(STAMP)
	$(PY) -m pytest -q

asan: $(STAMP)
	PY=$(PY) .ci/asan

bench: $(STAMP)
	$(VENV)/bin/stoker bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist src/*.egg-info
