# Developer and demo workflow. `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# torch for the dev environment. 2.13.0 is a normal PyPI release; on machines that keep a CPU build of it
# on local disk (like CI's), pip takes that one instead of downloading a multi-GB CUDA build.
# The package itself only asks for torch>=2.1.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# A second environment with every dependency (and test extra) at exactly the minimum pyproject.toml declares.
MIN_VENV ?= .venv-min
MIN_BIN := $(MIN_VENV)/bin
# The suite runs on every core (pytest-xdist, in the `test` extra). A test file stays on one worker: its
# module-scoped fixtures (a shell, a cluster of engines, a Jupyter server) are made once, and its tests
# run in their order. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= auto
PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile
# More pytest options for `make test`, e.g. PYTEST_ARGS="--durations=20".
PYTEST_ARGS ?=
# Prints how long a target's pytest run took, wall time, whatever its outcome.
TIMED = echo '$(1)'; started=$$(date +%s); status=0; $(1) || status=$$?; \
	echo "make $@ took $$(( $$(date +%s) - started )) s"; exit $$status

.PHONY: demo test test-fast test-min test-gpu test-browser test-real docs-images typecheck complexity clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test,parallel]"
	touch $@

# mypy (the `dev` extra) over the package, configured in pyproject.toml's [tool.mypy].
$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

typecheck: $(VENV)/.installed-dev
	$(BIN)/python -m mypy

# Functions too complex to follow: ruff's C901 over the package (max-complexity in pyproject.toml's
# [tool.ruff.lint.mccabe]) may find at most MAX_COMPLEX; one more fails, and lists them all.
MAX_COMPLEX ?= 15
complexity: $(VENV)/.installed-dev
	@found=$$($(BIN)/python -m ruff check --select C901 --exit-zero --output-format concise jupyter_cudamem); \
	count=$$(printf '%s\n' "$$found" | grep -c ' C901 '); \
	echo "ruff C901: $$count functions over the complexity limit (at most $(MAX_COMPLEX))"; \
	if [ "$$count" -gt $(MAX_COMPLEX) ]; then printf '%s\n' "$$found"; exit 1; fi

# The browser test's tools (jupyterlab, notebook, playwright), on top of the dev environment. The browser
# itself is the system's Chromium: `apt-get install chromium` on Debian (CHROMIUM=/path/to/chromium picks
# another).
$(VENV)/.installed-browser: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[test,browser]"
	touch $@

# The batch finder's corpus on the real transformers, accelerate and Lightning (the `real` extra, on the CPU
# torch already in .venv); without them those tests skip.
$(VENV)/.installed-real: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[test,real]"
	touch $@

test-real: $(VENV)/.installed-real
	$(BIN)/python -m pytest -q -m real_libraries tests/batch

demo: $(VENV)/.installed
	$(BIN)/python scripts/run_notebook.py notebooks/00_quickstart.ipynb

test: $(VENV)/.installed
	@$(call TIMED,$(BIN)/python -m pytest -q $(PARALLEL) $(PYTEST_ARGS))

# The suite without the benchmark scripts' smoke runs (marker `benchmark_smoke`): the quick loop while editing.
test-fast: $(VENV)/.installed
	@$(call TIMED,$(BIN)/python -m pytest -q $(PARALLEL) $(PYTEST_ARGS) -m "not benchmark_smoke")

# The suite on the oldest versions we declare: scripts/min_constraints.py turns each `>=X` of pyproject.toml
# into `==X` (a pip constraints file), torch excepted (TORCH_SPEC: no CPU build of torch 2.1 for our Pythons).
$(MIN_VENV)/.installed: pyproject.toml Makefile scripts/min_constraints.py
	rm -rf $(MIN_VENV)
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_BIN)/python -m pip install --quiet --upgrade pip
	$(MIN_BIN)/python scripts/min_constraints.py --extras test,parallel --override "$(TORCH_SPEC)" > $(MIN_VENV)/constraints.txt
	$(MIN_BIN)/python -m pip install --quiet -c $(MIN_VENV)/constraints.txt "$(TORCH_SPEC)" -e ".[test,parallel]"
	$(MIN_BIN)/python scripts/min_constraints.py --extras test,parallel --override "$(TORCH_SPEC)" --check
	touch $@

# Modules marked dependency_free run none of the libraries it changes: `make test` has run them already.
test-min: $(MIN_VENV)/.installed
	@$(call TIMED,$(MIN_BIN)/python -m pytest -q $(PARALLEL) $(PYTEST_ARGS) -m "not dependency_free")

test-gpu: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m gpu

# JupyterLab and Notebook 7 in headless Chromium over fake hardware; screenshots go to
# tests/browser/screenshots/. CUDAMEM_REQUIRE_BROWSER=1 turns "chromium/jupyterlab/notebook/playwright
# missing" into a failure, not a skip.
test-browser: $(VENV)/.installed-browser
	CUDAMEM_REQUIRE_BROWSER=1 $(BIN)/python -m pytest -q -m browser tests/browser

# The same test, also copying its screenshots into docs/images/ for the README.
docs-images: $(VENV)/.installed-browser
	CUDAMEM_REQUIRE_BROWSER=1 CUDAMEM_DOCS_IMAGES=docs/images $(BIN)/python -m pytest -q -m browser tests/browser

clean:
	rm -rf $(VENV) $(MIN_VENV) .pytest_cache cudamem_traces
