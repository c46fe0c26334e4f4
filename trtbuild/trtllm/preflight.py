"""Checks that fail a TensorRT-LLM build before any GPU work, naming the recipe key and the value.

Each check reads only files and the GPU list: the model's config.json, the drafter's config.json
and `nvidia-smi`. A failure costs milliseconds here instead of a crash an hour into a build.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from aimo_spec.recipe import Recipe, RecipeError
from trtbuild.trtllm.env import EXAMPLES_ENV, TrtllmEnv

# HF architecture -> the TensorRT-LLM model class that converts it (tensorrt_llm.models)
MODEL_CLASSES = {
    "LlamaForCausalLM": "LLaMAForCausalLM",
    "MistralForCausalLM": "LLaMAForCausalLM",
    "Qwen2ForCausalLM": "QWenForCausalLM",
}
# ReDrafter exists for these bases only (examples/redrafter/convert_checkpoint.py REDRAFTER_MAP)
REDRAFTER_BASES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
DRAFTER_FILES = ("config.json", "model.safetensors")
# The drafter config key the drafter stage writes: how many draft steps the head was trained for.
TRAINED_DRAFT_LEN_KEY = "trained_draft_len"


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def architecture(model_config: dict[str, Any]) -> str:
    archs = model_config.get("architectures") or []
    return archs[0] if archs else ""


def needs_examples(recipe: Recipe) -> bool:
    """FP8 via quantize.py, FP8 KV cache, and ReDrafter use scripts from TensorRT-LLM's examples/."""
    q = recipe.build.quantization
    return ((q == "fp8" and recipe.trtllm.fp8_checkpoint == "quantize_py") or recipe.quantize.kv_cache_dtype == "fp8"
            or recipe.drafter.kind == "redrafter")


def check(recipe: Recipe, env: Optional[TrtllmEnv], model_config: dict[str, Any],
          drafter_config: Optional[dict[str, Any]] = None) -> list[str]:
    """Every problem found, each one line `file: key: what (got value)`; empty when the build may start.

    `env` None skips the GPU checks (planning on a machine without GPUs).
    """
    where = str(recipe.path)
    problems: list[str] = []

    def fail(key: str, msg: str, value: Any) -> None:
        problems.append(f"{where}: {key}: {msg} (got {value!r})")

    b, d = recipe.build, recipe.drafter
    arch = architecture(model_config)
    if arch not in MODEL_CLASSES:
        fail("merge", f"the merged model's architecture is not one this toolkit converts "
                      f"({', '.join(MODEL_CLASSES)})", arch or "none")
    heads = int(model_config.get("num_attention_heads", 0))
    kv_heads = int(model_config.get("num_key_value_heads", heads))
    tp = b.tp_size
    if heads and heads % tp:
        fail("build.tp_size", f"must divide the model's num_attention_heads ({heads})", tp)
    elif kv_heads and (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
        fail("build.tp_size", f"must divide num_key_value_heads ({kv_heads}) or be a multiple of it "
                              "(TensorRT-LLM duplicates KV heads only then)", tp)
    if env is not None:
        gpus = env.gpus
        if b.tp_size > len(gpus):
            fail("build.tp_size", f"needs {b.tp_size} GPUs; this host has {len(gpus)}", b.tp_size)
        for g in gpus[: b.tp_size]:
            if b.quantization == "fp8" and not g.supports_fp8:
                fail("build.quantization", f"FP8 needs compute capability >= 8.9 (Ada/Hopper); GPU {g.index} is "
                                           f"{g.name} (SM {g.sm}); use int8_wo", b.quantization)
            if recipe.quantize.kv_cache_dtype == "fp8" and not g.supports_fp8:
                fail("quantize.kv_cache_dtype", f"an FP8 KV cache needs compute capability >= 8.9; GPU {g.index} is "
                                                f"{g.name} (SM {g.sm})", "fp8")
        if needs_examples(recipe) and env.examples is None:
            fail("build", f"this recipe needs TensorRT-LLM's examples/ folder (set {EXAMPLES_ENV})",
                 b.quantization if d.kind == "none" else "redrafter")
    if b.quantization == "bf16" and recipe.quantize.kv_cache_dtype == "fp8":
        fail("quantize.kv_cache_dtype", "an FP8 KV cache needs build.quantization fp8 or int8_wo", "fp8")
    if d.kind == "redrafter":
        if arch and arch not in REDRAFTER_BASES:
            fail("drafter.kind", f"ReDrafter supports {', '.join(REDRAFTER_BASES)} bases only; the model is {arch}",
                 d.kind)
        if drafter_config is None:
            fail("drafter.path", f"no drafter folder with {' + '.join(DRAFTER_FILES)}", d.path)
        else:
            for key in ("hidden_size", "exit_dim", "num_draft_layers", "rnn"):
                if key not in drafter_config:
                    fail("drafter.path", f"the drafter's config.json lacks {key!r}", d.path)
            trained = drafter_config.get(TRAINED_DRAFT_LEN_KEY)
            if trained is not None and d.draft_len_per_beam > int(trained):
                fail("drafter.draft_len_per_beam", f"the drafter was trained for {trained} draft steps",
                     d.draft_len_per_beam)
            hidden = model_config.get("hidden_size")
            if hidden and drafter_config.get("hidden_size") not in (None, hidden):
                fail("drafter.path", f"drafter hidden_size {drafter_config.get('hidden_size')} != the model's {hidden}",
                     d.path)
    return problems


def drafter_dir(recipe: Recipe) -> Optional[Path]:
    if recipe.drafter.kind != "redrafter":
        return None
    if recipe.drafter.path:
        return recipe.resolve(recipe.drafter.path)
    return recipe.layout.drafter_model  # what the drafter stage writes


def load_drafter_config(recipe: Recipe) -> Optional[dict[str, Any]]:
    folder = drafter_dir(recipe)
    if folder is None or not all((folder / f).is_file() for f in DRAFTER_FILES):
        return None
    return read_json(folder / "config.json")


def require(recipe: Recipe, env: Optional[TrtllmEnv], model_config: dict[str, Any]) -> None:
    """Raise RecipeError listing every problem (the first line names the first one)."""
    problems = check(recipe, env, model_config, load_drafter_config(recipe))
    if problems:
        raise RecipeError("\n".join(problems))
