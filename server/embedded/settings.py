"""How an embedded engine is configured: an engine folder's settings, then the command's overrides.

One home for the choices `EmbeddedEngine.from_dir` makes before it loads anything: the device
(`auto` is resolved here and only here), speculative decoding, deterministic mode, and the limits
the build fixed. The order is: the folder (`engine.json`), then the environment (one command's
override, e.g. `make solve DEVICE=cpu`), then keyword arguments.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

import server.embedded.deterministic as deterministic
from server.embedded.speculative import SpecConfig

DEVICE_ENV = "EMBEDDED_DEVICE"  # overrides the engine folder's serving.device for one command
SPECULATIVE_ENV = "EMBEDDED_SPECULATIVE"  # auto|on|off: overrides serving.speculative.enabled for one command


def speculation(engine_dir: Path, spec: dict[str, Any], override: Optional[str] = None,
                max_batch: Optional[int] = None) -> dict[str, Any]:
    """EmbeddedEngine keywords (drafter, speculative) for an engine folder: on when it has a drafter,
    unless serving.speculative (or the override) says off; 'on' without a drafter is an error."""
    cfg = (spec.get("serving") or {}).get("speculative") or {}
    mode = override or os.environ.get(SPECULATIVE_ENV) or cfg.get("enabled", "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"speculative: {mode!r} is not auto, on or off")
    rel = spec.get("drafter_dir")
    if mode == "off" or (rel is None and mode == "auto"):
        return {}
    if rel is None:
        raise ValueError(f"{engine_dir / 'engine.json'}: speculative decoding is on but the engine has no drafter "
                         "(drafter.kind: redrafter in the recipe, then make build)")
    drafter = spec.get("drafter") or {}
    return {"drafter": engine_dir / rel,
            "speculative": SpecConfig(draft_len=int(drafter.get("draft_len_per_beam", 3)),
                                      num_beams=int(drafter.get("num_beams", 1)),
                                      max_batch=int(max_batch if max_batch is not None else cfg.get("max_batch", 0)))}


def resolve_device(device: str) -> torch.device:
    """auto: the first CUDA device when there is one, else the CPU; errors name what is wrong."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r}: use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device here (torch {torch.__version__}); use auto or cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the embedded engine runs on cpu or cuda")
    return dev


def engine_options(engine_dir: str | Path, overrides: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """(model folder, EmbeddedEngine keywords) for a folder written by `make engine` (build/embedded/)
    or a plain HF checkpoint folder. `speculative="on"|"off"|"auto"` in `overrides` overrides the
    folder's serving.speculative.enabled (and the EMBEDDED_SPECULATIVE environment variable does,
    for one command)."""
    overrides = dict(overrides)
    engine_dir = Path(engine_dir)
    spec_file = engine_dir / "engine.json"
    if spec_file.is_file():
        spec = json.loads(spec_file.read_text())
        if spec.get("backend") != "embedded":
            raise ValueError(f"{spec_file}: backend is {spec.get('backend')!r}, not 'embedded'")
        model_dir = engine_dir / spec["model_dir"]
        limits = spec["limits"]
        serving = spec.get("serving") or {}
        kw = dict(max_batch_size=limits["max_batch_size"], max_seq_len=limits["max_seq_len"],
                  max_input_len=limits["max_input_len"], device=serving.get("device", "auto"),
                  deterministic=bool(serving.get("deterministic", False)),
                  **speculation(engine_dir, spec, overrides.pop("speculative", None),
                                overrides.pop("speculative_max_batch", None)))
    elif (engine_dir / "config.json").is_file():
        model_dir, kw = engine_dir, {}
        overrides.pop("speculative", None), overrides.pop("speculative_max_batch", None)
    else:
        raise FileNotFoundError(f"{engine_dir}: neither an embedded engine (engine.json) nor an HF checkpoint "
                                "(config.json); run `make engine` first")
    if os.environ.get(DEVICE_ENV):
        kw["device"] = os.environ[DEVICE_ENV]  # a command's override (make ... DEVICE=cpu)
    env = os.environ.get(deterministic.ENV, "")
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"{deterministic.ENV}={env!r}: expected 0 or 1")
        kw["deterministic"] = env == "1"
    kw.update(overrides)
    return model_dir, kw
