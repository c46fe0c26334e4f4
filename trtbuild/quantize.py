"""Stage `quantize`: ModelOpt FP8 / int8 weight-only (W8A16) and llama.cpp's Q8_0 on the merged checkpoint, on CPU.

Per ModelOpt format, `quantize/<format>/` holds
- `hf/`: ModelOpt's unified HF export (what the embedded runtime serves, scales applied),
- `trtllm/`: ModelOpt's TensorRT-LLM checkpoint (config.json + rank*.safetensors) for trtllm-build,
- `manifest.json`: calibration, sizes, weight reload error, and the quality price against bf16.
A gguf_* format (trtbuild/gguf_quantize.py) holds `gguf/` (model.gguf + tokenizer, made by
llama.cpp's converter, served by the llama.cpp runner) and its manifest, priced by the same gate.
Formats are built one by one, each atomically: a failure in one keeps the others.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Mapping

from aimo_spec.layout import is_gguf
from aimo_spec.recipe import Recipe
from trtbuild import manifest as mf
from trtbuild import stages

VERSION = 1  # bump when the output of this stage changes for the same inputs
STAGE = "quantize"
MODELOPT_ALGO = {"fp8": "FP8", "int8_wo": "W8A16"}


def modelopt_config(fmt: str, kv_cache_dtype: str) -> dict[str, Any]:
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy({"fp8": mtq.FP8_DEFAULT_CFG, "int8_wo": mtq.INT8_WEIGHT_ONLY_CFG}[fmt])
    if kv_cache_dtype == "fp8":
        cfg["quant_cfg"].update(copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
    return cfg


def calibration_texts(recipe: Recipe, tokenizer: Any) -> list[list[int]]:
    """TIR traces in the serving chat format: the distribution the engine will see."""
    from aimo_spec.chat import encode, render_prompt
    from trtbuild.tir_data import make_traces

    c = recipe.quantize.calibration
    traces = make_traces(c.size, c.seed, recipe.serving.code_tags)
    out = []
    for t in traces:
        text = render_prompt(tokenizer, t.problem, recipe.serving.system_prompt) + t.reply
        out.append(encode(tokenizer, text)[: c.max_length])
    return out


def reload_error(original: Mapping[str, Any], model: Any) -> dict[str, float]:
    """Worst error of each reloaded quantized weight vs the bf16 original, in units of its rounding bound.
    `original`: the weights by name, cast to bf16 as the quantizer saw them (the stage loads the model in
    bf16); a tied lm_head is looked up as the embeddings.

    int8: |w - q*s| <= s/2 per output channel. e4m3: half the spacing of e4m3 at |w/s| (4
    significand bits; subnormal spacing 2^-9), times s. A value <= 1 means "within rounding".
    """
    import torch

    from server.embedded.qlinear import Fp8Linear, Int8WeightOnlyLinear

    worst, n = 0.0, 0
    for name, module in model.named_modules():
        if not isinstance(module, (Int8WeightOnlyLinear, Fp8Linear)):
            continue
        key = f"{name}.weight"
        if key not in original and name.endswith("lm_head"):
            key = "model.embed_tokens.weight"  # tied: the checkpoint stores it once
        deq = module.dequantized()
        w = original[key].to(torch.bfloat16).to(device=deq.device, dtype=torch.float32)
        if isinstance(module, Int8WeightOnlyLinear):
            bound = module.scale.float()[:, None] * 0.5
        else:
            s = module.weight_scale
            _, e = torch.frexp((w / s).abs())
            bound = 0.5 * torch.ldexp(torch.ones_like(w), e - 4).clamp_min(2.0 ** -9) * s
        # ModelOpt computes in the weight dtype (bf16): the scaled weight w/s is rounded to bf16
        # (at most 2^-8 relative) before the cast to e4m3/int8 (double rounding), and the scale
        # itself carries one bf16 rounding (ModelOpt's amax; the int8 kernel's activation-dtype
        # scales). Allow one bf16 rounding of each on top of the format's own rounding.
        bound = bound + w.abs() * 2.0 ** -8 + deq.abs() * 2.0 ** -8
        worst = max(worst, float(((w - deq).abs() / bound).max()))
        n += 1
    return {"layers": n, "max_error_over_bound": worst}


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def format_fingerprint(recipe: Recipe, fmt: str, merged_fp: str) -> str:
    if is_gguf(fmt):  # no calibration and no ModelOpt KV setting: what llama.cpp's export and its price read,
        # and llama.cpp's version (its converter makes the file, its kernels price it)
        return mf.fingerprint({"format": fmt, "quality": recipe.section("quality"),
                               "tags": recipe.section("serving")["code_tags"], "merged": merged_fp,
                               "llama_cpp": _version("llama-cpp-python"), "version": VERSION})
    return mf.fingerprint({
        "format": fmt, "kv": recipe.quantize.kv_cache_dtype, "calibration": recipe.section("quantize")["calibration"],
        "quality": recipe.section("quality"), "tags": recipe.section("serving")["code_tags"],
        "merged": merged_fp, "version": VERSION,
    })


def fingerprint(recipe: Recipe, fmt: str | None = None) -> str:
    """One format's fingerprint, or (no `fmt`) the whole stage's."""
    merged_fp = stages.fingerprint(recipe, "merge")
    if fmt is not None:
        return format_fingerprint(recipe, fmt, merged_fp)
    return mf.fingerprint({f: format_fingerprint(recipe, f, merged_fp) for f in recipe.quantize.formats})


def _quantize_one(recipe: Recipe, fmt: str, merged_dir: Path, final: Path, tmp: Path, ref: Any) -> dict[str, Any]:
    """One format into `tmp` (renamed to `final` by the stage guard); its manifest fields."""
    if is_gguf(fmt):
        from trtbuild.gguf_quantize import quantize_gguf

        return quantize_gguf(recipe, fmt, merged_dir, final, tmp, ref)
    return _modelopt_one(recipe, fmt, merged_dir, final, tmp, ref)


def _modelopt_one(recipe: Recipe, fmt: str, merged_dir: Path, final: Path, tmp: Path, ref: Any) -> dict[str, Any]:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    from modelopt.torch.export.model_utils import get_model_type

    from aimo_spec.chat import load_tokenizer
    from aimo_spec.checkpoint import CheckpointTensors
    from server.embedded.loader import load_model, stage_device
    from trtbuild.quality import price

    tok = load_tokenizer(merged_dir)
    dev = stage_device()
    model = load_model(merged_dir, device=dev)  # calibration and export where the gates run
    calib = calibration_texts(recipe, tok)
    mf.log(STAGE, f"{fmt}: ModelOpt {MODELOPT_ALGO[fmt]} calibration on {len(calib)} TIR traces ...")

    def forward_loop(m: Any) -> None:
        with torch.no_grad():
            for ids in calib:
                m(input_ids=torch.tensor([ids], device=dev))

    t = time.time()
    mtq.quantize(model, modelopt_config(fmt, recipe.quantize.kv_cache_dtype), forward_loop)
    calib_seconds = time.time() - t
    decoder = get_model_type(model)
    if decoder is None:
        raise ValueError(f"quantize: ModelOpt has no TensorRT-LLM decoder type for {type(model).__name__}")
    t = time.time()
    export_hf_checkpoint(model, export_dir=str(tmp / "hf"))
    tok.save_pretrained(str(tmp / "hf"))
    export_tensorrt_llm_checkpoint(model, decoder_type=decoder, dtype=torch.bfloat16, export_dir=str(tmp / "trtllm"),
                                   inference_tensor_parallel=recipe.build.tp_size)
    export_seconds = time.time() - t
    del model
    reloaded = load_model(tmp / "hf", device=dev)
    # against the weights ModelOpt quantized, read back a tensor at a time (no second copy of the model)
    err = reload_error(CheckpointTensors(merged_dir), reloaded)
    mf.log(STAGE, f"{fmt}: reloaded {err['layers']} quantized layers, worst error "
           f"{err['max_error_over_bound']:.3f} x rounding bound")
    if err["max_error_over_bound"] > 1.0 + 1e-3:
        raise RuntimeError(f"quantize: {fmt} weights reload outside their rounding bound: {err}")
    mf.log(STAGE, f"{fmt}: quality vs bf16 on {len(ref['replies'].prompts)} recorded prompts ...")
    p = price(ref["model"], reloaded, tok, ref["replies"], recipe.quality.max_new_tokens, recipe.serving.code_tags)
    mf.log(STAGE, f"{fmt}: {p.summary()}")
    flags = p.verdict(recipe.quality)
    if flags:
        mf.log(STAGE, f"WARNING: {fmt} is outside the recipe's quality thresholds: {'; '.join(flags)}")
    return dict(
        format=fmt, quant_algo=MODELOPT_ALGO[fmt], kv_cache_dtype=recipe.quantize.kv_cache_dtype,
        decoder_type=decoder, calibration={"samples": len(calib), "tokens": sum(map(len, calib)),
                                           "seconds": round(calib_seconds, 2)},
        export_seconds=round(export_seconds, 2), reload_error=err, quality=p.as_dict(),
        quality_flags=flags,
        hf_dir=str(final / "hf"), trtllm_dir=str(final / "trtllm"),
        hf_bytes=mf.dir_size(tmp / "hf"), trtllm_bytes=mf.dir_size(tmp / "trtllm"),
        files=mf.hash_tree(tmp / "hf"),
    )


def run(recipe: Recipe) -> Path:
    layout = recipe.layout
    out = layout.quantize
    if mf.read_manifest(layout.merge) is None:
        raise FileNotFoundError(f"quantize: no merged model in {layout.merge}: run the merge stage first")
    merged_fp = stages.fingerprint(recipe, "merge")
    fps = {fmt: format_fingerprint(recipe, fmt, merged_fp) for fmt in recipe.quantize.formats}
    stage_fp = mf.fingerprint(fps)
    if stages.current(STAGE, out, stage_fp):
        return out
    started = time.time()
    merged_dir = layout.merged
    ref: dict[str, Any] | None = None
    results = {}
    for fmt in recipe.quantize.formats:
        final = layout.quantize_format(fmt)
        if not stages.current(f"{STAGE}/{fmt}", final, fps[fmt]):
            if is_gguf(fmt):  # a missing llama.cpp fails here, in one line, before the reference is recorded
                from trtbuild.gguf_quantize import require

                require()
            if ref is None:
                from aimo_spec.chat import load_tokenizer
                from server.embedded.loader import gate_dtype, load_model, stage_device, use_all_cores
                from trtbuild.quality import quality_prompts, record_replies

                use_all_cores()
                tok = load_tokenizer(merged_dir)
                # the bf16 weights, computed in gate_dtype (float32 on CPUs without native bf16)
                dev = stage_device()
                ref_model = load_model(merged_dir, dtype=gate_dtype(dev), device=dev)
                mf.log(STAGE, f"recording bf16-weight reference replies ({ref_model.dtype} compute on "
                              f"{ref_model.device}) ...")
                ref = {"model": ref_model, "replies": record_replies(
                    ref_model, tok, quality_prompts(recipe, tok), recipe.quality.max_new_tokens)}
            reference = ref
            stages.produce(f"{STAGE}/{fmt}", final, fps[fmt],
                           lambda tmp, fmt=fmt, final=final: _quantize_one(recipe, fmt, merged_dir, final, tmp,
                                                                           reference))
        results[fmt] = mf.read_manifest(final)
    stages.summarize(
        STAGE, out, stage_fp, started, merged_bytes=mf.dir_size(merged_dir),
        formats={f: {k: r[k] for k in ("hf_bytes", "trtllm_bytes", "gguf_bytes", "quality", "seconds") if k in r}
                 for f, r in results.items()},
    )
    return out
