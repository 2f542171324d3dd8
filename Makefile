# Capsule Networks, Derived and Reproduced
#   make book       execute every chapter at this machine's profile, build _build/html
#   make test       unit tests, every notebook under nbval at the ci profile, strict book build
#   make reproduce  the full profile (GPU): re-execute the notebooks in place, refresh results, build
#   make smoke      the full profile's code paths, 1 epoch and a few hundred images (copies in _build/smoke)
#   make assignments  student and autograder versions of the otter-grader masters in book/assignments/
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard book/[0-9]*.ipynb)) book/scoreboard.ipynb

.PHONY: book test unit notebooks build-strict reproduce smoke data assignments clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

book: $(STAMP)
	@for nb in $(NOTEBOOKS); do \
	  start=$$(date +%s); \
	  $(PY) -m jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=-1 --ExecutePreprocessor.kernel_name=python3 "$$nb" || exit 1; \
	  echo "executed $$nb in $$(( $$(date +%s) - start )) s"; \
	done
	$(VENV)/bin/jupyter-book build . --builder html
	@echo "book: _build/html/index.html"

test: unit notebooks build-strict

unit: $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q tests || exit 1; \
	  echo "unit tests: $$(( $$(date +%s) - start )) s"

notebooks: $(STAMP)
	@for nb in $(NOTEBOOKS); do \
	  start=$$(date +%s); \
	  CAPSBOOK_PROFILE=ci $(PY) -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env \
	    --nbval-cell-timeout=900 "$$nb" || exit 1; \
	  echo "nbval $$nb: $$(( $$(date +%s) - start )) s"; \
	done

build-strict: $(STAMP)
	@start=$$(date +%s); $(VENV)/bin/jupyter-book build . --builder html --warningiserror --keep-going || exit 1; \
	  echo "strict build: $$(( $$(date +%s) - start )) s"

reproduce: $(STAMP)
	CAPSBOOK_PROFILE=full $(MAKE) book

smoke: $(STAMP)
	$(PY) -m capslib.smoke --profile full

data: $(STAMP)
	$(PY) -m capslib.data fetch mnist

assignments: $(STAMP)
	@for m in book/assignments/*.ipynb; do \
	  out=_build/assignments/$$(basename $$m .ipynb); rm -rf $$out; \
	  $(PY) -m otter assign $$m $$out || exit 1; \
	  echo "$$m -> $$out/student (hand out) and $$out/autograder (keep)"; \
	done

clean:
	rm -rf _build
