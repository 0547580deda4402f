# The README's two commands: `make demo` (set up everything, run the tour) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.k3sys-installed

.PHONY: setup system demo test lint bench e2b-tests e2b-js-tests

# Python side: a venv with the local CPU torch wheel pinned first, so pip never pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,dev]'  # [all]: everything (pyproject.toml says why it is an extra)
	touch $@

# System pieces (runc, CRIU, templates); each script is idempotent and caches its work.
system:
	@for s in scripts/install-*.sh; do [ -e "$$s" ] || continue; bash "$$s" || exit 1; done

setup: $(STAMP) system

demo: setup
	$(VENV)/bin/k3sys demo

test: setup
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench

# E2B's own SDK tests (packages/python-sdk/tests and packages/js-sdk of github e2b-dev/E2B, fetched
# into E2B_REPO, never vendored; docs/sandbox_e2b.md says how) against a fresh `k3sys sandbox serve`:
# per-file tables in .cache/e2b-report and .cache/e2b-js-report. The JS suite needs Node.js and npm
# (its packages go to .cache/e2b-js-deps).
E2B_REPO ?= .cache/e2b-tests
E2B_TESTS ?= $(E2B_REPO)/packages/python-sdk/tests
E2B_JS ?= $(E2B_REPO)/packages/js-sdk
e2b-tests: $(STAMP)
	$(PY) tests/sandbox/e2b_suite/runner.py $(E2B_TESTS) $(E2B_ARGS)

e2b-js-tests: $(STAMP)
	$(PY) tests/sandbox/e2b_suite/js_runner.py $(E2B_JS) $(E2B_ARGS)
