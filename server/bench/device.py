"""What the GPU benchmarks (`bench.gpu`, `bench.attention`, `bench.kernels`) share: the device, its copy
bandwidth, the environment a committed figure names, their grid of shapes, batches and contexts, and
a JSON written after every row (a run cut short by the device's time limit keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch


def cuda_device(prog: str) -> Optional[torch.device]:
    """The GPU a benchmark measures, or None (said on stderr) where there is none: the GPU benchmarks
    exit 2 then rather than measure a CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    print(f"{prog}: no CUDA device here; this benchmark measures a GPU", file=sys.stderr)
    return None


def copy_bandwidth(dev: torch.device, gib: float = 4.0) -> float:
    """Bytes per second a device-to-device copy moves, counting read and write."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del a, b
    return 2 * n * 2 / statistics.median(times)


def gpu_environment() -> dict[str, Any]:
    """What a committed GPU figure names: the date, the GPU, and torch's and Triton's versions."""
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def comma_ints(text: str) -> list[int]:
    """An option's comma-separated whole numbers ("1,4,16")."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def grid_arguments(ap: argparse.ArgumentParser, known_shapes: Iterable[str], shapes: str, batches: str,
                   contexts: Optional[str] = None) -> None:
    """--shapes (checked against the benchmark's own table), --batches, --contexts where the benchmark
    has a context axis, and --out."""
    known = list(known_shapes)

    def shape_list(text: str) -> list[str]:
        names = text.split(",")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown shape(s) {unknown}; known: {known}")
        return names

    ap.add_argument("--shapes", type=shape_list, default=shape_list(shapes), help=f"of {known}")
    ap.add_argument("--batches", type=comma_ints, default=comma_ints(batches))
    if contexts is not None:
        ap.add_argument("--contexts", type=comma_ints, default=comma_ints(contexts), help="tokens already cached")
    ap.add_argument("--out", type=Path, default=None, help="JSON written after every measured row")


def write_rows(out: Optional[Path], meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
