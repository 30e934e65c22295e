# The README's two commands: `make demo` and `make test`. Both set everything up from nothing:
# a virtual environment in .venv with the exact versions of constraints.txt, and fusedoff built in
# place (C++ always, CUDA whenever a toolkit is found; FUSEDOFF_CUDA=0|1 forces it off/on, see
# fusedoff/_build.py). `make test-oldest` runs the sdist's and the stable ABI's tests on the oldest
# supported torch; `make wheel` builds the binary wheel into dist/ and `make test-wheel` runs the CPU
# suite against it, installed with no compiler, in the oldest and the pinned torch; `make docs` builds
# docs/ into build/docs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fusedoff-installed
# The oldest supported torch (constraints-oldest.txt) and the build tools, in a venv of its own.
OLDEST := .venv-oldest
# An extra's requirements, read from the installed fusedoff's own metadata: $(call EXTRA,PYTHON,NAME)
# (-I: not a fusedoff.egg-info that a build left in this folder).
EXTRA = $$($(1) -I -c 'from importlib.metadata import requires; \
	print(*(r.split(";")[0] for r in requires("fusedoff") if "extra == \"$(2)\"" in r))')
DOCS_STAMP := $(VENV)/.docs-tools-installed
SOURCES := setup.py pyproject.toml fusedoff/_build.py $(shell find csrc -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh')

# make test-wheel's venv of the pinned torch (the oldest torch's proof runs in $(OLDEST))
WHEEL_VENV := .venv-wheel

.PHONY: demo test test-oldest wheel test-wheel docs install bench clean

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

# tests/test_packaging.py builds the sdist and installs it into $(OLDEST) as a user would (pip install
# --no-build-isolation beside their torch), C++ only: the CUDA sources are make test's and the wheel's;
# tests/test_stable_abi.py imports the extension built in place against the pinned torch, unchanged, in
# $(OLDEST)'s torch. The CPU suite's run on that torch is make test-wheel's, from the wheel.
test-oldest: $(STAMP) $(OLDEST)/bin/python
	FUSEDOFF_OLDEST_VENV=$(OLDEST) MAX_JOBS=$${MAX_JOBS:-2} $(BIN)/python -m pytest tests/test_packaging.py \
		tests/test_stable_abi.py $(ARGS)

# The binary wheel, one for every torch from the oldest supported and every CPython from 3.10 (cp310-abi3,
# see [note: one binary for every torch]), with the CUDA kernels of every architecture in
# fusedoff/_build.py's DEFAULT_CUDA_ARCH_LIST: linked from make test's objects when its flags are the same
# (the in-place build's staging folder build/lib.* goes first: it holds the tests' emulated module), then
# tagged manylinux by auditwheel, torch's own libraries left to torch; tools/check_wheel.py checks it.
# (TORCH_CUDA_ARCH_LIST unset: the wheel carries the default architectures whatever a shell had set.)
wheel: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt $(call EXTRA,$(BIN)/python,wheel)
	rm -rf build/lib.* build/wheel-unrepaired dist
	env -u TORCH_CUDA_ARCH_LIST FUSEDOFF_CUDA=1 FUSEDOFF_CUDA_EMULATION=0 MAX_JOBS=$${MAX_JOBS:-2} $(BIN)/pip wheel --quiet --no-build-isolation \
		--no-deps -w build/wheel-unrepaired .
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/auditwheel repair --exclude 'libc10*.so' --exclude 'libtorch*.so' \
		--exclude 'libcudart.so.*' --exclude 'libgomp.so.*' -w dist build/wheel-unrepaired/*.whl
	$(BIN)/python tools/check_wheel.py dist

# The wheel's proof (tools/wheel_proof.sh): installed with no compiler on PATH and FUSEDOFF_NO_JIT=1, the
# CPU suite in the oldest supported torch and in a fresh venv of the pinned one.
test-wheel: $(OLDEST)/bin/python
	bash tools/wheel_proof.sh $(OLDEST) constraints-oldest.txt
	bash tools/wheel_proof.sh $(WHEEL_VENV) constraints.txt

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
	rm -rf build dist fusedoff/_C*.so *.egg-info $(WHEEL_VENV)
