# The README's two commands: `make demo` and `make test`. Both set everything up from nothing:
# a virtual environment in .venv with the exact versions of constraints.txt, and fusedoff built in
# place (C++ always, CUDA whenever a toolkit is found; FUSEDOFF_CUDA=0|1 forces it off/on, see
# fusedoff/_build.py). `make test-oldest` runs the CPU suite again on the oldest supported torch;
# `make docs` builds docs/ into build/docs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fusedoff-installed
# The oldest supported torch (constraints-oldest.txt) and the build tools, in a venv of its own.
OLDEST := .venv-oldest
OLDEST_SUITE := build/oldest-suite
# An extra's requirements, read from the installed fusedoff's own metadata: $(call EXTRA,PYTHON,NAME)
# (-I: not a fusedoff.egg-info that a build left in this folder).
EXTRA = $$($(1) -I -c 'from importlib.metadata import requires; \
	print(*(r.split(";")[0] for r in requires("fusedoff") if "extra == \"$(2)\"" in r))')
DOCS_STAMP := $(VENV)/.docs-tools-installed
SOURCES := setup.py pyproject.toml fusedoff/_build.py $(shell find csrc -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh')

.PHONY: demo test test-oldest docs install bench clean

demo: $(STAMP)
	$(BIN)/python -m fusedoff.demo $(ARGS)

# FUSEDOFF_REQUIRE_EMULATION=1: the `emulated` tests fail, never skip, if fusedoff._C_emulated is missing.
test: $(STAMP)
	FUSEDOFF_REQUIRE_EMULATION=1 $(BIN)/python -m pytest $(ARGS)

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	# torch and the build tools first: `--no-build-isolation` below builds against them
	$(BIN)/pip install --quiet -c constraints.txt torch setuptools ninja

$(STAMP): $(BIN)/python $(SOURCES) constraints.txt requirements-test-integrations.txt
	# FUSEDOFF_CUDA_EMULATION=1: also the tests' emulated CUDA kernels, fusedoff._C_emulated (see fusedoff/_build.py)
	MAX_JOBS=$${MAX_JOBS:-2} FUSEDOFF_CUDA_EMULATION=1 $(BIN)/pip install --no-build-isolation -c constraints.txt -e ".[test,demo]"
	# test-only: the training libraries of tests/test_integrations.py and coverage (never run-time deps)
	$(BIN)/pip install --quiet -c constraints.txt -r requirements-test-integrations.txt coverage
	touch $@

# 1. tests/test_packaging.py builds the sdist and installs it into $(OLDEST) as a user would
#    (pip install --no-build-isolation beside their torch), C++ only: the CUDA sources are make test's;
#    tests/test_stable_abi.py imports the extension built in place against the pinned torch, unchanged,
#    in $(OLDEST)'s torch;
# 2. the suite runs from a copy of the tests without the source package, so `import fusedoff` is
#    that installed one (the tests of 1 need the source tree and ran there).
test-oldest: $(STAMP) $(OLDEST)/bin/python
	FUSEDOFF_OLDEST_VENV=$(OLDEST) MAX_JOBS=$${MAX_JOBS:-2} $(BIN)/python -m pytest tests/test_packaging.py \
		tests/test_stable_abi.py $(ARGS)
	$(OLDEST)/bin/pip install --quiet -c constraints.txt $(call EXTRA,$(OLDEST)/bin/python,test)
	rm -rf $(OLDEST_SUITE) && mkdir -p $(OLDEST_SUITE) && cp -r tests benchmarks csrc pyproject.toml README.md $(OLDEST_SUITE)/
	# (the training-library integrations run on the pinned torch only: their versions follow it)
	# (the emulated CUDA kernels are make test's: they do not depend on torch's version; so are the
	#  exhaustive runs, the other tests' checks repeated over a large space, such as every fp32 bit pattern)
	cd $(OLDEST_SUITE) && FUSEDOFF_CUDA=0 $(abspath $(OLDEST))/bin/python -m pytest --ignore=tests/test_packaging.py \
		--ignore=tests/test_stable_abi.py --ignore=tests/test_integrations.py -m "not emulated and not exhaustive" $(ARGS)

$(OLDEST)/bin/python:
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install --quiet -c constraints-oldest.txt torch setuptools
	$(OLDEST)/bin/pip install --quiet -c constraints.txt ninja

# The Markdown pages of docs/ (MyST) and the API reference from the docstrings, with warnings as
# errors: a broken link (the README's included, see docs/conf.py), a reference to a name that does
# not exist, or a docstring that does not render fails it. CI runs it. -E: read every page and
# docstring afresh (an incremental build would not repeat an unchanged page's warnings).
docs: $(DOCS_STAMP)
	$(BIN)/python -m sphinx -E -W --keep-going -n -q -b html docs build/docs

# the `docs` extra (sphinx, myst-parser): documentation tools, never run-time deps
$(DOCS_STAMP): $(STAMP) constraints.txt
	$(BIN)/pip install --quiet -c constraints.txt $(call EXTRA,$(BIN)/python,docs)
	touch $@

bench: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt matplotlib
	$(BIN)/python benchmarks/bench_step.py --device cpu $(ARGS)

clean:
	rm -rf build fusedoff/_C*.so *.egg-info
