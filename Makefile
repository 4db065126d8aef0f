# One-command set-up: `make demo` and `make test` create .venv when missing and install everything.
# torch: a torch that the system Python already has (e.g. your CUDA build) is reused through
# --system-site-packages; otherwise torch==$(TORCH_VERSION) is installed (the CPU build on machines
# that carry its wheel locally; set TORCH_SPEC to choose another).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# the test suite exercises the optional integrations too (Triton interpreter, lm-eval, Ray)
EXTRAS ?= dev,lm-eval,ray

.PHONY: demo demo-real test lint leaderboard bench clean-venv

$(STAMP): pyproject.toml Makefile
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "[setup] reusing the system torch: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; fi
	@$(PY) -c "import torch" >/dev/null 2>&1 || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/aspire-bench demo

# The same side-by-side on SmolLM2-135M (a real pretrained model): `aspire-bench models get smollm2-135m` first.
demo-real: $(STAMP)
	$(VENV)/bin/aspire-bench demo --real

test: $(STAMP)
	@bash scripts/install_chromium.sh || echo "[setup] no chromium: the browser test skips (it fails under CI=true)"
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check aspire_bench tests benchmarks

# The published leaderboard of the bundled model on this machine (a fresh store each time).
leaderboard: $(STAMP)
	rm -f leaderboards/tiny/results.db
	$(VENV)/bin/aspire-bench demo --store leaderboards/tiny/results.db --out leaderboards/tiny

bench: $(STAMP)
	$(VENV)/bin/aspire-bench bench

clean-venv:
	rm -rf $(VENV)
