"""`make gpu-smoke`: build tiny engines on this GPU host and check that they serve correctly.

    $TRTLLM_PYTHON -m trtbuild.programs.gpu_smoke [--out DIR]

Runs in TensorRT-LLM's environment on a GPU host. A tiny random Llama checkpoint is made on the fly
(no download) and goes through the same steps `make engine BACKEND=trtllm` runs: bf16 (convert +
trtllm-build) and, where the GPU has FP8, FP8 (quantize.py calibration + trtllm-build). Then the
trtllm backend serves them and the report checks:
- tokens: greedy tokens of the bf16 engine vs transformers' greedy generate on the same weights;
- streaming: a request arrives as several deltas and exactly one final;
- cancel: a long request cancelled mid-stream ends 'cancelled' early;
- fp8 vs bf16: greedy token agreement (the price of FP8 on this GPU).
Exit status 0 when every check passes; the report is also written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import yaml

PROMPTS = ("What is 6 times 7?", "How many primes are less than 30?", "Sum of 1 to 10?", "Name a prime.")
NEW_TOKENS = 16
MIN_HF_AGREEMENT = 0.9  # bf16 engine vs transformers on the same weights: only kernel numerics differ


def write_recipe(folder: Path, name: str, model: Path, quantization: str) -> Path:
    data = {"name": name, "sources": {"tir": {"kind": "hf", "path": str(model)}},
            "merge": {"weights": {"tir": 1.0}, "base_model": "tir"},
            "quantize": {"formats": ["fp8"] if quantization == "fp8" else ["int8_wo"], "calibration": {"size": 16}},
            "build": {"quantization": quantization, "backend": "trtllm", "max_batch_size": 8, "max_input_len": 256,
                      "max_seq_len": 512, "max_num_tokens": 2048},
            "trtllm": {"calib_size": 16}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def build(folder: Path, name: str, model: Path, quantization: str, env: Any, runner: Any) -> Path:
    """The pipeline's own trtllm build on a recipe whose merge is the tiny model itself."""
    from aimo_spec.recipe import load_recipe
    from trtbuild import build as build_stage

    recipe = load_recipe(write_recipe(folder, name, model, quantization))
    merged = recipe.layout.merged
    if not merged.exists():
        shutil.copytree(model, merged)
    return build_stage.run(recipe, "trtllm", trtllm_env=env, runner=runner)


async def greedy(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    from aimo_spec.protocol import Request, SamplingParams, collect

    async def one(ids: list[int]) -> list[int]:
        _, final = await collect(engine, Request(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                     ignore_eos=True)))
        return list(final.token_ids) if final else []
    return list(await asyncio.gather(*(one(p) for p in prompts)))


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of positions before the first difference (greedy sequences diverge for good)."""
    fr = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        fr.append(n / max(1, max(len(x), len(y))))
    return sum(fr) / max(1, len(fr))


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(y[0, len(ids):].tolist())
    return out


async def stream_and_cancel(engine: Any, prompt: list[int]) -> dict[str, Any]:
    from aimo_spec.protocol import Delta, Final, Request, SamplingParams

    deltas, finals = 0, []
    async for ev in engine.generate(Request(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))):
        deltas += isinstance(ev, Delta)
        finals += [ev] if isinstance(ev, Final) else []
    req = Request(prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    seen, cancelled = 0, None
    async for ev in engine.generate(req):
        if isinstance(ev, Delta):
            seen += 1
            if seen == 3:
                engine.cancel(req.request_id)
        else:
            cancelled = ev
    return {"stream_deltas": deltas, "stream_finals": len(finals),
            "stream_ok": deltas > 1 and len(finals) == 1 and finals[0].finish_reason == "length",
            "cancel_reason": cancelled.finish_reason if cancelled else None,
            "cancel_tokens": len(cancelled.token_ids) if cancelled else None,
            "cancel_ok": bool(cancelled and cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 400)}


def run(out: Path, env: Any = None, runner: Any = None, compare_hf: bool = True) -> dict[str, Any]:
    from server.trtllm.engine import TrtllmEngine
    from trtbuild.tiny_model import make_model
    from trtbuild.trtllm.env import probe

    env = env or probe()
    if not env.usable:
        raise RuntimeError(f"gpu-smoke needs a usable TensorRT-LLM: {env.summary()}")
    report: dict[str, Any] = {"trtllm": env.version, "gpus": [f"{g.name} (SM {g.sm})" for g in env.gpus]}
    started = time.time()
    model = make_model(out / "tiny-llama", "llama", seed=0, hidden_size=256, layers=4, heads=8, kv_heads=4)
    bf16 = build(out, "smoke-bf16", model, "bf16", env, runner)
    report["build_bf16_seconds"] = round(time.time() - started, 1)
    engine = TrtllmEngine.from_dir(bf16)
    prompts = [engine.tokenize(engine.chat_prompt(p)) for p in PROMPTS]
    try:
        ref = asyncio.run(greedy(engine, prompts))
        report["tokens_ok"] = all(len(r) == NEW_TOKENS for r in ref)
        if compare_hf:
            report["bf16_vs_transformers_agreement"] = round(prefix_agreement(ref, hf_greedy(model, prompts)), 3)
            report["tokens_ok"] &= report["bf16_vs_transformers_agreement"] >= MIN_HF_AGREEMENT
        report.update(asyncio.run(stream_and_cancel(engine, prompts[0])))
    finally:
        engine.shutdown()
    if all(g.supports_fp8 for g in env.gpus[:1]) and env.examples is not None:
        t = time.time()
        fp8 = build(out, "smoke-fp8", model, "fp8", env, runner)
        report["build_fp8_seconds"] = round(time.time() - t, 1)
        engine = TrtllmEngine.from_dir(fp8)
        try:
            report["fp8_vs_bf16_agreement"] = round(prefix_agreement(asyncio.run(greedy(engine, prompts)), ref), 3)
        finally:
            engine.shutdown()
    else:
        report["fp8_vs_bf16_agreement"] = None
        report["fp8_skipped"] = "GPU without FP8 (needs SM >= 89) or no TensorRT-LLM examples/ folder"
    report["passed"] = bool(report["tokens_ok"] and report["stream_ok"] and report["cancel_ok"])
    report["seconds"] = round(time.time() - started, 1)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtbuild.programs.gpu_smoke", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        report = run(out)
    except RuntimeError as e:
        print(f"gpu-smoke: {e}", file=sys.stderr)
        return 2
    (out / "report.json").write_text(json.dumps(report, indent=2))
    width = max(len(k) for k in report)
    for k, v in report.items():
        print(f"{k:<{width}}  {v}")
    print(f"gpu-smoke: {'PASSED' if report['passed'] else 'FAILED'} (report: {out / 'report.json'})")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
