"""The build pipeline's stages, in one table, and the one guard every stage output goes through.

| stage    | module                  | output (`Layout`)           |
|----------|-------------------------|-----------------------------|
| sources  | `trtbuild.sources`      | `sources/<name>/`           |
| merge    | `trtbuild.merge_stage`  | `merge/`                    |
| quantize | `trtbuild.quantize`     | `quantize/<fmt>/`           |
| drafter  | `trtbuild.drafter.stage`| `drafter/`                  |
| build    | `trtbuild.build`        | `build/<backend>/`          |

Each stage module has `run(recipe, ...)`, `fingerprint(recipe, ...)` and a `VERSION`. A stage is
stale when, and only when, its fingerprint changed: the recipe fields it reads, the fingerprints of the
stages it reads, its inputs on disk, or its `VERSION` (bumped when a code change alters what the
stage writes, so a refactor does not retrain). Make does not decide: every stage target calls the
stage, which skips itself when current. A code change that did not bump `VERSION` is never silent:
the manifest records the hashes of the stage's code, and a skipped stage whose code changed says
so and how to redo it (`FORCE=<stage>`).

Current also means intact: the files a manifest records (sizes always, sha256 of small files; see
`trtbuild.manifest`) are checked before a stage is trusted, and a stage whose files or manifest are
damaged is rebuilt, with a line saying what was wrong. `python -m trtbuild` holds a lock on the
model's output folder for the whole run, so two concurrent `make engine` runs do the work once.

`produce` is the guard: skip when current, else build in a hidden scratch folder, write the
manifest, and rename the folder into place only when everything succeeded. A failed or
interrupted stage therefore leaves every earlier output intact, and the next run resumes there.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trtbuild import manifest as mf

ROOT = Path(__file__).resolve().parents[1]  # the project checkout: code paths below are relative to it
FORCE_ENV = "TRTBUILD_FORCE"  # comma-separated stage names to rebuild even when current ("all": every one)


@dataclass(frozen=True)
class Stage:
    name: str
    module: str
    code: tuple[str, ...]  # files whose content the manifest records (what `make` used to watch)

    def load(self) -> Any:
        return importlib.import_module(self.module)


STAGES: tuple[Stage, ...] = (
    Stage("sources", "trtbuild.sources", ("trtbuild/sources.py", "trtbuild/tir_finetune.py", "trtbuild/tir_data.py")),
    Stage("merge", "trtbuild.merge_stage", ("trtbuild/merge_stage.py", "merge/config.py", "merge/check.py",
                                            "trtbuild/quality.py")),
    Stage("quantize", "trtbuild.quantize", ("trtbuild/quantize.py", "trtbuild/quality.py", "server/embedded/loader.py",
                                            "server/embedded/qlinear.py", "trtbuild/gguf_quantize.py",
                                            "trtbuild/gguf_export.py", "trtbuild/kv_price.py",
                                            "server/embedded/llamacpp_runner.py")),
    Stage("drafter", "trtbuild.drafter.stage", ("trtbuild/drafter/stage.py", "trtbuild/drafter/data.py",
                                                "server/embedded/redrafter.py", "trtbuild/drafter/train.py",
                                                "trtbuild/drafter/acceptance.py")),
    Stage("build", "trtbuild.build", ("trtbuild/build.py", "trtbuild/trtllm/build.py", "trtbuild/trtllm/convert.py",
                                      "trtbuild/programs/trtllm_convert.py", "trtbuild/trtllm/preflight.py")),
)
BY_NAME = {s.name: s for s in STAGES}
NAMES = tuple(BY_NAME)


class SetupError(RuntimeError):
    """A stage needs a tool this environment lacks; the message says which and how to get it (`make
    setup`). The command line prints it as one line, without a traceback: nothing to debug."""


def stage(name: str) -> Stage:
    base = name.split("/")[0]  # "quantize/fp8" is the quantize stage's output for one format
    if base not in BY_NAME:
        raise ValueError(f"unknown stage {name!r} (stages: {', '.join(NAMES)})")
    return BY_NAME[base]


def fingerprint(recipe: Any, name: str, *args: Any) -> str:
    """A stage's fingerprint, for the stages downstream of it (the one way to ask)."""
    return stage(name).load().fingerprint(recipe, *args)


def weights_fingerprint(recipe: Any) -> str:
    """The fingerprint of the weights the engine serves (`build.quantization`): the merge's for
    bf16, else that format's quantize output."""
    q = recipe.build.quantization
    return fingerprint(recipe, "merge") if q == "bf16" else fingerprint(recipe, "quantize", q)


def run(recipe: Any, name: str, **kwargs: Any) -> Path | None:
    return stage(name).load().run(recipe, **kwargs)


def code_hashes(name: str) -> dict[str, str]:
    out = {}
    for rel in stage(name).code:
        p = ROOT / rel
        if p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
    return out


def _forced_names() -> set[str]:
    return {w.strip() for w in os.environ.get(FORCE_ENV, "").split(",") if w.strip()}


def forced(name: str) -> bool:
    wanted = _forced_names()
    return "all" in wanted or stage(name).name in wanted


def unknown_forced() -> list[str]:
    """Names in TRTBUILD_FORCE that are no stage (nor `all`)."""
    return sorted(w for w in _forced_names() if w != "all" and w not in NAMES)


def current(name: str, folder: Path, fp: str) -> bool:
    """True when `folder` holds this fingerprint's finished output (and it is not forced): logged,
    with a notice when the stage's code changed since the output was built."""
    if forced(name):
        return False
    manifest, unreadable = mf.load_manifest(folder)
    if unreadable:
        mf.log(name, f"{folder / mf.MANIFEST} cannot be read ({unreadable}); rebuilding the stage")
        return False
    if manifest is None or manifest.get("fingerprint") != fp or manifest.get("status") != "done":
        return False
    problem = mf.verify(folder, manifest)
    if problem:
        mf.log(name, f"{folder}: {problem}; rebuilding the stage")
        return False
    mf.touch(folder)
    recorded = manifest.get("code") or {}
    changed = sorted(k for k, v in code_hashes(name).items() if recorded.get(k, v) != v)
    if changed:  # informational: a change of a stage's output bumps its VERSION, which changes the fingerprint
        mf.log(name, f"up to date ({folder}), kept: {', '.join(changed)} changed since it was built but not the "
                     f"stage's VERSION, so its output holds (FORCE={stage(name).name} rebuilds it anyway; "
                     f"{FORCE_ENV} outside make)")
    else:
        mf.log(name, f"up to date ({folder})")
    return True


def produce(name: str, final: Path, fp: str, make: Callable[[Path], dict[str, Any]]) -> Path:
    """The guard: skip when current; else `make(scratch)` builds the output and returns its manifest
    fields, and the scratch folder becomes `final` only when all of it succeeded."""
    if current(name, final, fp):
        return final
    started = time.time()
    with mf.stage_dir(final) as tmp:
        fields = make(tmp)
        mf.write_manifest(tmp, name, fp, started, code=code_hashes(name), **fields)
    return final


def summarize(name: str, folder: Path, fp: str, started: float, **fields: Any) -> None:
    """The manifest of a stage whose outputs are subfolders, each produced on its own (sources,
    quantize): written in place once every part is done."""
    folder.mkdir(parents=True, exist_ok=True)
    mf.write_manifest(folder, name, fp, started, code=code_hashes(name), **fields)
