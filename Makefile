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
# Tests run on both cores; pytest-xdist is not a dependency, so this is plain pytest.
PYTEST_ARGS ?=

.PHONY: demo test serve bench clean venv

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

serve: $(STAMP)
	$(VENV)/bin/councild serve

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
