# Build and test the tutorial site. `make help` lists the targets.
#
# Everything runs from a virtual environment in .venv, created from
# requirements.txt on first use; the spell gate also needs aspell.

PYTHON      ?= python3
VENV        ?= .venv
SPHINXOPTS  ?=
BUILDDIR    ?= _build
PORT        ?= 8000
# `make html GALLERY_PATTERN=intro` executes only the tutorials whose path
# matches this regular expression (the others are rendered from cache).
GALLERY_PATTERN ?=

BIN         := $(VENV)/bin
SPHINXBUILD := $(BIN)/sphinx-build
STRICT      := -W --keep-going -n
STAMP       := $(VENV)/.installed

.PHONY: help html html-noplot spelling test clean serve venv check-aspell

help:
	@echo "make html                      build the site, executing every tutorial"
	@echo "make html GALLERY_PATTERN=name  execute only tutorials matching 'name'"
	@echo "make html-noplot               build the site without executing tutorials"
	@echo "make spelling                  run the spell gate (pyspelling + aspell)"
	@echo "make test                      run the test suite (builds the site once)"
	@echo "make serve [PORT=8000]         serve _build/html on http://localhost:PORT"
	@echo "make check-versions            run every page under the oldest, pinned and newest PyTorch"
	@echo "make gpu-check                 on a CUDA machine, 540 s: preflight, full size while it fits, then quick"
	@echo "make clean                     remove every build output"

venv: $(STAMP)

$(STAMP): requirements.txt requirements-tutorials.txt requirements-site.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || \
	  { echo "error: Python 3.11 or newer is needed as '$(PYTHON)' (make PYTHON=python3.11 ...)"; exit 1; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || \
	  { echo "error: Python's venv module is missing. On Debian/Ubuntu: sudo apt-get install python3-venv"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	@# the site's machinery, ragged_site/, beside the library: importable in this
	@# environment only (pyproject.toml installs the library alone)
	$(BIN)/python -c "import pathlib, site, sys; pathlib.Path(site.getsitepackages()[0], 'ragged_site.pth').write_text(sys.argv[1] + '\n')" "$(CURDIR)"
	@touch $@

check-aspell:
	@command -v aspell >/dev/null && aspell dump dicts 2>/dev/null | grep -qx en || \
	  sh scripts/install-aspell.sh

html: $(STAMP)
	GALLERY_PATTERN='$(GALLERY_PATTERN)' $(SPHINXBUILD) -M html . $(BUILDDIR) $(STRICT) $(SPHINXOPTS)
	$(BIN)/python scripts/validate_build.py . --pattern '$(GALLERY_PATTERN)'

html-noplot: $(STAMP)
	$(SPHINXBUILD) -M html . $(BUILDDIR) $(STRICT) -D plot_gallery=0 $(SPHINXOPTS)

spelling: $(STAMP) check-aspell
	$(BIN)/pyspelling -c .pyspelling.yml

test: $(STAMP) check-aspell
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

serve:
	@test -d $(BUILDDIR)/html || { echo "error: nothing built yet: run 'make html' first"; exit 1; }
	$(PYTHON) -m http.server --directory $(BUILDDIR)/html $(PORT)

clean:
	rm -rf $(BUILDDIR) auto_tutorials _generated sg_execution_times.rst gpu_results.rst

# --- issue 11: publishing and release checks --------------------------------
.PHONY: html-merged check-versions

# Build over an auto_tutorials/ that shard builds already executed (the GPU
# workflow's merge job): executes nothing, so needs only requirements-site.txt
# (no torch), installed by the caller.
html-merged:
	$(PYTHON) -m sphinx -M html . $(BUILDDIR) $(STRICT) $(SPHINXOPTS)
	$(PYTHON) scripts/validate_build.py .

# Every tutorial in quick mode under the oldest supported, the pinned and the
# newest PyTorch, each in its own environment under .venvs/ (several GB);
# writes .github/checked-versions.json, which the pages quote.
check-versions:
	$(PYTHON) scripts/check_versions.py

# --- the GPU check -------------------------------------------------------------
.PHONY: gpu-check

# On a bare CUDA machine (PyTorch, numpy and matplotlib; no Sphinx, no
# network), one command of at most 540 s: a short preflight, full size for
# the decision page alone, then the others shortest first while they fit,
# then quick mode for the pages left; outputs and summary.json in gpu-check/.
# GPU_CHECK_ARGS=--dry-run prints the expected timeline (anywhere). Uses the
# machine's own python, not the virtual environment. Stops at once, naming
# CUDA, where there is none. Without make: python scripts/gpu_check.py --out gpu-check
gpu-check:
	$(PYTHON) scripts/gpu_check.py --out gpu-check --limit 540 $(GPU_CHECK_ARGS)
