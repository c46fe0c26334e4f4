"""How `make engine`'s cost grows with the model: the whole embedded pipeline on random Qwen2 models.

    python -m trtbuild.programs.bench_scale [--sizes 135m,0.5b,1.5b,3b] [--work DIR] [--out JSON] [--resume]
    make bench-scale SIZES=135m,0.5b,1.5b

For each size, two random-weight Qwen2 sources (the CoT and the TIR, Qwen2.5's shapes with the tiny
BPE tokenizer's vocabulary, generated here: nothing is downloaded) go through every stage of the mix's
recipe (merge, int8_wo and fp8 with their quality gates, the drafter with the mix's settings, the
embedded build), each stage in its own process. Per stage it records wall seconds, the process's peak
host memory (its rusage: resident pages, those of mmap'd weight files included) and its peak private
memory (RssAnon sampled every 50 ms: what it holds itself), its peak GPU memory where it used one,
and the disk it added to the model's folder. Then it fits, per stage, seconds = a + b x parameters
and the growth exponent between the two largest sizes, and projects the 7B and 14B (Qwen2.5's
parameter counts) cost from the linear fit.
The JSON is written after every stage; `--resume` keeps its rows and goes on from the first stage it
lacks (a run cut short by a time limit loses only the stage it was in).

Random weights generate to the length limit every time: the gates' and the drafter's generation costs
here are upper bounds of a trained model's, which stops at its EOS. Parameters are counted from the
checkpoints; with the tiny vocabulary the embeddings are a smaller share than in the real models,
which the projection's per-parameter fit absorbs (a 14B's embeddings are 5% of it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from trtbuild.resources import safetensors_params

# Qwen2.5 shapes: (hidden, layers, heads, kv heads, intermediate); 135m is SmolLM2-135M's in Qwen2 form
SIZES = {"135m": (576, 30, 9, 3, 1536), "0.5b": (896, 24, 14, 2, 4864), "1.5b": (1536, 28, 12, 2, 8960),
         "3b": (2048, 36, 16, 2, 11008), "7b": (3584, 28, 28, 4, 18944)}
PROJECT = {"7b": 7.62e9, "14b": 14.77e9}  # Qwen2.5-7B / 14B parameters, embeddings included
STAGES = ("sources", "merge", "quantize", "drafter", "build")
MIX = Path(__file__).resolve().parents[2] / "engines" / "mix.yaml"


def recipe_name(size: str) -> str:
    return "scale-" + size.replace(".", "_")  # a recipe name takes letters, digits, '-' and '_'


def recipe_for(size: str, sources: dict[str, Path]) -> dict[str, Any]:
    """The mix's recipe with random sources in place of SmolLM2 and its LoRA fine-tune; GGUF left out
    (its converter is a separate install and its cost is llama.cpp's), the limits the models take."""
    data = yaml.safe_load(MIX.read_text())
    data["name"] = recipe_name(size)
    data["sources"] = {name: {"kind": "hf", "path": str(path)} for name, path in sources.items()}
    data["quantize"]["formats"] = ["int8_wo", "fp8"]
    data["build"].update(quantization="int8_wo", backend="embedded", max_input_len=512, max_seq_len=1024,
                         max_num_tokens=2048)
    data["build"].pop("cpu_quantization", None)
    return data


def make_sources(size: str, work: Path) -> tuple[dict[str, Path], float]:
    """Two random Qwen2 checkpoints of `size` sharing one tokenizer; (their folders, seconds taken)."""
    from trtbuild.tiny_model import make_model

    hidden, layers, heads, kv, inter = SIZES[size]
    t = time.perf_counter()
    out = {}
    for seed, name in enumerate(("cot", "tir")):
        folder = work / "sources" / f"{size}-{name}"
        if not (folder / "config.json").is_file():
            make_model(folder, "qwen2", seed=seed, tokenizer_from=out.get("cot"), hidden_size=hidden, layers=layers,
                       heads=heads, kv_heads=kv, intermediate_size=inter, sharpen=False)
        out[name] = folder
    return out, time.perf_counter() - t


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def anon_bytes(pid: int) -> Optional[int]:
    """The process's private resident memory (Linux RssAnon): what it holds itself, without the pages
    of files it maps (safetensors weights read through mmap count in RSS but are the kernel's to drop)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class AnonPeak(threading.Thread):
    """The peak of `anon_bytes(pid)`, sampled every 50 ms until `stop()`."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self._done = pid, None, threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.wait(0.05):
            now = anon_bytes(self.pid)
            if now is not None:
                self.peak = max(self.peak or 0, now)

    def stop(self) -> Optional[int]:
        self._done.set()
        self.join()
        return self.peak


def run_stage(stage: str, recipe: Path, out_dir: Path) -> dict[str, Any]:
    """One stage in its own process: wall seconds, its peak RSS (wait4's rusage) and private memory
    (sampled), peak GPU, disk added."""
    stats = out_dir.parent / f".{out_dir.name}-{stage}-stats.json"
    before = folder_bytes(out_dir)
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "trtbuild.programs.bench_scale", "--child", stage,
                             "--recipe", str(recipe), "--stats", str(stats)])
    sampler = AnonPeak(proc.pid)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: its pid is not reused yet
    anon = sampler.stop()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"bench_scale: stage {stage} of {recipe} failed (exit {proc.returncode}); its output "
                           "is above, the earlier stages are kept")
    child = json.loads(stats.read_text()) if stats.is_file() else {}
    stats.unlink(missing_ok=True)
    return {"stage": stage, "seconds": round(seconds, 2), "peak_rss_bytes": usage.ru_maxrss * 1024,
            "peak_anon_bytes": anon, "peak_gpu_bytes": child.get("peak_gpu_bytes"),
            "disk_bytes": folder_bytes(out_dir) - before}


def _child(stage: str, recipe: str, stats: Path) -> int:
    """The stage, then its peak GPU memory where it used one (read in its own process)."""
    from trtbuild.__main__ import main

    rc = main([stage, "--recipe", recipe, "--backend", "embedded"] if stage == "build" else [stage, "--recipe", recipe])
    torch = sys.modules.get("torch")
    peak = None
    if torch is not None and torch.cuda.is_initialized():
        from server.embedded.loader import stage_device

        dev = stage_device()
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    stats.write_text(json.dumps({"peak_gpu_bytes": peak}))
    return rc


def size_total(rows: list[dict[str, Any]], size: str, sources_seconds: float) -> dict[str, Any]:
    """The whole pipeline's row for `size`: seconds and disk summed, peaks the stages' maxima."""
    stages = [r for r in rows if r["size"] == size and r["stage"] in STAGES]
    gpu = [r["peak_gpu_bytes"] for r in stages if r["peak_gpu_bytes"] is not None]
    return {"size": size, "params": stages[0]["params"], "stage": "total",
            "seconds": round(sum(r["seconds"] for r in stages), 2),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in stages),
            "peak_anon_bytes": max((r.get("peak_anon_bytes") or 0 for r in stages), default=0) or None,
            "peak_gpu_bytes": max(gpu) if gpu else None,
            "disk_bytes": sum(r["disk_bytes"] for r in stages), "sources_generated_seconds": round(sources_seconds, 1)}


def fit(points: list[tuple[float, float]]) -> dict[str, Optional[float]]:
    """Least squares seconds = a + b x params over (params, seconds); the exponent between the two
    largest (log seconds over log params: 1 is linear growth)."""
    import math

    n = len(points)
    if n < 2:
        return {"a": None, "b": None, "exponent": None}
    mx, my = sum(p for p, _ in points) / n, sum(s for _, s in points) / n
    var = sum((p - mx) ** 2 for p, _ in points)
    b = sum((p - mx) * (s - my) for p, s in points) / var if var else 0.0
    (p1, s1), (p2, s2) = sorted(points)[-2:]
    exponent = math.log(s2 / s1) / math.log(p2 / p1) if min(s1, s2) > 0 and p2 > p1 else None
    return {"a": my - b * mx, "b": b, "exponent": None if exponent is None else round(exponent, 3)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage and for the whole pipeline: the fit and the 7B / 14B projections (seconds)."""
    out = {}
    for stage in (*STAGES, "total"):
        pts = [(r["params"], r["seconds"]) for r in rows if r["stage"] == stage]
        f = fit(pts)
        # never below the largest size measured: a stage of fixed cost (the drafter's data is a recipe
        # choice) fits a slope of noise, which may point down
        floor = max(pts)[1] if pts else 0.0
        proj = {k: (round(max(floor, f["a"] + f["b"] * v), 1) if f["b"] is not None else None)
                for k, v in PROJECT.items()}
        out[stage] = {**f, "projected_seconds": proj}
    return out


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    versions = {}
    for pkg in ("torch", "transformers", "mergekit", "nvidia-modelopt"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": time.strftime("%Y-%m-%d"), "host": platform.machine(), "cpus": os.cpu_count(), "gpu": gpu,
            **versions}


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    from server.tables import format_table

    view = [{**r, "params_m": r["params"] / 1e6, "rss_gb": r["peak_rss_bytes"] / 1e9,
             "rss_x": r["peak_rss_bytes"] / (2 * r["params"]), "disk_gb": r["disk_bytes"] / 1e9,
             "anon_x": None if not r.get("peak_anon_bytes") else r["peak_anon_bytes"] / (2 * r["params"]),
             "gpu_gb": None if r["peak_gpu_bytes"] is None else r["peak_gpu_bytes"] / 1e9} for r in rows]
    print(format_table(view, [("size", "size", "<6"), ("params M", "params_m", ">9.0f"), ("stage", "stage", "<9"),
                              ("seconds", "seconds", ">9.1f"), ("peak RSS GB", "rss_gb", ">12.2f"),
                              ("x bf16", "rss_x", ">7.2f"), ("private x bf16", "anon_x", ">15.2f"),
                              ("peak GPU GB", "gpu_gb", ">12.2f"),
                              ("disk GB", "disk_gb", ">8.2f")]))
    fits = [{"stage": s, "exponent": v["exponent"], "7b": v["projected_seconds"]["7b"],
             "14b": v["projected_seconds"]["14b"]} for s, v in summary.items()]
    print(format_table(fits, [("stage", "stage", "<9"), ("growth exponent", "exponent", ">16.2f"),
                              ("7B s (linear fit)", "7b", ">18.0f"), ("14B s", "14b", ">10.0f")]))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtbuild.programs.bench_scale", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="135m", help=f"of {', '.join(SIZES)} (135m: about 9 min on 2 CPU cores; "
                    "135m,0.5b,1.5b: about 14 min on an H100 host)")
    ap.add_argument("--work", type=Path, default=Path("engines/scale"), help="sources and pipeline outputs")
    ap.add_argument("--out", type=Path, default=None, help="JSON written after every stage")
    ap.add_argument("--keep", action="store_true", help="keep each size's outputs (default: removed after it)")
    ap.add_argument("--resume", action="store_true", help="keep --out's rows and go on from the first missing stage")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--recipe", help=argparse.SUPPRESS)
    ap.add_argument("--stats", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child, args.recipe, args.stats)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"--sizes: unknown {', '.join(unknown)} (known: {', '.join(SIZES)})")
    if args.resume and args.out is None:
        ap.error("--resume needs --out (the rows it goes on from)")
    args.work = args.work.resolve()  # the recipe's source paths resolve against its own folder
    args.work.mkdir(parents=True, exist_ok=True)
    meta, rows = environment(), []
    if args.resume and args.out.is_file():
        rows = json.loads(args.out.read_text())["rows"]

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "rows": rows, "fit": summarize(rows)}, indent=2) + "\n")

    for size in sizes:
        done = {r["stage"] for r in rows if r["size"] == size}
        if "total" in done:
            continue
        print(f"[bench_scale] {size}: generating the two random sources", file=sys.stderr, flush=True)
        sources, made = make_sources(size, args.work)
        params = safetensors_params(sources["cot"])
        recipe = args.work / f"{recipe_name(size)}.yaml"
        recipe.write_text(yaml.safe_dump(recipe_for(size, sources), sort_keys=False))
        out_dir = args.work / recipe_name(size)
        if done and not out_dir.is_dir():  # its outputs are gone (another machine, a cleaned folder): redo it
            print(f"[bench_scale] {size}: {out_dir} is gone; measuring its stages again", file=sys.stderr)
            rows = [r for r in rows if r["size"] != size]
            done = set()
        if not done:
            shutil.rmtree(out_dir, ignore_errors=True)  # a cold run: every stage does its work
        for stage in STAGES:
            if stage in done:
                continue
            print(f"[bench_scale] {size} ({params / 1e6:.0f}M parameters): {stage}", file=sys.stderr, flush=True)
            rows.append({"size": size, "params": params, **run_stage(stage, recipe, out_dir)})
            save()
        rows.append(size_total(rows, size, made))
        save()
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
            shutil.rmtree(args.work / "sources", ignore_errors=True)
    print_table(rows, summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
