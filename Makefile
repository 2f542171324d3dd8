# Capsule Networks, Derived and Reproduced
#   make book       execute every chapter at this machine's profile, build _build/html
#   make test       unit tests and every notebook under nbval at the ci profile (two at a time),
#                   strict book build, student edition check
#   make test-browser  every page of the built book in headless Chromium at 1280 and 400 px (.ci/run)
#   make reproduce  the full profile (GPU): re-execute the notebooks in place, refresh results, build
#                   (CHAPTERS="02 04": only those chapters, no build)
#   make publish    re-execute the committed notebooks in place from scratch (no resumed checkpoints)
#   make bundle     dist/offline: wheels, full MNIST, the book and run.sh for a GPU node without internet
#                   (PYTHON_VERSION=3.12 for the node's Python); make test-bundle installs and runs it here
#   make bench      training speed of each chapter's full model on this machine (images/s, TFLOP/s)
#   make smoke      the full profile's code paths, 2 epochs and a few hundred images (copies in _build/smoke)
#   make assignments  per otter-grader master in book/assignments/: the student notebook and the autograder zip
#   make book-student the HTML book without exercise solutions (_build/student/_build/html)
#   make ta-export  the hand-graded answers of a class's submissions as HTML pages for TAs (_build/ta)
#   make spread     re-measure every claim on a trained number over seeds and thread counts (about 75 min)
#   make lock       re-resolve requirements.txt into requirements.lock in a clean venv
#   make units      every experiment unit (paper scale in short GPU jobs): missing / done / stale
#   make gpu-data   full MNIST, compressed, in .gpu/data for a GPU machine without network
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOCK := requirements.lock
# The torch the lock pins: this machine kind's pip configuration offers a CPU build of it
# (no CUDA packages); elsewhere pip takes the same version from the registry.
TORCH_VERSION := 2.13.0
# make test runs the unit tests and the chapters' nbval executions TEST_JOBS at a time, each process
# at TEST_THREADS torch threads (fixed, so that two executions record identical numbers); every
# chapter's claims are measured at 1 and 2 threads (make spread)
TEST_JOBS ?= 2
TEST_THREADS ?= 1
SEEDS ?= 0 1 2 3 4
CHAPTERS ?=

.PHONY: ta-export gpu-data peers gpu-prep units bench bundle test-bundle book publish test test-browser checks unit notebooks build-strict reproduce paper-scale smoke data assignments book-student student-check compare-student clean venv lock spread

# The lock is installed with uv (about 10 s here against about 170 s for pip: parallel unpacking, no
# bytecode compiled ahead); uv does not read pip's configuration, so pip's find-links folders (this
# machine kind's local CPU torch) are passed to it. If uv cannot be had or fails, pip installs the same
# lock. The output of both goes to _build/install.log (its last lines are printed if it fails).
UV_VERSION := 0.13.9
FIND_LINKS := $(wildcard $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)))
UV_INSTALL = $(VENV)/bin/uv pip install --python $(PY) $(addprefix --find-links ,$(FIND_LINKS))
$(STAMP): $(LOCK) pyproject.toml
	@mkdir -p _build; echo "installing $(LOCK) into $(VENV) (log: _build/install.log)"; start=$$(date +%s); \
	{ test -x $(PY) || $(PYTHON) -m venv $(VENV); } > _build/install.log 2>&1 || { cat _build/install.log; exit 1; }; \
	if $(PY) -m pip install uv==$(UV_VERSION) >> _build/install.log 2>&1 && \
	   $(UV_INSTALL) -r $(LOCK) >> _build/install.log 2>&1 && \
	   $(UV_INSTALL) --no-deps -e . >> _build/install.log 2>&1; then tool=uv; \
	else echo "uv failed (see _build/install.log); installing with pip"; tool=pip; \
	  $(PY) -m pip install -r $(LOCK) >> _build/install.log 2>&1 && \
	  $(PY) -m pip install --no-deps -e . >> _build/install.log 2>&1 || { tail -n 30 _build/install.log; exit 1; }; fi; \
	$(PY) -m pip check >> _build/install.log 2>&1 || { tail -n 30 _build/install.log; exit 1; }; \
	echo "installed with $$tool in $$(( $$(date +%s) - start )) s"
	@touch $(STAMP)

venv: $(STAMP)

# make book executes copies of the notebooks in _build/book-src (tracked files are never touched,
# results go to _build/book-src/book/results), each cell limited to BOOK_CELL_TIMEOUT seconds, and
# builds the HTML from them; PROFILE=ci or full overrides the machine's default (full on a GPU).
PROFILE ?= auto
BOOK_CELL_TIMEOUT ?= 1800
book: $(STAMP)
	@$(PY) -m capslib.tools.reproduce --profile $(PROFILE) --timeout $(BOOK_CELL_TIMEOUT) --into _build/book-src all
	@start=$$(date +%s); $(VENV)/bin/jupyter-book build _build/book-src --builder html --path-output . \
	  > _build/book-build.log 2>&1 || { tail -n 30 _build/book-build.log; exit 1; }; \
	  echo "built the HTML in $$(( $$(date +%s) - start )) s (log: _build/book-build.log)"
	@echo "book: _build/html/index.html"

# the two HTML builds (the strict one and the student edition) read the committed notebooks and write
# to separate folders: they are jobs of the pool (they fill the slot the last chapters leave idle),
# then the student edition is compared with the strict build
test: checks
	@$(MAKE) --no-print-directory compare-student

# the unit tests, every chapter and the scoreboard under nbval, and the two HTML builds, as a pool
# (capslib/tools/testpool.py; logs in _build/test-logs)
checks: $(STAMP)
	@$(PY) -m capslib.tools.testpool --jobs $(TEST_JOBS) --threads $(TEST_THREADS)

unit: $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q tests || exit 1; \
	  echo "unit tests: $$(( $$(date +%s) - start )) s"

# make notebooks: the same nbval executions one after another, through the same runner as make test
# (a chapter whose cell hits nbval's timeout is executed once more; any other failure counts at once)
CHAPTER_NUMS := $(shell ls book/[0-9][0-9]_*.ipynb | xargs -n1 basename | cut -c1-2)
notebooks: $(STAMP)
	@$(PY) -m capslib.tools.testpool --jobs 1 --threads $(TEST_THREADS) $(CHAPTER_NUMS) scoreboard

build-strict: $(STAMP)
	@start=$$(date +%s); $(VENV)/bin/jupyter-book build . --builder html --warningiserror --keep-going || exit 1; \
	  echo "strict build: $$(( $$(date +%s) - start )) s"

# make test-browser: the strict build opened in Debian's Chromium through Playwright (loopback server,
# no request may leave it): every page at 1280 and 400 px, failing on raw TeX, console errors, frame
# players whose slider does not change the frame, a menu that does not open and figures scaled below
# legibility (tests/test_browser.py); screenshots and the per-page report in _build/screens/
test-browser: build-strict
	@chromium=$$(command -v chromium) || { echo "test-browser: needs Debian's chromium (apt-get install -y chromium)"; exit 1; }; \
	  start=$$(date +%s); CAPSBOOK_BROWSER=1 CAPSBOOK_CHROMIUM=$$chromium timeout 420 $(PY) -m pytest -q -p no:cacheprovider \
	    tests/test_browser.py -k "chromium or weights or reading or narrowed"; rc=$$?; \
	  echo "browser test: $$(( $$(date +%s) - start )) s (report: _build/screens/report.txt)"; exit $$rc

# make reproduce CHAPTERS="02 04": those chapters at the full profile, executed in place one at a
# time (trainings resume from their checkpoints); no CHAPTERS: every chapter, then the book.
reproduce: $(STAMP)
	@if [ -n "$(CHAPTERS)" ]; then $(PY) -m capslib.tools.reproduce --profile full $(CHAPTERS); \
	  else $(PY) -m capslib.tools.reproduce --profile full all; fi
	@# the build on a line of its own: make runs a line that names $$(MAKE) even under -n, so a dry run of this
	@# target must not share that line with the executions above
	@if [ -z "$(CHAPTERS)" ]; then $(MAKE) --no-print-directory build-strict; fi

# make paper-scale: after a GPU allocation committed new unit results (book/results/full/), the committed
# notebooks' paper-scale cells executed again in place (nothing else is run); commit the notebooks
paper-scale: $(STAMP)
	@$(PY) -m capslib.tools.reproduce --paper-scale all

# make publish: the committed notebooks re-executed in place from a clean state (every training from
# scratch, no checkpoint of an earlier execution), then the strict build; PROFILE as for make book
publish: $(STAMP)
	@$(PY) -m capslib.tools.reproduce --profile $(PROFILE) --fresh all
	@$(MAKE) --no-print-directory build-strict
	$(PY) -m pytest -q tests/test_outputs.py

# the offline bundle for a GPU node without internet (PYTHON_VERSION: the node's Python)
PYTHON_VERSION ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
bundle: $(STAMP)
	$(PY) -m capslib.tools.bundle --python-version $(PYTHON_VERSION) --out dist/offline

# the bundle built for this machine, installed with --no-index into a bare venv that sees only a
# stand-in of a GPU image (torch and the scientific stack of .venv), then chapter 1 run by its run.sh
# and full MNIST read from its data (about a minute; not part of make test, which is at its budget)
test-bundle: $(STAMP)
	rm -rf _build/bundle-test && mkdir -p _build/bundle-test
	$(PY) -m capslib.tools.bundle --out _build/bundle-test/offline
	$(PYTHON) -m venv _build/bundle-test/venv
	$(PY) -c 'from pathlib import Path; from capslib.tools.bundle import stock_site; print(stock_site(Path("_build/bundle-test/stock")), "distributions stand in for the image")'
	echo "$(CURDIR)/_build/bundle-test/stock" > $$(_build/bundle-test/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/stock.pth
	! _build/bundle-test/venv/bin/python -c 'import nbclient' 2>/dev/null
	cd _build/bundle-test && PYTHON=$(CURDIR)/_build/bundle-test/venv/bin/python CAPSBOOK_PROFILE=ci CAPSBOOK_SMOKE=1 \
	  CAPSBOOK_THREADS=2 offline/run.sh 01
	cd _build/bundle-test/offline/work/src && PYTHONPATH=../site:. CAPSBOOK_DATA=data ../../../venv/bin/python -c \
	  'from capslib import data; s = data.load("mnist"); assert [len(s[k]) for k in ("train", "val", "test")] == [55000, 5000, 10000]; print("full MNIST from the bundle: 55000/5000/10000")'
	@echo "test-bundle: ok"

# training speed of each chapter's full model on this machine (add BENCH_ARGS=--compile on a GPU)
bench: $(STAMP)
	$(PY) -m capslib.tools.bench $(BENCH_ARGS)

smoke: $(STAMP)
	$(PY) -m capslib.tools.smoke --profile full

data: $(STAMP)
	$(PY) -m capslib.data fetch mnist

# full MNIST as gzip-compressed idx files in .gpu/data/MNIST/raw (git-ignored), to carry to a GPU machine
# without network: there, CAPSBOOK_DATA=.gpu/data python3 -m capslib.tools.experiments run --budget 480 --jobs 2
gpu-data: data
	@mkdir -p .gpu/data/MNIST/raw; for f in data/MNIST/raw/*-ubyte; do gzip -9c $$f > .gpu/data/MNIST/raw/$$(basename $$f).gz; done
	@du -sh .gpu/data

# the two public implementations issue 30's speed targets are stated against, exported (never committed) into
# .gpu/peers from the git mirrors a session's fetch tool makes (github:XifengGuo/CapsNet-Pytorch,
# github:yl-1993/Matrix-Capsules-EM-PyTorch); python -m capslib.tools.side_by_side times them against capslib
PEERS_MIRROR ?= /work/.mirror
peers:
	@for r in XifengGuo+CapsNet-Pytorch yl-1993+Matrix-Capsules-EM-PyTorch; do \
	  g=$(PEERS_MIRROR)/$$r/repo/.git; name=$${r#*+}; \
	  if [ ! -d $$g ]; then echo "no mirror $$g: fetch github:$${r%%+*}/$$name first"; exit 1; fi; \
	  rm -rf .gpu/peers/$$name && mkdir -p .gpu/peers/$$name && git --git-dir=$$g archive HEAD | tar -x -C .gpu/peers/$$name && \
	  echo "$$name at $$(git --git-dir=$$g rev-parse --short HEAD) -> .gpu/peers/$$name"; done

# before a GPU allocation: the data and the peers into .gpu/ (what the device call carries), then the
# allocation's command rehearsed here at smoke sizes (its report in _build/alloc-rehearsal/summary.txt)
gpu-prep: gpu-data
	@$(MAKE) --no-print-directory peers || echo "no peers: the allocation will skip the side-by-side timing"
	@mkdir -p _build; $(PY) -m capslib.tools.allocation run --seconds 120 --out _build/alloc-rehearsal --smoke > _build/alloc-rehearsal.log 2>&1 || true
	@head -5 _build/alloc-rehearsal/summary.txt
	@! grep -E "^(fast check|side by side): exit [^0]" _build/alloc-rehearsal/summary.txt

# every experiment unit: missing / done / stale, projected minutes on one H100
units: $(STAMP)
	@$(PY) -m capslib.tools.experiments status

# per master: _build/assignments/<name>/student/ (hand out) and autograder/<name>-autograder.zip
# (otter run or Gradescope; capslib travels inside it). GRADING_SECRET=... seeds the hidden tests'
# inputs (kept out of the command line's echo); unset, each zip gets a fresh random secret.
# VARIANTS=N also builds variants 1..N-1 of every master that declares them (student-v<k>/ to hand out,
# solved-v<k>/ for the instructor; the one zip grades each submission by the variant its metadata names)
# make ta-export SUBMISSIONS="<folders, notebooks or otter zips>" [OUT=_build/ta] [ANONYMOUS=1]: the
# hand-graded questions of every submission as HTML pages for teaching assistants (capslib.tools.ta_export)
ta-export: $(STAMP)
	$(PY) -m capslib.tools.ta_export $(SUBMISSIONS) --out $(or $(OUT),_build/ta) $(if $(ANONYMOUS),--anonymous)

assignments: $(STAMP)
	@echo "$(PY) -m capslib.tools.grading build book/assignments/*.ipynb --out _build/assignments --variants $(or $(VARIANTS),1)"
	@GRADING_SECRET='$(GRADING_SECRET)' $(PY) -m capslib.tools.grading build book/assignments/*.ipynb --out _build/assignments --variants $(or $(VARIANTS),1)

# the HTML book without exercise solutions (sphinx-exercise's hide_solutions) and without the chapters'
# functions that answer an assignment (the masters' book_answers), in _build/student/_build/html; the
# folder is emptied first (Sphinx keeps files it no longer writes, e.g. an earlier build's _sources)
book-student: $(STAMP)
	@start=$$(date +%s); rm -rf _build/student/_build/html; \
	  $(PY) -m capslib.tools.grading student-config --dest _build/student/_config.yml >/dev/null && \
	  $(VENV)/bin/jupyter-book build . --builder html --config _build/student/_config.yml \
	    --path-output _build/student --warningiserror --keep-going > _build/student-build.log 2>&1 \
	    || { tail -n 30 _build/student-build.log; exit 1; }; \
	  echo "student edition: _build/student/_build/html ($$(( $$(date +%s) - start )) s)"

# every solution's text is in the book built by build-strict and none is in the student edition
student-check: build-strict book-student
	@$(MAKE) --no-print-directory compare-student

compare-student: $(STAMP)
	$(PY) -m capslib.tools.grading check-student --normal _build/html --student _build/student/_build/html \
	  book/*.ipynb book/*.md --masters book/assignments/*.ipynb

# The lock: requirements.txt resolved by pip in a clean venv and frozen (exact versions of
# everything installed). torchvision is left out: every registry build of it is a CUDA build
# that cannot load beside a CPU torch; the book needs it only for datasets a GPU run may use.
lock:
	rm -rf _build/lockenv && mkdir -p _build && $(PYTHON) -m venv _build/lockenv
	sed '/^torchvision/d' requirements.txt > _build/lock-input.txt
	_build/lockenv/bin/python -m pip install torch==$(TORCH_VERSION) -r _build/lock-input.txt
	_build/lockenv/bin/python -m pip check
	{ echo "# Exact versions the notebooks were executed with: made by 'make lock' from requirements.txt"; \
	  echo "# (Python $$(_build/lockenv/bin/python -c 'import platform; print(platform.python_version())'), $$(date +%Y-%m-%d)). torch is pinned without its local label (+cpu)."; \
	  _build/lockenv/bin/python -m pip freeze --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*/\1/'; } > $(LOCK)
	rm -rf _build/lockenv
	@echo "$(LOCK): $$(grep -c '==' $(LOCK)) pinned packages"

spread: $(STAMP)
	$(PY) -m capslib.tools.spread --seeds $(SEEDS) --threads 2 $(if $(CHAPTERS),--chapters $(CHAPTERS))
	$(PY) -m capslib.tools.spread --seeds $(SEEDS) --threads 1 --jobs 2 $(if $(CHAPTERS),--chapters $(CHAPTERS))

clean:
	rm -rf _build
