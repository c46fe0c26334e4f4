"""Stage `build`: turn the chosen weights into an engine folder for one backend.

- embedded: a portable folder (`engine.json` + `model/` weights and tokenizer) that the embedded
  runtime serves on any machine, CPU included.
- trtllm: `trtllm-build` on the ModelOpt TensorRT-LLM checkpoint (GPU host with TensorRT-LLM 1.2.x).
Outputs go to `build/<backend>/`, so both can coexist.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from trtbuild import backends
from trtbuild import manifest as mf
from trtbuild.recipe import Recipe

VERSION = 1  # bump when the output of this stage changes for the same inputs
STAGE = "build"
ENGINE_FILE = "engine.json"
GEMM_PLUGIN = {"fp8": "fp8", "int8_wo": "bfloat16", "bf16": "bfloat16"}


def weights_dir(recipe: Recipe) -> Path:
    q = recipe.build.quantization
    if q == "bf16":
        return recipe.out_dir / "merge" / "model"
    return recipe.out_dir / "quantize" / q / "hf"


def trtllm_checkpoint_dir(recipe: Recipe) -> Path:
    q = recipe.build.quantization
    if q == "bf16":
        raise ValueError(f"{recipe.path}: build.quantization: the trtllm backend builds from a quantized "
                         "checkpoint (fp8 or int8_wo) in this version (got 'bf16')")
    return recipe.out_dir / "quantize" / q / "trtllm"


def trtllm_build_command(recipe: Recipe, checkpoint_dir: Path, engine_dir: Path) -> list[str]:
    """The `trtllm-build` invocation (the AIMO-2 flags, limits from the recipe)."""
    b = recipe.build
    cmd = [
        "trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir),
        "--gemm_plugin", GEMM_PLUGIN[b.quantization],
        "--use_paged_context_fmha", "enable", "--kv_cache_type", "paged",
        "--max_batch_size", str(b.max_batch_size), "--max_seq_len", str(b.max_seq_len),
        "--max_input_len", str(b.max_input_len), "--max_num_tokens", str(b.max_num_tokens),
        "--max_beam_width", "1",
    ]
    if recipe.drafter.kind == "redrafter":
        cmd += ["--speculative_decoding_mode", "explicit_draft_tokens"]
    return cmd


def fingerprint(recipe: Recipe, backend: str) -> str:
    from merge.run import fingerprint as merge_fp
    from trtbuild.quantize import fingerprint as quant_fp

    q = recipe.build.quantization
    upstream = merge_fp(recipe) if q == "bf16" else quant_fp(recipe, q, merge_fp(recipe))
    return mf.fingerprint({"backend": backend, "build": recipe.section("build"), "serving": recipe.section("serving"),
                           "drafter": recipe.section("drafter"), "upstream": upstream,
                           "version": VERSION})


def engine_config(recipe: Recipe, backend: str) -> dict[str, Any]:
    """What a runtime needs to serve the folder, without reading the recipe again."""
    b = recipe.build
    return {
        "format_version": 1,
        "model": recipe.name,
        "backend": backend,
        "quantization": b.quantization,
        "model_dir": "model",
        "limits": {k: getattr(b, k) for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                                               "tp_size")},
        "drafter": recipe.section("drafter") if recipe.drafter.kind != "none" else None,
        "serving": recipe.section("serving"),
    }


def run(recipe: Recipe, backend: str = "auto") -> Path:
    requested = backend if backend != "auto" else recipe.build.backend
    chosen = backends.resolve(requested)
    final = recipe.out_dir / STAGE / chosen
    fp = fingerprint(recipe, chosen)
    if mf.up_to_date(final, fp, STAGE):
        return final
    src = weights_dir(recipe)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"build: no {recipe.build.quantization} weights at {src}: run the earlier stages first")
    started = time.time()
    mf.log(STAGE, f"{chosen}: building from {recipe.build.quantization} weights ({src}) ...")
    with mf.stage_dir(final) as tmp:
        extra: dict[str, Any] = {}
        if chosen == "embedded":
            shutil.copytree(src, tmp / "model", ignore=shutil.ignore_patterns(mf.MANIFEST))
        else:
            cmd = trtllm_build_command(recipe, trtllm_checkpoint_dir(recipe), tmp / "engine")
            mf.log(STAGE, "running: " + " ".join(cmd))
            subprocess.run(cmd, check=True)
            shutil.copytree(src, tmp / "model", ignore=shutil.ignore_patterns("*.safetensors", mf.MANIFEST))
            extra["command"] = cmd
        (tmp / ENGINE_FILE).write_text(json.dumps(engine_config(recipe, chosen), indent=2) + "\n")
        mf.write_manifest(tmp, f"{STAGE}/{chosen}", fp, started, backend=chosen, weights=str(src),
                          quantization=recipe.build.quantization, files=mf.hash_tree(tmp), **extra)
    mf.log(STAGE, f"{chosen}: engine ready in {final}")
    return final
