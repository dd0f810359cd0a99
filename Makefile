# kvfleet: `make test` and `make demo` each do the set-up first.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	# Pin the CPU torch first: an unpinned torch pulls a multi-GB CUDA build.
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: setup
	$(VPY) -m pytest -q

demo: setup
	$(VPY) -m services.common.cli demo

bench: setup
	$(VPY) -m services.common.cli bench engine

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
