# Two commands: `make repro` sets up and runs the pipeline; `make test` sets up and runs the tests.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Stage commands in dvc.yaml (`python -m ...`) must find the venv's python.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup repro test test-fast test-gpu lint format docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	@# pip compiles the bytecode one file at a time; compileall uses every core (68 s of setup
	@# against 70-75 s, docs/tests.md). A few packages ship templates that are not Python: `|| true`.
	$(PY) -m compileall -qq -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || true
	touch $(STAMP)

repro: setup
	$(VENV)/bin/visionflow repro
	@$(PY) -c "import json; m = json.load(open('results/evaluate/metrics.json')); \
		print('test', {k: round(v, 4) for k, v in m.items()})"

# A worker per core and one more, at most 5: each runs DVC, torch and Prefect processes of its
# own, and waits on them part of the time (measured in docs/tests.md). Each worker is handed one
# test at a time, in the order tests/conftest.py sets (the longest early), not a batch of them.
WORKERS := -n $(shell n=$$(nproc); echo $$(( n < 4 ? n + 1 : 5 ))) --maxschedchunk 1

test: setup
	$(PY) -m pytest $(WORKERS) --durations=15

test-fast: setup
	$(PY) -m pytest $(WORKERS) -m "not slow"

# On a machine with CUDA: the tests marked gpu and a GPU smoke of the pipeline (dvc repro, resume,
# a resnet18 fine-tune, export, predict), no venv needed; where DVC is not installed, run
# tools/gpu_wheels.sh beforehand on a machine with the venv (docs/benchmarks.md, "The GPU check")
test-gpu:
	tools/gpu_check.sh

# The manual (docs/, mkdocs.yml) into site/; --strict fails on a broken link or a page left out
# of the nav. After changing params, rewrite its reference: $(PY) docs/make_reference.py
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf results data/prepared dvc_plots .pytest_cache site
