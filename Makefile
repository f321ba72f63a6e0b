# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# The WebGPU plugin EP hides software adapters unless asked; lavapipe's shader cache is kept in the
# tree so that test processes share compiled shaders.
export ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER := 1
export XDG_CACHE_HOME ?= $(CURDIR)/.cache
export XDG_RUNTIME_DIR ?= $(CURDIR)/.cache/xdg-runtime

NATIVE  := src/pagedhybrid/kernels/native/_build/build.json

.PHONY: setup native wheel system-deps run test lint docs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,docs]'
	touch $@

# The native CPU kernels (torch C++ extension, g++ + ninja) are built ahead of time, here,
# never on a first request; the build is skipped when it is current. It writes csrc/layer_spec.h
# from kernels/layer_spec.py (the fused layers' fields) first.
$(NATIVE): $(STAMP) $(wildcard src/pagedhybrid/kernels/native/csrc/*) \
           src/pagedhybrid/kernels/layer_spec.py
	$(PY) -m pagedhybrid.kernels.native.build

native: $(NATIVE)

# A wheel (dist/) that carries the native kernels of every CPU form the compiler builds: the build
# hook (hatch_build.py) runs the same build as `make native`; `pip install .` and an sdist do too
wheel: $(STAMP)
	$(PY) -m pip wheel --no-deps --wheel-dir dist .

setup: $(STAMP) $(NATIVE)
	@mkdir -p $(XDG_RUNTIME_DIR) && chmod 700 $(XDG_RUNTIME_DIR)

system-deps:
	bash scripts/install-system-deps.sh

run: setup system-deps
	$(VENV)/bin/pagedhybrid run

lint: setup
	$(VENV)/bin/ruff check .

# the docs site, into site/: strict, so a broken link or API reference fails the build
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test: setup system-deps lint docs
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) site .cache .pytest_cache .ruff_cache .hypothesis src/pagedhybrid/kernels/native/_build
