# Developer and demo workflow. `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# torch for the dev environment. 2.13.0 is a normal PyPI release; on machines that keep a CPU build of it
# on local disk (like CI's), pip takes that one instead of downloading a multi-GB CUDA build.
# The package itself only asks for torch>=2.1.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test test-gpu clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python scripts/run_notebook.py notebooks/00_quickstart.ipynb

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

test-gpu: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache cudamem_traces
