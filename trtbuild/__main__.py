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
from typing import Any, Callable

from aimo_spec.recipe import HFSource, Recipe, RecipeError, load_recipe
from trtbuild import manifest as mf
from trtbuild import stages

STAGES = stages.NAMES


def run_stage(name: str, recipe: Recipe, backend: str) -> Path | None:
    return stages.run(recipe, name, **({"backend": backend} if name == "build" else {}))


def _mb(n: int | None) -> str:
    return f"{(n or 0) / 1e6:.1f} MB"


def _quality(q: dict[str, Any], flags: list[str] | None = None) -> str:
    return (f"KL {q['kl_mean']:.4f}, agreement {q['token_agreement']:.1%}, reply len {q['reply_len']:.1f} vs "
            f"{q['reply_len_ref']:.1f}, code calls {q['code_calls']:.2f} vs {q['code_calls_ref']:.2f}"
            + (f"  [flagged: {'; '.join(flags)}]" if flags else ""))


def _source_lines(name: str, m: dict[str, Any]) -> list[str]:
    t = m.get("training")
    extra = f", TIR loss {t['heldout_loss_before']} -> {t['heldout_loss_after']}" if t else ""
    return [f"sources/{name}: {m['seconds']}s, {_mb(m['size_bytes'])}{extra}"]


def _merge_lines(m: dict[str, Any]) -> list[str]:
    c = m["arithmetic_check"]
    lines = [f"merge: {m['seconds']}s (mergekit {m['merge_seconds']}s), {_mb(m['size_bytes'])}, "
             f"check {c['tensors_checked']} tensors max err {c['max_abs_error']:.3g} = {c['max_error_ulps']:.3f} ulp"]
    return lines + [f"  merged {k.replace('_', ' ')}: {_quality(v)}" for k, v in m["quality"].items()
                    if k.startswith("vs_")]


def _quantize_lines(fmt: str, m: dict[str, Any]) -> list[str]:
    if "gguf_bytes" in m:  # llama.cpp's export: no TensorRT-LLM checkpoint, no reload check (the price is it)
        head = f"quantize/{fmt}: {m['seconds']}s, gguf {_mb(m['gguf_bytes'])} ({m['runtime']})"
    else:
        head = (f"quantize/{fmt}: {m['seconds']}s, hf {_mb(m['hf_bytes'])}, trtllm {_mb(m['trtllm_bytes'])}, "
                f"reload {m['reload_error']['max_error_over_bound']:.3f}x bound")
    return [head, f"  {fmt} vs bf16: {_quality(m['quality'], m.get('quality_flags'))}"]


def _drafter_lines(m: dict[str, Any]) -> list[str]:
    a, tr = m["acceptance"], m.get("training")
    cost = f", trained in {tr['train_seconds']}s on {tr['positions']} positions" if tr else " (given)"
    return [f"drafter: {m['seconds']}s{cost}; {a['num_beams']}x{a['draft_len_per_beam']} drafts: "
            f"{a['tokens_per_step']:.2f} tokens/step, acceptance per position {a['acceptance_at_position']}"]


def _build_lines(backend: str, m: dict[str, Any]) -> list[str]:
    cpu = f" ({m['cpu_quantization']} on CPUs)" if m.get("cpu_quantization") else ""
    lines = [f"build/{backend}: {m['seconds']}s, {_mb(m['size_bytes'])}, serves {m['quantization']}{cpu}"]
    kv = m.get("kv_cache_price")
    if kv and "skipped" in kv:
        lines.append(f"  FP8 KV cache: not priced ({kv['skipped']})")
    elif kv:  # serving.kv_cache_dtype: fp8, priced by the build
        lines.append(f"  FP8 KV cache vs model-dtype cache: {_quality(kv['fp8'], kv['flags'])}")
    return lines


def report(recipe: Recipe) -> str:
    """A human summary of the finished stages (times, sizes, checks, quality). A manifest this version cannot
    read (damaged, or written by another version) gets a line saying so, not a traceback."""
    layout = recipe.layout
    lines = [f"# {recipe.name}: {layout.root}"]

    def section(folder: Path, render: Callable[[dict[str, Any]], list[str]]) -> None:
        m = mf.read_manifest(folder)
        if not m:
            return
        try:
            lines.extend(render(m))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            lines.append(f"{folder / mf.MANIFEST}: not a manifest this version reads ({type(e).__name__}: "
                         f"{str(e)[:200]}); rerun its stage with TRTBUILD_FORCE")

    for name in recipe.sources:
        section(layout.source(name), lambda m, name=name: _source_lines(name, m))
    if mf.read_manifest(layout.sources) is None:
        lines.append("sources: not built")
    section(layout.merge, _merge_lines)
    for fmt in recipe.quantize.formats:
        section(layout.quantize_format(fmt), lambda m, fmt=fmt: _quantize_lines(fmt, m))
    section(layout.drafter, _drafter_lines)
    for backend in ("embedded", "trtllm"):
        section(layout.engine(backend), lambda m, backend=backend: _build_lines(backend, m))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trtbuild", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=(*STAGES, "engine", "check", "report", "doctor", "plan"))
    p.add_argument("--recipe", default="engines/mix.yaml", help="recipe file (default: engines/mix.yaml)")
    p.add_argument("--backend", default="auto", choices=("auto", "embedded", "trtllm"),
                   help="what the build stage builds: embedded (any machine), trtllm (a TensorRT-LLM GPU host), "
                        "auto (trtllm where it can run, else embedded; default)")
    args = p.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe)
        _check_invocation(recipe, args.backend)
        if args.command == "check":  # the sources' checkpoints too, from their headers (no weights read)
            from trtbuild.resources import model_bytes

            model_bytes(recipe)
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
        except RecipeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
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


def _check_invocation(recipe: Recipe, backend: str) -> None:
    """What the command line adds to the recipe, checked before any stage runs: the backend asked for can
    serve the recipe's quantization, and TRTBUILD_FORCE names stages that exist (a misspelt one was ignored)."""
    from trtbuild.build import refuse_gguf_on_trtllm

    refuse_gguf_on_trtllm(recipe, backend)
    unknown = stages.unknown_forced()
    if unknown:
        raise RecipeError(f"{stages.FORCE_ENV}: no stage named {', '.join(map(repr, unknown))} (stages: "
                          f"{', '.join(STAGES)}, or all)")


OWNER = ".recipe"  # in the output folder: the recipe file that last ran a stage there


def _note_owner(recipe: Recipe) -> None:
    """Two recipe files with one `name` share `engines/<name>/`, and each rebuilds the stages whose inputs
    differ from the other's: say so when the folder was last built from another file, then record this one."""
    mark = recipe.out_dir / OWNER
    here = str(recipe.path)
    try:
        before = mark.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        before = ""
    if before and before != here:
        print(f"[trtbuild] note: {recipe.out_dir} was last built from {before}; this run, from {here}, rebuilds "
              "the stages whose inputs differ (another `name:` keeps both)", file=sys.stderr)
    if before != here:
        try:
            mark.write_text(here + "\n", encoding="utf-8")
        except OSError:  # only a note: the stages say what is wrong with the folder
            pass


def _run_stages(todo: tuple[str, ...], recipe: Recipe, args: argparse.Namespace) -> int:
    from trtbuild.resources import ResourceError, check

    written = [n for n, s in recipe.sources.items() if not isinstance(s, HFSource)]
    blocked = recipe.layout.in_the_way(written, recipe.quantize.formats)
    if blocked:
        print(f"error: {blocked[0]} is {'a link' if blocked[0].is_symlink() else 'a file'} where make engine keeps a "
              "folder; move it away and rerun (nothing was changed)", file=sys.stderr)
        return 2
    try:  # before any work: a stage that cannot fit fails now, not midway
        check(recipe, todo, log=lambda m: print(m, file=sys.stderr))
    except ResourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RecipeError as e:  # a source whose checkpoint is not whole
        print(f"error: {e}", file=sys.stderr)
        return 2
    _note_owner(recipe)
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
