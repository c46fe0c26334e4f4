"""Shared by the TensorRT-LLM contract tests (test_trtllm_contract.py: the build; test_trtllm_runtime_contract.py:
the runtime): the GPUs and environment they pretend, a recipe whose earlier stages look finished, a
drafter folder, and an engine built and opened over the `tensorrt_llm` double.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import trtllm_double as dbl
from small_recipes import write_recipe
from trtllm_command_double import FakeRunner, parse_flags

from aimo_spec.recipe import load_recipe
from trtbuild import build as build_stage
from trtbuild import manifest as mf
from trtbuild.trtllm.env import Gpu, TrtllmEnv

PY = "/opt/trtllm/bin/python"
H100 = Gpu(0, "NVIDIA H100 80GB HBM3", (9, 0), 81559)
A100 = Gpu(0, "NVIDIA A100-SXM4-80GB", (8, 0), 81920)


@pytest.fixture
def examples(tmp_path) -> Path:
    ex = tmp_path / "examples"
    for f in ("quantization/quantize.py", "redrafter/convert_checkpoint.py"):
        (ex / f).parent.mkdir(parents=True, exist_ok=True)
        (ex / f).write_text("# stands for TensorRT-LLM's script\n")
    return ex


def gpu_env(examples: Path | None, gpus=(H100,)) -> TrtllmEnv:
    return TrtllmEnv(python=PY, packages={"tensorrt-llm": "1.2.1"}, examples=examples, gpus=list(gpus))


@pytest.fixture
def project(tiny_models, tmp_path, monkeypatch):
    """A recipe whose earlier stages look finished: merged model and quantize outputs in place."""
    dbl.install(monkeypatch)

    def make(**sections):
        path = write_recipe(tmp_path, "trt", {"cot": {"kind": "hf", "path": str(tiny_models["qwen-cot"])},
                                              "tir": {"kind": "hf", "path": str(tiny_models["qwen-tir"])}}, **sections)
        recipe = load_recipe(path)
        out = recipe.out_dir
        if not (out / "merge" / "model").is_dir():
            shutil.copytree(tiny_models["qwen-tir"], out / "merge" / "model")
            for fmt in ("int8_wo", "fp8"):
                shutil.copytree(tiny_models["qwen-tir"], out / "quantize" / fmt / "hf")
            (out / "quantize" / "fp8" / "trtllm").mkdir(parents=True)
            (out / "quantize" / "fp8" / "trtllm" / "config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
            mf.write_manifest(out / "quantize" / "fp8", "quantize/fp8", "fp-export", 0.0)
        return recipe
    return make


def drafter_folder(tmp_path: Path, trained: int = 3) -> Path:
    d = tmp_path / "drafter"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"hidden_size": 64, "exit_dim": 128, "num_draft_layers": 2, "rnn": True,
                                               "vocab_size": 400, "trained_draft_len": trained}))
    (d / "model.safetensors").write_bytes(b"weights")
    return d


def flags(cmd: list[str], start: int) -> dict[str, str | None]:
    tool = Path(cmd[start - 1]).name
    return parse_flags(tool, cmd[start:])


@pytest.fixture
def engine_dir(project, examples):
    return build_stage.run(project(), "trtllm", trtllm_env=gpu_env(examples), runner=FakeRunner())


def open_engine(engine_dir, script, step=0.002):
    from server.trtllm.engine import TrtllmEngine

    dbl.Executor.script = staticmethod(script)
    dbl.Executor.step_seconds = step
    return TrtllmEngine.from_dir(engine_dir)


def run(coro):
    return asyncio.run(coro)
