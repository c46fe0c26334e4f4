"""Command line of the build pipeline: `python -m trtbuild STAGE --recipe engines/mix.yaml`.

Stages (the table in `trtbuild/stages.py`): sources, merge, quantize, drafter, build; `engine` runs
them all in order; `check` validates a recipe; `report` summarises the manifests of a finished
build; `doctor` says which backends this machine can use and why not; `plan` prints what the stages
still to run write and hold (trtbuild/resources.py) and fails where this machine's disk or memory
cannot hold it, as every stage command checks its own before it starts. Each stage skips itself when
its fingerprint (recipe section, upstream fingerprints, inputs, VERSION) matches the finished
output and its files match its manifest; `TRTBUILD_FORCE=<stage>` (`make ... FORCE=<stage>`)
rebuilds it anyway. Stage commands hold a lock on `engines/<model>/` (a second run waits).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from aimo_spec.recipe import Recipe, RecipeError, load_recipe
from trtbuild import manifest as mf
from trtbuild import stages

STAGES = stages.NAMES


def run_stage(name: str, recipe: Recipe, backend: str) -> Path | None:
    return stages.run(recipe, name, **({"backend": backend} if name == "build" else {}))


def _mb(n: int | None) -> str:
    return f"{(n or 0) / 1e6:.1f} MB"


def report(recipe: Recipe) -> str:
    """A human summary of the finished stages (times, sizes, checks, quality)."""
    layout = recipe.layout
    lines = [f"# {recipe.name}: {layout.root}"]
    src = mf.read_manifest(layout.sources)
    for name in recipe.sources:
        m = mf.read_manifest(layout.source(name))
        if m:
            t = m.get("training")
            extra = f", TIR loss {t['heldout_loss_before']} -> {t['heldout_loss_after']}" if t else ""
            lines.append(f"sources/{name}: {m['seconds']}s, {_mb(m['size_bytes'])}{extra}")
    if src is None:
        lines.append("sources: not built")
    m = mf.read_manifest(layout.merge)
    if m:
        c = m["arithmetic_check"]
        lines.append(f"merge: {m['seconds']}s (mergekit {m['merge_seconds']}s), {_mb(m['size_bytes'])}, "
                     f"check {c['tensors_checked']} tensors max err {c['max_abs_error']:.3g} = "
                     f"{c['max_error_ulps']:.3f} ulp")
        for k, v in m["quality"].items():
            if k.startswith("vs_"):
                lines.append(f"  merged {k.replace('_', ' ')}: KL {v['kl_mean']:.4f}, "
                             f"agreement {v['token_agreement']:.1%}, "
                             f"reply len {v['reply_len']:.1f} vs {v['reply_len_ref']:.1f}, code calls "
                             f"{v['code_calls']:.2f} vs {v['code_calls_ref']:.2f}")
    for fmt in recipe.quantize.formats:
        m = mf.read_manifest(layout.quantize_format(fmt))
        if m:
            q = m["quality"]
            if "gguf_bytes" in m:  # llama.cpp's export: no TensorRT-LLM checkpoint, no reload check (the price is it)
                lines.append(f"quantize/{fmt}: {m['seconds']}s, gguf {_mb(m['gguf_bytes'])} ({m['runtime']})")
            else:
                err = m["reload_error"]["max_error_over_bound"]
                lines.append(f"quantize/{fmt}: {m['seconds']}s, hf {_mb(m['hf_bytes'])}, "
                             f"trtllm {_mb(m['trtllm_bytes'])}, reload {err:.3f}x bound")
            lines.append(f"  {fmt} vs bf16: KL {q['kl_mean']:.4f}, agreement {q['token_agreement']:.1%}, reply len "
                         f"{q['reply_len']:.1f} vs {q['reply_len_ref']:.1f}, code calls {q['code_calls']:.2f} vs "
                         f"{q['code_calls_ref']:.2f}"
                         + (f"  [flagged: {'; '.join(m['quality_flags'])}]" if m.get("quality_flags") else ""))
    m = mf.read_manifest(layout.drafter)
    if m:
        a, tr = m["acceptance"], m.get("training")
        cost = f", trained in {tr['train_seconds']}s on {tr['positions']} positions" if tr else " (given)"
        lines.append(f"drafter: {m['seconds']}s{cost}; {a['num_beams']}x{a['draft_len_per_beam']} drafts: "
                     f"{a['tokens_per_step']:.2f} tokens/step, acceptance per position {a['acceptance_at_position']}")
    for backend in ("embedded", "trtllm"):
        m = mf.read_manifest(layout.engine(backend))
        if m:
            cpu = f" ({m['cpu_quantization']} on CPUs)" if m.get("cpu_quantization") else ""
            lines.append(f"build/{backend}: {m['seconds']}s, {_mb(m['size_bytes'])}, serves {m['quantization']}{cpu}")
            kv = m.get("kv_cache_price")
            if kv and "skipped" in kv:
                lines.append(f"  FP8 KV cache: not priced ({kv['skipped']})")
            elif kv:  # serving.kv_cache_dtype: fp8, priced by the build
                q = kv["fp8"]
                lines.append(f"  FP8 KV cache vs model-dtype cache: KL {q['kl_mean']:.4f}, agreement "
                             f"{q['token_agreement']:.1%}, reply len {q['reply_len']:.1f} vs {q['reply_len_ref']:.1f}, "
                             f"code calls {q['code_calls']:.2f} vs {q['code_calls_ref']:.2f}"
                             + (f"  [flagged: {'; '.join(kv['flags'])}]" if kv["flags"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trtbuild", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=(*STAGES, "engine", "check", "report", "doctor", "plan"))
    p.add_argument("--recipe", default="engines/mix.yaml", help="recipe file (default: engines/mix.yaml)")
    p.add_argument("--backend", default="auto", choices=("auto", "embedded", "trtllm"))
    args = p.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "check":
        print(f"{args.recipe}: ok ({', '.join(recipe.sources)} -> {recipe.out_dir})")
        return 0
    if args.command == "report":
        print(report(recipe))
        return 0
    if args.command == "plan":  # what the stages still to run write and hold, against this machine
        from trtbuild.resources import ResourceError, check

        try:
            check(recipe, STAGES)
        except ResourceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "doctor":
        from trtbuild.doctor import report as doctor_report

        text, usable = doctor_report(recipe)
        print(text)
        return 0 if usable else 1
    todo = STAGES if args.command == "engine" else (args.command,)
    try:
        with mf.folder_lock(recipe.out_dir):  # one build of a model's folder at a time
            return _run_stages(todo, recipe, args)
    except KeyboardInterrupt:
        print("interrupted while waiting for the lock; nothing was changed", file=sys.stderr)
        return 130


def _run_stages(todo: tuple[str, ...], recipe: Recipe, args: argparse.Namespace) -> int:
    from trtbuild.resources import ResourceError, check

    try:  # before any work: a stage that cannot fit fails now, not midway
        check(recipe, todo, log=lambda m: print(m, file=sys.stderr))
    except ResourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for stage in todo:
        t = time.time()
        try:
            path = run_stage(stage, recipe, args.backend)
        except RecipeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except stages.SetupError as e:
            print(f"[{stage}] FAILED: {e}\n[{stage}] earlier stages are kept; rerun after the setup to resume here",
                  file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"[{stage}] interrupted; finished stages are kept, rerun to resume", file=sys.stderr)
            return 130
        except Exception as e:  # noqa: BLE001 - report any failure as one line plus the traceback
            traceback.print_exc()
            print(f"[{stage}] FAILED: {type(e).__name__}: {e}\n[{stage}] earlier stages are kept; "
                  "fix the cause and rerun to resume here", file=sys.stderr)
            return 1
        mf.log(stage, f"ok in {time.time() - t:.1f}s" + (f" -> {path}" if path else ""))
    if args.command == "engine":
        print(report(recipe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
