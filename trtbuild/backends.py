"""Which engine backends this machine can build and serve, and why not.

`auto` means TensorRT-LLM where it is usable (importable 1.2.x plus an NVIDIA GPU), else embedded.
Nothing here imports torch or tensorrt_llm: the check must be cheap and must not crash.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
from dataclasses import dataclass

SUPPORTED_TRTLLM = "1.2."


@dataclass(frozen=True)
class Availability:
    backend: str
    usable: bool
    reason: str


def trtllm() -> Availability:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return Availability("trtllm", False, "TensorRT-LLM is not installed (needs 1.2.x on a GPU host; see README)")
    try:
        version = importlib.metadata.version("tensorrt-llm")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if not version.startswith(SUPPORTED_TRTLLM):
        return Availability("trtllm", False, f"TensorRT-LLM {version} found; this toolkit targets {SUPPORTED_TRTLLM}x")
    if shutil.which("nvidia-smi") is None:
        return Availability("trtllm", False, f"TensorRT-LLM {version} found but no NVIDIA driver (nvidia-smi)")
    if shutil.which("trtllm-build") is None:
        return Availability("trtllm", False, f"TensorRT-LLM {version} found but `trtllm-build` is not on PATH")
    return Availability("trtllm", True, f"TensorRT-LLM {version}")


def embedded() -> Availability:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return Availability("embedded", False, "torch/transformers missing: run `make setup`")
    return Availability("embedded", True, "PyTorch runtime (CPU or GPU)")


def resolve(requested: str) -> str:
    """The backend to use for `requested` (auto|embedded|trtllm); raises with the reason if unusable."""
    if requested == "auto":
        return "trtllm" if trtllm().usable else "embedded"
    check = {"trtllm": trtllm, "embedded": embedded}.get(requested)
    if check is None:
        raise ValueError(f"unknown backend {requested!r} (use auto, embedded or trtllm)")
    a = check()
    if not a.usable:
        raise RuntimeError(f"BACKEND={requested} is not usable here: {a.reason}")
    return requested
