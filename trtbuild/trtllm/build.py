"""The TensorRT-LLM build as steps: checkpoint -> (ReDrafter attach) -> trtllm-build.

Each step is one command run in TensorRT-LLM's environment. Checkpoint and ReDrafter steps keep
their output in `engines/<model>/trtllm/<step>/` with a manifest and fingerprint, so a failed
engine build (the long, GPU-bound part) resumes without redoing calibration. The engine step
writes into the build stage's folder. The commands are the published ones (AIMO-2 / NeMo-Skills):

- bf16, int8_wo: `python -m trtbuild.programs.trtllm_convert` (from_hugging_face + QuantConfig(W8A16));
- fp8 (and any FP8 KV cache): TensorRT-LLM's `examples/quantization/quantize.py` calibrated on the
  recipe's TIR traces, or the quantize stage's ModelOpt export (`trtllm.fp8_checkpoint`);
- ReDrafter: `examples/redrafter/convert_checkpoint.py` on the base checkpoint plus the drafter;
- engine: `trtllm-build` with paged KV, paged context FMHA (KV reuse needs it), the recipe's limits,
  and `--speculative_decoding_mode explicit_draft_tokens` with a drafter.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from aimo_spec.recipe import Recipe
from trtbuild import manifest as mf
from trtbuild import stages
from trtbuild.trtllm.convert import ensure_exclusion_list
from trtbuild.trtllm.env import TrtllmEnv
from trtbuild.trtllm.preflight import drafter_dir

VERSION = 2  # bump when the commands or their outputs change for the same recipe
STAGE = "build"
OUTPUT = "{output}"  # placeholder in a step's argv for its (scratch) output folder
GEMM_PLUGIN = {"fp8": "fp8", "int8_wo": "bfloat16", "bf16": "bfloat16"}
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Step:
    name: str  # checkpoint | redrafter | engine
    argv: tuple[str, ...]  # OUTPUT stands for the output folder
    output: Optional[Path]  # a kept step folder; None: the caller's folder (the engine)
    fingerprint: str
    env: dict[str, str] = field(default_factory=dict)
    prepare: Optional[Callable[[], None]] = None  # main-environment work before the command (calibration data)
    finalize: Optional[Callable[[Path], None]] = None  # main-environment work on the output before it is kept

    def command(self, out: Path) -> list[str]:
        return [str(out) if a == OUTPUT else a for a in self.argv]


Runner = Callable[[Step, list[str], dict[str, str]], None]


def run_subprocess(step: Step, cmd: list[str], env: dict[str, str]) -> None:
    """Run a step's command with its output streaming to the terminal; a failure names the step."""
    proc = subprocess.run(cmd, env={**os.environ, **env})
    if proc.returncode != 0:
        raise RuntimeError(f"trtllm {step.name} step failed (exit {proc.returncode}): {' '.join(cmd)}")


def write_calibration_set(recipe: Recipe, model_dir: Path, out: Path) -> Path:
    """`out/train.jsonl` with a "text" column: TIR traces in the serving chat format, what quantize.py's
    local-dataset loader reads (split train, column text)."""
    from aimo_spec.chat import load_tokenizer, render_prompt
    from trtbuild.tir_data import make_traces

    c = recipe.quantize.calibration
    tok = load_tokenizer(model_dir)
    traces = make_traces(recipe.trtllm.calib_size, c.seed, recipe.serving.code_tags)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "train.jsonl").open("w") as f:
        for t in traces:
            f.write(json.dumps({"text": render_prompt(tok, t.problem, recipe.serving.system_prompt) + t.reply}) + "\n")
    return out


def _checkpoint_step(recipe: Recipe, env: TrtllmEnv, merged: Path, work: Path, upstream: str) -> Optional[Step]:
    b, q, kv = recipe.build, recipe.build.quantization, recipe.quantize.kv_cache_dtype
    section = {"quant": q, "kv": kv, "tp": b.tp_size, "fp8_checkpoint": recipe.trtllm.fp8_checkpoint,
               "calib_size": recipe.trtllm.calib_size,
               "calibration": recipe.section("quantize")["calibration"], "upstream": upstream, "version": VERSION}
    fp = mf.fingerprint(section)
    if q == "fp8" and recipe.trtllm.fp8_checkpoint == "modelopt_export" and kv == "none":
        return None  # the quantize stage's export is the checkpoint
    if q == "fp8" or kv == "fp8":
        assert env.examples is not None, "preflight checks the examples folder"
        calib = work / "calibration"
        c = recipe.quantize.calibration
        argv = [env.python, str(env.examples / "quantization" / "quantize.py"),
                "--model_dir", str(merged), "--dtype", "bfloat16",
                "--qformat", "fp8" if q == "fp8" else ("int8_wo" if q == "int8_wo" else "full_prec"),
                "--calib_dataset", str(calib), "--calib_size", str(recipe.trtllm.calib_size),
                "--calib_max_seq_length", str(c.max_length), "--batch_size", "1",
                "--tp_size", str(b.tp_size), "--seed", str(c.seed), "--output_dir", OUTPUT]
        if kv == "fp8":
            argv += ["--kv_cache_dtype", "fp8"]
        return Step("checkpoint", tuple(argv), work / "checkpoint", fp,
                    prepare=lambda: write_calibration_set(recipe, merged, calib) and None,
                    finalize=lambda out: ensure_exclusion_list(out / "config.json") and None)
    argv = [env.python, "-m", "trtbuild.programs.trtllm_convert", "--model_dir", str(merged), "--output_dir", OUTPUT,
            "--dtype", "bfloat16", "--tp_size", str(b.tp_size), "--quant_algo", "W8A16" if q == "int8_wo" else "none"]
    return Step("checkpoint", tuple(argv), work / "checkpoint", fp, env={"PYTHONPATH": str(PROJECT_ROOT)})


def require_exclusion_list(config_path: Path) -> None:
    """Before ReDrafter: a quantized base whose exclude_modules is null would get its drafter quantized
    (the converter extends only a list) and trtllm-build would stop; say so before any GPU work."""
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    quant = config.get("quantization") or {}
    if (quant.get("quant_algo") or quant.get("kv_cache_quant_algo")) and quant.get("exclude_modules") is None:
        raise RuntimeError(f"{config_path}: quantization.exclude_modules is null: ReDrafter's converter would leave "
                           "the drafter quantized and trtllm-build would stop; use trtllm.fp8_checkpoint: quantize_py "
                           "(the build writes the list) or add the list to that config.json")


def checkpoint_dir(recipe: Recipe, step: Optional[Step]) -> Path:
    return step.output if step is not None and step.output else recipe.layout.quantized_trtllm("fp8")


def plan(recipe: Recipe, env: TrtllmEnv, upstream: str) -> list[Step]:
    """The steps for this recipe, in order; the engine step writes to OUTPUT (the build stage's folder)."""
    b, d = recipe.build, recipe.drafter
    merged = recipe.layout.merged
    work = recipe.layout.trtllm_work
    steps: list[Step] = []
    ckpt = _checkpoint_step(recipe, env, merged, work, upstream)
    if ckpt is not None:
        steps.append(ckpt)
    base = checkpoint_dir(recipe, ckpt)
    if ckpt is not None:
        last_fp = ckpt.fingerprint
    else:  # the quantize stage's export: its own fingerprint says when it changed
        last_fp = mf.fingerprint({"export": (mf.read_manifest(base.parent) or {}).get("fingerprint"), "up": upstream})
    if d.kind == "redrafter":
        drafter = drafter_dir(recipe)
        assert env.examples is not None and drafter is not None, "preflight checks the examples and drafter folders"
        argv = [env.python, str(env.examples / "redrafter" / "convert_checkpoint.py"),
                "--base_model_checkpoint_dir", str(base), "--drafter_model_dir", str(drafter),
                "--output_dir", OUTPUT, "--dtype", "bfloat16", "--tp_size", str(b.tp_size),
                "--redrafter_num_beams", str(d.num_beams), "--redrafter_draft_len_per_beam", str(d.draft_len_per_beam)]
        if not d.greedy:
            argv.append("--redrafter_no_greedy_search")
        drafter_hash = (mf.sha256_file(drafter / "model.safetensors") if (drafter / "model.safetensors").is_file()
                        else "")
        last_fp = mf.fingerprint({"base": last_fp, "drafter": recipe.section("drafter"), "weights": drafter_hash,
                                  "version": VERSION})
        steps.append(Step("redrafter", tuple(argv), work / "redrafter", last_fp,
                          prepare=lambda cfg=base / "config.json": require_exclusion_list(cfg)))
        base = work / "redrafter"
    argv = [env.tool("trtllm-build"), "--checkpoint_dir", str(base), "--output_dir", OUTPUT,
            "--gemm_plugin", GEMM_PLUGIN[b.quantization],
            "--use_paged_context_fmha", "enable", "--kv_cache_type", "paged",
            "--max_batch_size", str(b.max_batch_size), "--max_seq_len", str(b.max_seq_len),
            "--max_input_len", str(b.max_input_len), "--max_num_tokens", str(b.max_num_tokens),
            "--max_beam_width", "1", "--workers", str(b.tp_size)]
    if d.kind == "redrafter":
        argv += ["--speculative_decoding_mode", "explicit_draft_tokens"]
    steps.append(Step("engine", tuple(argv), None, mf.fingerprint({"base": last_fp, "argv": argv[1:]})))
    return steps


def run_steps(steps: list[Step], engine_out: Path, runner: Runner = run_subprocess) -> list[dict[str, Any]]:
    """Run each step not already done; kept steps are atomic (a failure leaves the previous output)."""
    done = []
    for step in steps:
        started = time.time()
        if step.output is not None:
            if stages.current(STAGE, step.output, step.fingerprint):
                done.append({"step": step.name, "skipped": True, "output": str(step.output)})
                continue
            if step.prepare is not None:
                step.prepare()
            commands: list[list[str]] = []

            def make(tmp: Path, step: Step = step) -> dict[str, Any]:
                commands.append(step.command(tmp))
                mf.log(STAGE, f"trtllm {step.name}: " + " ".join(commands[-1]))
                runner(step, commands[-1], step.env)
                if not (tmp / "config.json").is_file():
                    raise RuntimeError(f"trtllm {step.name} step wrote no config.json to {tmp}")
                if step.finalize is not None:
                    step.finalize(tmp)
                return {"step": f"trtllm/{step.name}", "command": commands[-1]}

            stages.produce(STAGE, step.output, step.fingerprint, make)
            cmd, out = commands[-1], step.output
        else:
            if step.prepare is not None:
                step.prepare()
            cmd = step.command(engine_out)
            mf.log(STAGE, f"trtllm {step.name}: " + " ".join(cmd))
            runner(step, cmd, step.env)
            if not (engine_out / "config.json").is_file():
                raise RuntimeError(f"trtllm {step.name} step wrote no config.json to {engine_out}")
            out = engine_out
        done.append({"step": step.name, "command": cmd, "seconds": round(time.time() - started, 2), "output": str(out)})
        mf.log(STAGE, f"trtllm {step.name}: done in {done[-1]['seconds']}s -> {out}")
    return done
