# Two entry points for a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UNAME := $(shell uname -s)
CPU := $(if $(filter Linux,$(UNAME)),cpu,)
comma := ,
DEMO_OUT ?= demo-out
DEMO_ARGS ?=
# a stage line and one every 5 s on stderr while a quiet install runs (pip -q says nothing for tens of seconds)
HEARTBEAT := $(PYTHON) -m tools.heartbeat

.PHONY: install demo test test-all interop clean

# the venv's pip comes from the system's pip where it has one (>= 22.3: --python); ensurepip's bundled pip,
# compiled only to be replaced by the upgrade, is the fallback
$(VENV)/bin/python:
	$(HEARTBEAT) "creating $(VENV) and its pip" -- sh -c '$(PYTHON) -m venv --without-pip $(VENV) && \
	  ($(PYTHON) -m pip --python $(PY) install -q --no-compile --upgrade pip 2>/dev/null || \
	   ($(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip))'

# the demo needs no torch: only the package (and MLX's CPU backend on Linux). No bytecode compiled at install:
# the demo imports a small part of what it installs (transformers above all), compiled as it is first imported
$(VENV)/.installed-demo: pyproject.toml | $(VENV)/bin/python
	$(HEARTBEAT) "installing mtpconvert into $(VENV) (no torch)" -- \
	  $(PY) -m pip install -q --no-compile -e '.$(if $(CPU),[$(CPU)])'
	touch $@

# the tests add pytest, CPU torch (parity against transformers' own classes) and mlx-vlm (the families it loads)
$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(HEARTBEAT) "installing mtpconvert with its test extras into $(VENV)" -- \
	  $(PY) -m pip install -q -e '.[$(if $(CPU),$(CPU)$(comma))test]'
	touch $@ $(VENV)/.installed-demo

install: $(VENV)/.installed-test

# one conversion, checked and benched; DEMO_ARGS=--all: the four conversions of the README's table
demo: $(VENV)/.installed-demo
	$(PY) -m mtpconvert.demo --out $(DEMO_OUT) $(DEMO_ARGS)

# CI's suite (.ci/run): everything but the tests marked slow, which test-all adds (wheel builds, full-size recipe
# plans, statistical and acceptance runs that other tests cover more cheaply)
test: $(VENV)/.installed-test
	$(PY) -m pytest tests -m "not slow" --durations=15

test-all: $(VENV)/.installed-test
	$(PY) -m pytest tests --durations=15

# Runs the converted fixtures in stock mlx-lm 0.31/0.32, mlx-vlm, mtplx, rapid-mlx, vllm-mlx (and the
# mlx-lm PR #990 branch from GitHub: listed under "Not run" when it cannot be installed); venvs cached
# outside the repo (see interop/README.md). The table goes to docs/interop.md.
interop: install
	$(PY) -m interop.run --python $(PY) --with-pr990 $(INTEROP_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache
