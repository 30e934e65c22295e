# The README's two commands: `make demo` and `make test`. Both set everything up from nothing:
# a virtual environment in .venv with the pinned torch, and fusedoff built in place (C++ always,
# CUDA whenever a toolkit is found; FUSEDOFF_CUDA=0|1 forces it off/on, see fusedoff/_build.py).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fusedoff-installed
SOURCES := setup.py pyproject.toml fusedoff/_build.py $(shell find csrc -name '*.h' -o -name '*.cpp' -o -name '*.cu')

.PHONY: demo test install bench clean

demo: $(STAMP)
	$(BIN)/python -m fusedoff.demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned, so pip takes the local build and never a different release
	$(BIN)/pip install --quiet torch==2.14.1
	$(BIN)/pip install --quiet "setuptools>=64" wheel ninja pybind11 pytest numpy tqdm matplotlib

$(STAMP): $(BIN)/python $(SOURCES)
	MAX_JOBS=$${MAX_JOBS:-2} $(BIN)/pip install --no-build-isolation --no-deps -e . 
	touch $@

bench: $(STAMP)
	$(BIN)/pip install --quiet matplotlib
	$(BIN)/python benchmarks/bench_step.py --device cpu $(ARGS)

clean:
	rm -rf build fusedoff/_C*.so *.egg-info
