# Every target bootstraps .venv from nothing, so a fresh clone needs only python3 and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
UNAME  := $(shell uname -s)
ifeq ($(UNAME),Darwin)
EXTRAS := test
else
EXTRAS := cpu,test
endif
# Tests run in parallel (pytest-xdist, in the test extra): most of them wait on a daemon
# process. Two workers on the 2-core CI box: four ran the suite in ~12 min here but left
# timing-bound tests (heartbeats, cancel latency) starved often enough to fail a run.
# --dist loadfile: a file's tests run on one worker, so a module's daemon fixture starts
# once, not once per worker.
# `make test PYTEST_ARGS="-n 0"` runs them one at a time (tests/README.md).
PYTEST_ARGS ?= -n 2 --dist loadfile

.PHONY: demo test check serve bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m daemon.demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The quick tier for the edit-test loop (tests marked `quick`: unit and contract tests, one
# daemon-level smoke a feature; tests/README.md), same workers. `make test` stays the whole
# suite and what CI runs.
check: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS) -m "quick and not slow"

serve: $(STAMP)
	$(VENV)/bin/councild serve

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
