# Two entry points for a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UNAME := $(shell uname -s)
comma := ,
EXTRAS := $(if $(filter Linux,$(UNAME)),cpu$(comma)test,test)
DEMO_OUT ?= demo-out

.PHONY: install demo test clean interop

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m mtpconvert.demo --out $(DEMO_OUT)

test: install
	$(PY) -m pytest tests

# Runs the converted fixtures in stock mlx-lm 0.31/0.32, mlx-vlm, mtplx, rapid-mlx, vllm-mlx (and the
# mlx-lm PR #990 branch when available); venvs cached outside the repo (see interop/README.md).
interop: install
	$(PY) interop/run.py --python $(PY) $(INTEROP_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache
