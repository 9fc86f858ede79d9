# Two entry points for a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	# Pinned first: on a machine without a GPU this takes the CPU wheel that lies on disk; an
	# open-ended torch would pull several GB of CUDA packages.
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m fxtron train --model gpt-tiny --world-size 4 --tp 2 --steps 40 --compare

# The fast tier (single-process tests) on two workers, one module to a worker; then the tests
# that start processes, one module at a time (each job already takes both cores).
test: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow" -n 2 --dist loadfile --durations=10
	$(PY) -m pytest -q tests -m slow --durations=25

bench: $(STAMP)
	$(PY) -m pytest -q benchmarks --benchmark-only

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
