"""Which engine backends this machine can build and serve, and why not.

`auto` means TensorRT-LLM where it is usable (1.2.x in the `TRTLLM_PYTHON` environment plus an NVIDIA
GPU), else embedded. Nothing here imports torch or tensorrt_llm: the check must be cheap and must not
crash.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Availability:
    backend: str
    usable: bool
    reason: str


def trtllm() -> Availability:
    from trtbuild.trtllm.env import probe

    env = probe()
    return Availability("trtllm", env.usable, env.summary())


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
