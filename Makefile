# Two commands do all the set-up on a fresh machine (Python >= 3.11 and make):
#   make run    create .venv if needed, start an embedded stack, submit a bundled task,
#               print the verified kernel, stop the stack
#   make test   create .venv if needed and run the whole test suite (what CI runs)
#   make test-fast  the same without the `slow` end-to-end tests: the inner loop
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TASK ?= tasks/relu.py

.PHONY: venv prometheus run test test-fast lint bench schema wheelhouse clean

# pip is not --quiet: a first install takes minutes, torch and triton most of it, and
# pip's own lines (Collecting, Downloading with its progress bar, Installing collected
# packages) say where it is; without a terminal (CI logs) each bar is one final line.
$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "AIKG needs Python >= 3.11; set PYTHON=python3.11")'
	@test -x $(PY) || { echo "creating the virtual environment $(VENV): $(PYTHON) -m venv $(VENV)"; \
	  $(PYTHON) -m venv $(VENV); }
	@echo "installing AIKG and its dependencies into $(VENV) (a few minutes the first time):"
	$(PY) -m pip install --disable-pip-version-check -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# tests/e2e/test_dashboard.py runs the Grafana dashboard's queries on a real Prometheus
# (Debian's `prometheus` package). Installed here when missing, only as root with
# apt-get (CI); otherwise, or if apt fails, that test skips and says why.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  ! command -v apt-get >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends prometheus >/dev/null; } || \
	  echo "could not install prometheus; tests/e2e/test_dashboard.py will skip"

run: venv
	$(VENV)/bin/aikg demo $(TASK)

# The suite runs on TEST_WORKERS pytest-xdist processes (default: two more than the
# machine's cores, at most 8; many tests wait on subprocesses and the bus, not the CPU).
# TEST_WORKERS=0 runs it in this one process. Each process starts its own warm sandbox.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); n=$$((n + 2)); [ $$n -gt 8 ] && n=8; echo $$n)
# Bytecode caches on whatever the environment says (PYTHONDONTWRITEBYTECODE=1 in many
# containers): the suite starts hundreds of Python processes (CLIs, services, sandbox
# servers), each of which would compile every project module it imports, and pytest
# would rewrite every test module's asserts again in each of its processes (11 CPU-s of
# collection each, 6 with the caches). __pycache__ is git-ignored.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -p no:cacheprovider \
	-n $(TEST_WORKERS) --dist worksteal --durations=25
COMPILE := env -u PYTHONDONTWRITEBYTECODE $(PY) -m compileall -q services schemas bench tests

test: venv prometheus
	$(COMPILE)
	$(PYTEST)

# Tests marked `slow` (several services end to end, clusters, wheel builds, the bulk of
# each family of like tests) left out.
test-fast: venv
	$(COMPILE)
	$(PYTEST) -m "not slow"

lint: venv
	$(VENV)/bin/ruff check .

bench: venv
	$(PY) -m bench.verify_throughput

schema: venv
	$(VENV)/bin/aikg schema

# Wheels of every runtime dependency except torch and triton, for a machine without
# internet that brings its own CUDA builds of both (README, "Offline GPU machines"),
# plus the build requirements of `pip install -e .` there; wheelhouse/requirements.txt
# lists what to install. Set WHEEL_PYTHON to that machine's Python (major.minor) and
# WHEEL_PLATFORMS to its platform tags (aarch64: manylinux_2_28_aarch64
# manylinux_2_17_aarch64 manylinux2014_aarch64).
WHEELHOUSE ?= wheelhouse
WHEEL_PYTHON ?= 3.12
WHEEL_PLATFORMS ?= manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 \
  manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64
wheelhouse: venv
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	$(PY) -c 'import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print("\n".join(d for d in deps if re.split(r"[^A-Za-z0-9._-]", d, maxsplit=1)[0].lower() not in ("torch", "triton")))' > $(WHEELHOUSE)/requirements.txt
	$(PY) -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' > $(WHEELHOUSE)/build-requirements.txt
	$(PY) -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
	  --python-version $(WHEEL_PYTHON) $(addprefix --platform ,$(WHEEL_PLATFORMS)) \
	  -d $(WHEELHOUSE) -r $(WHEELHOUSE)/requirements.txt -r $(WHEELHOUSE)/build-requirements.txt
	@du -sh $(WHEELHOUSE)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache wheelhouse
