"""`make doctor`: which backends this machine can build and serve, and why not, on one screen."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Optional

from aimo_spec.recipe import Recipe
from trtbuild.trtllm import preflight
from trtbuild.trtllm.env import EXAMPLES_ENV, PYTHON_ENV, TrtllmEnv, probe


def _version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def embedded_line() -> tuple[bool, str]:
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return False, f"{', '.join(missing)} missing: run `make setup`"
    libs = ", ".join(f"{n} {_version(n)}" for n in ("torch", "transformers", "mergekit", "nvidia-modelopt")
                     if _version(n))
    return True, f"{libs}; {os.cpu_count()} CPU cores"


def report(recipe: Optional[Recipe] = None, env: Optional[TrtllmEnv] = None) -> tuple[str, bool]:
    """The doctor's text and whether the recipe's backend is usable."""
    env = env or probe()
    ok_emb, emb = embedded_line()
    rows = [("embedded", "yes" if ok_emb else "no", emb),
            ("trtllm", "yes" if env.usable else "no", env.summary())]
    lines = [f"{'backend':<10} {'usable':<7} details"] + [f"{a:<10} {b:<7} {c}" for a, b, c in rows]
    lines.append("")
    gpus = "; ".join(f"{g.index}: {g.name}, SM {g.sm}, {g.memory_mib} MiB, fp8 {'yes' if g.supports_fp8 else 'no'}"
                     for g in env.gpus) or "none"
    lines.append(f"GPUs             {gpus}")
    lines.append(f"{PYTHON_ENV:<16} {env.python}  (TensorRT-LLM env packages: "
                 f"{', '.join(f'{k} {v}' for k, v in sorted(env.packages.items())) or 'unknown'})")
    lines.append(f"{EXAMPLES_ENV:<16} {env.examples or 'not found (needed for FP8 calibration and ReDrafter)'}")
    usable = ok_emb
    if recipe is not None:
        merged = recipe.layout.merged / "config.json"
        wanted = recipe.build.backend
        lines.append("")
        lines.append(f"recipe {recipe.path}: build.backend {wanted}, quantization {recipe.build.quantization}, "
                     f"tp {recipe.build.tp_size}, drafter {recipe.drafter.kind}")
        if merged.is_file():
            problems = preflight.check(recipe, env if env.gpus else None, preflight.read_json(merged),
                                       preflight.load_drafter_config(recipe))
            verdict = ("".join(f"\n  - {p}" for p in problems) if problems else
                       "ok" + ("" if env.usable else " (the recipe fits; TensorRT-LLM itself is not runnable here)"))
            lines.append("the recipe against TensorRT-LLM's limits (preflight): " + verdict)
        else:
            lines.append("the recipe against TensorRT-LLM's limits (preflight): waits for the merged model "
                         "(`make merge`)")
        usable = env.usable if wanted == "trtllm" else (ok_emb or env.usable)
    return "\n".join(lines), usable
