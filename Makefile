# Two commands do all the set-up on a fresh machine (Python >= 3.11 and make):
#   make run    create .venv if needed, start an embedded stack, submit a bundled task,
#               print the verified kernel, stop the stack
#   make test   create .venv if needed and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TASK ?= tasks/relu.py

.PHONY: venv run test lint bench schema clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "AIKG needs Python >= 3.11; set PYTHON=python3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

run: venv
	$(VENV)/bin/aikg demo $(TASK)

test: venv
	$(PY) -m pytest -q -p no:cacheprovider

lint: venv
	$(VENV)/bin/ruff check .

bench: venv
	$(PY) -m bench.verify_throughput

schema: venv
	$(VENV)/bin/aikg schema

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
