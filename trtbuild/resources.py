"""What a stage will write and hold, checked before it starts: a build that runs out of disk or memory
should say so in one line at the start, not fail an hour in with a half-written folder.

Sizes are in units of the model's bf16 checkpoint (`model_bytes`: 2 bytes a parameter of the largest
source, counted from the checkpoint itself: safetensors headers or GGUF tensor shapes, nothing
loaded). The per-stage factors are what the mix (SmolLM2-135M) wrote, rounded up; they are upper
bounds for larger models, whose embeddings (kept in bf16 by every quantized format) are a smaller
share of the weights:

| stage | disk written (x bf16) | measured on the mix (135M, 272 MB bf16) |
|---|---|---|
| sources | 1.0 a converted or fine-tuned source | 272 MB each (hf sources are used in place: 0) |
| merge | 1.0 | 260 MB |
| quantize | 1.5 a ModelOpt format (HF + TensorRT-LLM exports), 0.6 gguf_q8_0 | 387 / 385 / 148 MB |
| drafter | 0.25 | 58 MB |
| build | 0: hard links; where they fail, served (1.0 bf16, 0.7 int8/fp8, 0.6 gguf) + CPU weights + drafter | 359 MB |

Disk is checked against the free space of the output folder's file system, for the stages still to
run (a stage whose folder is complete counts 0, as does a stale one: a rebuild is an estimate's
miss, the folder it replaces is freed after). Memory: every stage that runs the model holds at
least its bf16 weights, so a machine whose available memory is below `model_bytes` is refused; below
`PEAK_FACTOR` x (per GPU or CPU host), a warning (float32 reference replies and ModelOpt's calibration
copy peak there).
`TRTBUILD_SKIP_RESOURCE_CHECK=1` skips the refusal (the estimate is still printed).

Time: each model-running stage takes about a + b x parameters seconds (`STAGE_SECONDS`), fitted by
`python -m trtbuild.programs.bench_scale` on random-weight Qwen2 models, which generate to the length
limit every time (so an upper bound for trained models, which stop at their EOS). On a GPU host: one
H100's runs at 135M-3B (bench/scale-gpu-h100.json, the 1.5B rerun of 2026-12-07 included; past 3B a
straight line's guess). The build's
entry is the 135M-1.5B fit, measured before the batched FP8-KV price: the 3B build, after it, took
55 s against 123 s at 1.5B, so a fit across both falls with size; the older one stays as the upper
bound. On the CPU: the 2-core CI host at 135M and 0.5B, and 1.5B for merge and quantize
(bench/scale-cpu.json), scaled by 2 / the host's cores. Quantize's figure is for two ModelOpt
formats, scaled by the count still to make; a GGUF conversion and a TIR fine-tune source's training
are not estimated.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from aimo_spec import gguf_header
from aimo_spec.gguf_header import GGUFError
from aimo_spec.layout import is_gguf
from aimo_spec.recipe import GGUFPackageSource, HFSource, Recipe, RecipeError, TIRFinetuneSource, gguf_file
from aimo_spec.safetensors_header import SafetensorsError, parameters, read_header
from trtbuild import manifest as mf

SKIP_ENV = "TRTBUILD_SKIP_RESOURCE_CHECK"
# host memory a model-running stage may peak at, x the bf16 checkpoint, where it runs: on a GPU host issue
# 22's bound (measured: 1.28x private at 3B, bench/scale-gpu-h100.json); on a CPU the reference replies and
# the calibration run in float32 (measured: 3.5x at 0.5B, 3.3x at 1.5B, bench/scale-cpu.json)
PEAK_FACTOR = {"gpu": 3.0, "cpu": 4.0}
WEIGHTS = {"bf16": 1.0, "int8_wo": 0.7, "fp8": 0.7, "gguf_q8_0": 0.6}  # an engine's copy of the served weights
QUANTIZE = {"int8_wo": 1.5, "fp8": 1.5, "gguf_q8_0": 0.6}
DRAFTER = 0.25
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1,
               "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}


# stage -> (a seconds, b seconds a parameter); see the module docstring for where they were measured
STAGE_SECONDS = {
    "gpu": {"merge": (29.8, 15.4e-9), "quantize": (55.0, 27.0e-9), "drafter": (56.4, 7.3e-9),
            "build": (117.6, 1.85e-9)},
    "cpu": {"merge": (40.7, 171e-9), "quantize": (37.7, 444e-9), "drafter": (195.6, 1038e-9),
            "build": (35.9, 166e-9)},
}
MEASURED_CPU_CORES = 2
MEASURED_QUANTIZE_FORMATS = 2


class ResourceError(RuntimeError):
    """Not enough disk or memory for the stages to run; the message gives the need and what is free."""


@dataclass(frozen=True)
class Need:
    stage: str
    disk_bytes: int  # what it writes (0 when its output is already complete)
    memory_bytes: int  # the least it holds: the model's bf16 weights where it runs (0: nothing to do)


def safetensors_params(folder: Path) -> int:
    """Parameters in a folder's *.safetensors files, from their JSON headers (no tensor is read); a header
    that is not whole raises SafetensorsError naming its file."""
    return sum(parameters(read_header(f)[0]) for f in sorted(folder.glob("*.safetensors")))


def gguf_params(path: Path) -> int:
    """Parameters of a GGUF file, from its tensor table (aimo_spec.gguf_header: milliseconds, where gguf's
    reader took seconds before every stage command)."""
    return gguf_header.parameters(path)


def source_params(recipe: Recipe, name: str) -> Optional[int]:
    """Parameters of one source, None where they cannot be told before the sources stage."""
    src = recipe.sources[name]
    if isinstance(src, TIRFinetuneSource):
        return source_params(recipe, src.base)
    if isinstance(src, GGUFPackageSource):
        path = gguf_file(src, f"{recipe.path}: sources.{name}")
        try:
            return gguf_params(path)
        except (GGUFError, OSError) as e:
            raise RecipeError(f"{recipe.path}: sources.{name}.file: {str(e)[:300]}") from None
    if isinstance(src, HFSource):
        folder = recipe.resolve(src.path)
        try:
            return safetensors_params(folder) or None
        except (SafetensorsError, OSError) as e:
            raise RecipeError(f"{recipe.path}: sources.{name}.path: {e}") from None
    return None


def model_bytes(recipe: Recipe) -> Optional[int]:
    """The bf16 size of the largest source (what the merge writes), None if unknown."""
    counts = [c for c in (source_params(recipe, n) for n in recipe.sources) if c]
    return 2 * max(counts) if counts else None


def _done(folder: Path) -> bool:
    m = mf.read_manifest(folder)
    return bool(m) and m.get("status") == "done"


def needs(recipe: Recipe, todo: tuple[str, ...], size: int) -> list[Need]:
    """What each stage of `todo` writes and holds, for a model of `size` bf16 bytes."""
    layout, b = recipe.layout, recipe.build
    out = []
    for stage in todo:
        if stage == "sources":
            disk = sum(size for n, s in recipe.sources.items()
                       if not isinstance(s, HFSource) and not _done(layout.source(n)))
        elif stage == "merge":
            disk = 0 if _done(layout.merge) else size
        elif stage == "quantize":
            disk = int(sum(QUANTIZE[f] * size for f in recipe.quantize.formats if not _done(layout.quantize_format(f))))
        elif stage == "drafter":
            disk = 0 if recipe.drafter.kind == "none" or _done(layout.drafter) else int(DRAFTER * size)
        elif stage == "build" and any(_done(layout.engine(k)) for k in ("embedded", "trtllm")):
            disk = 0
        elif stage == "build":
            cpu = b.cpu_quantization if b.cpu_quantization not in (None, b.quantization) else None
            factor = WEIGHTS[b.quantization] + (WEIGHTS[cpu] if cpu else 0.0)  # cpu_model/ where it differs
            factor += DRAFTER if recipe.drafter.kind != "none" else 0.0
            # the weights are hard-linked from the earlier stages' folders where the file system allows
            disk = 0 if mf.links_work(layout.root) else int(factor * size)
            out.append(Need(stage, disk, size))  # it runs the model (the FP8 KV cache's price) either way
            continue
        else:
            disk = 0
        # a stage with nothing to write has nothing to run (hf sources are used in place, no model loaded)
        out.append(Need(stage, disk, size if disk else 0))
    return out


def estimate_seconds(recipe: Recipe, plan: list[Need], params: int, where: str,
                     cores: Optional[int] = None) -> dict[str, float]:
    """Seconds each stage of `plan` with work to do should take for a model of `params` parameters, on
    `where` ("gpu" or "cpu"; a CPU of `cores` cores, default this host's)."""
    table = STAGE_SECONDS[where]
    cpu_scale = MEASURED_CPU_CORES / max(1, cores or os.cpu_count() or 1) if where == "cpu" else 1.0
    out = {}
    for need in plan:
        if need.stage not in table or not need.memory_bytes:
            continue  # nothing to run (or the sources stage: hf sources are used in place)
        a, b = table[need.stage]
        seconds = (a + b * params) * cpu_scale
        if need.stage == "quantize":  # the ModelOpt formats still to make (a GGUF's conversion is not estimated)
            todo = [f for f in recipe.quantize.formats
                    if not is_gguf(f) and not _done(recipe.layout.quantize_format(f))]
            if not todo:
                continue
            seconds *= len(todo) / MEASURED_QUANTIZE_FORMATS
        out[need.stage] = seconds
    return out


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{max(1, round(seconds / 60))} min"


def _where() -> str:
    """Where the model-running stages will run ("gpu" or "cpu"), as they choose it (TRTBUILD_DEVICE)."""
    from server.embedded.loader import stage_device

    try:
        return "cpu" if stage_device().type == "cpu" else "gpu"
    except ValueError:
        return "cpu"  # a bad TRTBUILD_DEVICE: the stage itself names it


def available_memory() -> Optional[int]:
    """MemAvailable from /proc/meminfo (Linux), None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_disk(folder: Path) -> int:
    p = folder
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check(recipe: Recipe, todo: tuple[str, ...], log: Any = print) -> list[Need]:
    """Print what `todo` needs; raise ResourceError where the disk or memory cannot hold it (unless
    TRTBUILD_SKIP_RESOURCE_CHECK=1). A recipe whose sources' size cannot be told is not checked."""
    try:
        size = model_bytes(recipe)
    except RecipeError:
        raise
    except Exception as e:  # noqa: BLE001 - an unreadable header is the sources stage's error to report
        log(f"[resources] model size unknown ({type(e).__name__}: {e}); not checked")
        return []
    if not size:
        log("[resources] model size unknown before the sources stage; not checked")
        return []
    plan = needs(recipe, todo, size)
    disk = sum(n.disk_bytes for n in plan)
    held = max((n.memory_bytes for n in plan), default=0)
    free = free_disk(recipe.out_dir)
    mem = available_memory()
    where = _where() if held else "cpu"  # (asking imports torch: only when a stage will run the model)
    peak = PEAK_FACTOR[where] * size
    memory = (f"model-running stages hold {_gb(size)}-{_gb(peak)} of memory" if held else "nothing to run")
    log(f"[resources] model {_gb(size)} in bf16; {', '.join(todo)} write up to {_gb(disk)} "
        f"({_gb(free)} free at {recipe.out_dir}); {memory} ({_gb(mem) if mem is not None else 'unknown'} available)")
    if held:
        times = estimate_seconds(recipe, plan, size // 2, where)
        unknown = [n.stage for n in plan if n.memory_bytes and n.stage not in times]
        if times:
            log(f"[resources] time on the {where.upper()}, roughly (an upper bound from bench_scale's fit): "
                + ", ".join(f"{k} {_duration(v)}" for k, v in times.items())
                + f"; {_duration(sum(times.values()))} in all"
                + (f", besides {' and '.join(unknown)} (not estimated)" if unknown else ""))
    problems = []
    if disk > free:
        problems.append(f"disk: up to {_gb(disk)} to write, {_gb(free)} free at {recipe.out_dir}")
    if mem is not None and held > mem:
        problems.append(f"memory: the model alone takes {_gb(size)} in bf16, {_gb(mem)} available")
    elif mem is not None and held and peak > mem:
        log(f"[resources] warning: stages may peak at {_gb(peak)} of memory, {_gb(mem)} available")
    if problems:
        msg = "; ".join(problems) + f" (set {SKIP_ENV}=1 to run anyway)"
        if os.environ.get(SKIP_ENV) == "1":
            log(f"[resources] warning: {msg}")
        else:
            raise ResourceError(msg)
    return plan
