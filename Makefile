# The README's two commands: `make demo` and `make test`. Each bootstraps .venv idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The benchmarks' peers (the bench extra: Lance, Delta, Polars, lance-context), installed by
# `make bench` and `make bench-quick` only: `make test` needs none of them.
BENCH_STAMP := $(VENV)/.installed-bench
# The CPU wheel of torch lies on this machine's disk for exactly this pin; an open `torch`
# requirement with no torch installed would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# The venv's interpreter, whatever `python` is on PATH: its site-packages hold the stubs.
TYPECHECK := $(VENV)/bin/basedpyright --pythonpath $(PY)

.PHONY: demo test test-fast typecheck bench bench-quick mutate lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[models,analytics,dev,ray,s3,trl,verl,browser,view,view-wandb]" "$(TORCH_PIN)"
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[bench]" "$(TORCH_PIN)"
	touch $(BENCH_STAMP)

demo: $(STAMP)
	$(VENV)/bin/maxent-arrow demo

# The README's screenshots of the explorer, from the demo's run (docs/make_screenshots.py; runs
# the demo first unless RUN=<a demo run directory> is given). Not part of `make test`.
.PHONY: screenshots
screenshots: $(STAMP)
	$(PY) docs/make_screenshots.py $(RUN)

# The import contracts (docs/architecture.md; [tool.importlinter] in pyproject.toml) first,
# then the types of maxent_arrow and examples/ ([tool.basedpyright]), then the tests.
test: $(STAMP)
	$(VENV)/bin/lint-imports && $(TYPECHECK) && $(PY) -m pytest -q

typecheck: $(STAMP)
	$(TYPECHECK)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# Every benchmarks/bench_*.py, all of them even after a miss; a summary, benchmarks/results.json
# and docs/benchmarks.md's table regenerated from it; fails at the end if a script missed.
bench: $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py --doc docs/benchmarks.md

bench-quick: $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py --quick

# Mutation testing of the commit, the commit log, the checksums and the SQL sandbox (mutmut,
# [tool.mutmut] in pyproject.toml), from scratch in mutants/; then docs/mutation.md from its
# results (docs/make_mutation.py): the score, the run's wall time and each survivor with its
# reason (docs/mutation_survivors.toml), failing if one has none. Under an hour on 2 cores;
# not part of `make test`.
mutate: $(STAMP)
	rm -rf mutants
	start=$$(date +%s) && $(VENV)/bin/mutmut run && \
		$(PY) docs/make_mutation.py --wall $$(( $$(date +%s) - start ))

lint: $(STAMP)
	$(VENV)/bin/ruff check maxent_arrow tests benchmarks examples data

clean:
	rm -rf $(VENV) build *.egg-info
