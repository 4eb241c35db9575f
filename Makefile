# One command each, on a fresh machine: `make demo` runs the main job, `make test` passes the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
SEEDS ?= 5
PYTEST_ARGS ?=
# Tests run side by side in this many pytest-xdist workers (0: one process). Most multi-process tests spend
# their time waiting on leases, steps and start-up, not on the CPU, so three share two cores well.
TEST_WORKERS ?= 3

# The demo: 3 nodes of the example job, node 1 killed with SIGKILL after step 30, a 4th node added after step 60.
DEMO_ARGS := --config examples/job.yaml --nodes 3 --kill-node 1@step=30 --add-node @step=60

# `make compat`: the tests that reach torch's internals, the rendezvous, the hot path and the checkpoints, on
# the oldest and the newest torch pyproject claims, each in a venv of its own (.ci/compat).
COMPAT_TORCH ?= 2.13.0 2.14.1

.PHONY: setup test test-long demo readme-demo lint bench chaos compat clean

# The CPU torch wheel is installed first, pinned, so that resolving the project's torch range never pulls
# a multi-GB CUDA build; the project is then installed with the torch already there pinned, since pip's
# resolver, backtracking over s3fs/aiobotocore/fsspec pins, otherwise "upgrades" it to the newest build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev]' "torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not long" $(PYTEST_ARGS)

# The longer fault scenarios (marker `long`): each beside one of its kind that make test runs. Those that
# measure the machine's speed (marker `solo`: slow-node detection) run after the others, one at a time, with
# the cores to themselves: the other tests' load would be a slow node of its own to them.
test-long: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "long and not solo" $(PYTEST_ARGS)
	$(PY) -m pytest -m "long and solo" $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/elastic-train local $(DEMO_ARGS) --summary demo-summary.json

# Runs the demo and writes its output (fault lines and summary) into README.md, between the readme-demo markers.
readme-demo: setup
	mkdir -p runs
	$(VENV)/bin/elastic-train local $(DEMO_ARGS) --summary demo-summary.json | tee runs/readme-demo.txt
	$(PY) tests/docs/readme_demo.py runs/readme-demo.txt README.md

lint: setup
	$(VENV)/bin/ruff check elastic_train tests benchmarks examples
	$(VENV)/bin/ruff format --check elastic_train tests benchmarks examples
	$(VENV)/bin/mypy

bench: setup
	$(PY) benchmarks/report.py --out docs/benchmarks.md --rendezvous-args "--repeats 2 --cap 60" $(BENCH_ARGS)

chaos: setup
	$(PY) -m pytest tests/chaos/test_chaos.py tests/chaos/test_partition_full.py tests/chaos/test_slow_nodes.py \
		--chaos-seeds=$(SEEDS) \
		--chaos-md docs/chaos.md --chaos-json docs/chaos.json

compat: setup
	VENV=$(VENV) COMPAT_TORCH="$(COMPAT_TORCH)" TEST_WORKERS=$(TEST_WORKERS) .ci/compat $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-compat-* .pytest_cache .mypy_cache .ruff_cache build *.egg-info
