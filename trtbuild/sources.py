"""Stage `sources`: make every recipe source an HF checkpoint folder the merge can read.

- `hf`: used in place (recorded with hashes, never copied: real checkpoints are large).
- `gguf_package`: a GGUF shipped in a Python package, dequantized to bf16 safetensors.
- `tir_finetune`: LoRA on synthetic TIR traces over another source (see tir_finetune.py).
Each source gets `sources/<name>/` with its own manifest, so a failure in one keeps the others.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from aimo_spec.recipe import GGUFPackageSource, HFSource, Recipe, RecipeError, TIRFinetuneSource, gguf_file, to_data
from aimo_spec.safetensors_header import SafetensorsError, check_whole
from trtbuild import manifest as mf
from trtbuild import stages
from trtbuild.tir_data import VERSION as TIR_VERSION

VERSION = 2  # bump when the output of this stage changes for the same inputs (2: TIR fine-tune in float32 on CPU)
STAGE = "sources"


def gguf_path(src: GGUFPackageSource, where: str) -> Path:
    return gguf_file(src, f"{where}: sources")


def checkpoint_tensors(folder: Path, where: str) -> dict[str, list[int]]:
    """An HF checkpoint folder's tensors (name -> shape), from its config.json and safetensors headers, no
    weights read; `where` ("<recipe>: sources.<name>.path") prefixes the RecipeError naming a file that is not
    whole: a config.json that is not a JSON object, a header that is not a safetensors header (a truncated or
    garbage file), no weights at all. Checkpoints of PyTorch .bin files only are taken as they are (no shapes)."""
    config = folder / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecipeError(f"{where}: {config}: not a readable JSON config ({type(e).__name__}: "
                          f"{str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: {config}: a model config is a JSON object (got a {type(data).__name__})")
    files = sorted(folder.glob("*.safetensors"))
    if not files and not any(folder.glob("*.bin")):
        raise RecipeError(f"{where}: no weights in {folder} (no *.safetensors, nor *.bin)")
    shapes: dict[str, list[int]] = {}
    for f in files:
        try:
            shapes.update({name: t["shape"] for name, t in check_whole(f).items()})
        except (SafetensorsError, OSError) as e:
            raise RecipeError(f"{where}: {e}") from None
    return shapes


def gguf_to_hf(path: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint into a bf16 HF folder (model + tokenizer + chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
    if getattr(model, "hf_quantizer", None) is not None:
        # Otherwise save_pretrained records a GGUF quantization config for bf16 tensors.
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def _fingerprint(recipe: Recipe, name: str) -> str:
    src = recipe.sources[name]
    data: dict[str, Any] = {"source": to_data(src), "version": VERSION}
    if isinstance(src, TIRFinetuneSource):
        data["base"] = _fingerprint(recipe, src.base)
        data["tags"] = to_data(recipe.serving.code_tags)
        data["system_prompt"] = recipe.serving.system_prompt
        data["tir_version"] = TIR_VERSION
    if isinstance(src, HFSource):
        p = recipe.resolve(src.path)
        data["files"] = {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(p.glob("*")) if f.is_file()}
    return mf.fingerprint(data)


def fingerprint(recipe: Recipe) -> str:
    return mf.fingerprint({n: _fingerprint(recipe, n) for n in recipe.sources})


def _run_one(recipe: Recipe, name: str) -> None:
    src = recipe.sources[name]
    final = recipe.layout.source(name)
    fp = _fingerprint(recipe, name)
    if stages.current(f"{STAGE}/{name}", final, fp):
        return
    if isinstance(src, TIRFinetuneSource):
        _run_one(recipe, src.base)
    started = time.time()
    stages.produce(f"{STAGE}/{name}", final, fp, lambda tmp: _make_one(recipe, name, tmp, final))
    mf.log(STAGE, f"{name}: done in {time.time() - started:.1f}s -> {final}")


def _make_one(recipe: Recipe, name: str, tmp: Path, final: Path) -> dict[str, Any]:
    src = recipe.sources[name]
    extra: dict[str, Any] = {}
    if isinstance(src, HFSource):
        mf.log(STAGE, f"{name}: hf checkpoint {recipe.source_model(name)} (used in place)")
        model_dir = recipe.source_model(name)
        checkpoint_tensors(model_dir, f"{recipe.path}: sources.{name}.path")  # whole headers, before it is marked done
    elif isinstance(src, GGUFPackageSource):
        path = gguf_path(src, str(recipe.path))
        mf.log(STAGE, f"{name}: dequantizing {path.name} from package {src.package} to bf16 ...")
        gguf_to_hf(path, tmp / "model")
        model_dir = final / "model"
        extra["gguf"] = {"path": str(path), "sha256": mf.sha256_file(path)}
    else:
        from trtbuild.tir_finetune import finetune

        base = recipe.source_model(src.base)
        mf.log(STAGE, f"{name}: LoRA fine-tune of {src.base} on {src.traces} synthetic TIR traces, "
               f"{src.steps} steps ...")
        extra["training"] = finetune(src, base, tmp / "model", recipe.serving.code_tags, recipe.serving.system_prompt)
        model_dir = final / "model"
    local = tmp / "model" if model_dir == final / "model" else model_dir
    return dict(source=to_data(src), model_dir=str(model_dir), files=mf.hash_tree(local), **extra)


def run(recipe: Recipe) -> Path:
    out = recipe.layout.sources
    fp = fingerprint(recipe)
    if stages.current(STAGE, out, fp):
        return out
    started = time.time()
    for name in recipe.sources:
        _run_one(recipe, name)
    summary = {n: mf.read_manifest(recipe.layout.source(n)) for n in recipe.sources}
    stages.summarize(
        STAGE, out, fp, started,
        sources={n: {"model_dir": m["model_dir"], "seconds": m["seconds"]} for n, m in summary.items() if m},
    )
    return out
