"""How the runtime is configured: a command's serving settings, and the options of an embedded engine.

Serving settings have one home, the recipe's `serving` section: an engine folder (`engine.json`) holds
only what the build decided (format, limits, files, drafter shape), so editing a temperature, a vote
or the device never redoes the build. `serving_settings` resolves them, once per command, for every
backend and surface (solve, eval, serve, Triton, Kaggle, benchmarks): the recipe's section (its
defaults without a recipe), then the environment (one command's override, e.g. `make solve
DEVICE=cpu`), then the command's flags.

`engine_options` makes the choices `EmbeddedEngine.from_dir` makes before it loads anything: the
limits the build fixed, then the device, speculative decoding, deterministic mode and KV cache dtype of
the serving settings, then keyword arguments. `auto` devices are resolved by `resolve_device`, here and only here.
Nothing here imports torch at import time: the surfaces resolve settings for remote backends too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from aimo_spec.engine_file import check_engine_spec
from aimo_spec.jsonfile import read_json
from aimo_spec.layout import ENGINE_FILE, GGUF_FILE
from aimo_spec.recipe import Recipe, ServingSpec

PLAIN_MAX_SEQ_LEN = 4096  # EmbeddedEngine's default, for a plain checkpoint whose config allows more

if TYPE_CHECKING:
    import torch

DEVICE_ENV = "EMBEDDED_DEVICE"  # overrides serving.device for one command (make ... DEVICE=cpu)
SPECULATIVE_ENV = "EMBEDDED_SPECULATIVE"  # auto|on|off: overrides serving.speculative.enabled for one command
DETERMINISTIC_ENV = "EMBEDDED_DETERMINISTIC"  # 0|1: overrides serving.deterministic (make ... DETERMINISTIC=1)
SPECULATIVE_MODES = ("auto", "on", "off")


def serving_settings(source: Recipe | ServingSpec | None = None, *, device: Optional[str] = None,
                     speculative: Optional[str] = None, deterministic: Optional[bool] = None) -> ServingSpec:
    """The serving settings a command runs with: `source`'s (a recipe's `serving`, a section read
    elsewhere, or the defaults), then the environment (DEVICE_ENV, SPECULATIVE_ENV, DETERMINISTIC_ENV),
    then the flags given here (None: not given)."""
    serving = source.serving if isinstance(source, Recipe) else source or ServingSpec()
    mode = speculative or os.environ.get(SPECULATIVE_ENV) or serving.speculative.enabled
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative: {mode!r} is not auto, on or off")
    if deterministic is None:
        flag = os.environ.get(DETERMINISTIC_ENV, "")
        if flag not in ("", "0", "1"):
            raise ValueError(f"{DETERMINISTIC_ENV}={flag!r}: expected 0 or 1")
        deterministic = flag == "1" if flag else serving.deterministic
    return dataclasses.replace(serving, device=device or os.environ.get(DEVICE_ENV) or serving.device,
                               deterministic=deterministic,
                               speculative=dataclasses.replace(serving.speculative, enabled=mode))


def speculation(engine_dir: Path, spec: dict[str, Any], mode: str, max_batch: int) -> dict[str, Any]:
    """EmbeddedEngine keywords (drafter, speculative) for an engine folder: `mode` auto drafts when the
    folder has a drafter, off never; 'on' without a drafter is an error."""
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative: {mode!r} is not auto, on or off")
    rel = spec.get("drafter_dir")
    if mode == "off" or (rel is None and mode == "auto"):
        return {}
    if rel is None:
        raise ValueError(f"{engine_dir / ENGINE_FILE}: speculative decoding is on but the engine has no drafter "
                         "(drafter.kind: redrafter in the recipe, then make build)")
    from server.embedded.speculative import SpecConfig

    drafter = spec.get("drafter") or {}
    return {"drafter": engine_dir / rel,
            "speculative": SpecConfig(draft_len=int(drafter.get("draft_len_per_beam", 3)),
                                      num_beams=int(drafter.get("num_beams", 1)), max_batch=int(max_batch))}


def resolve_device(device: str) -> "torch.device":
    """auto: the first CUDA device when there is one, else the CPU; errors name what is wrong."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r}: use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device here (torch {torch.__version__}); use auto or cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this host has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the embedded engine runs on cpu or cuda")
    return dev


def _weights_key(spec: dict[str, Any], device: Any, mode: str, deterministic: bool) -> str:
    """Which of an engine folder's weights to serve: `cpu_model_dir` (build.cpu_quantization, e.g. a GGUF
    that llama.cpp decodes several times faster) where the engine runs on a CPU, unless what was asked
    needs the main weights: their drafter (speculative on) or the slot runner (deterministic)."""
    if not spec.get("cpu_model_dir") or mode == "on" or deterministic:
        return "model_dir"
    if resolve_device(str(device)).type != "cpu":
        return "model_dir"
    if str(spec.get("cpu_quantization", "")).startswith("gguf") and importlib.util.find_spec("llama_cpp") is None:
        print(f"[embedded] llama-cpp-python is not installed: serving {spec.get('quantization')} instead of "
              f"{spec['cpu_quantization']} on the CPU (make setup installs it)", file=sys.stderr)
        return "model_dir"
    return "cpu_model_dir"


def engine_options(engine_dir: str | Path, overrides: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """(model folder, EmbeddedEngine keywords) for a folder written by `make engine` (build/embedded/)
    or a plain HF checkpoint folder. `overrides` are `from_dir`'s keywords: `serving`, the command's
    serving settings (`serving_settings`; without it, the defaults under the command's environment);
    `speculative` (auto|on|off) and `speculative_max_batch` over serving.speculative; and any
    EmbeddedEngine keyword (device, deterministic, threads, ...), which wins over both. A `serving`
    copy in `engine.json` (folders built before the settings left the build) is ignored. A folder
    built with `build.cpu_quantization` serves those weights on a CPU (`_weights_key`) unless `weights`
    is "main" (a benchmark comparing drafting with plain decoding on the weights the drafter serves)."""
    overrides = dict(overrides)
    serving: ServingSpec = overrides.pop("serving", None) or serving_settings()
    weights = overrides.pop("weights", "auto")  # "main": never the CPU weights (what a drafter is measured on)
    if weights not in ("auto", "main"):
        raise ValueError(f"weights {weights!r}: use auto or main")
    mode = overrides.pop("speculative", None) or serving.speculative.enabled
    max_batch = overrides.pop("speculative_max_batch", None)
    if max_batch is None:
        max_batch = serving.speculative.max_batch
    engine_dir = Path(engine_dir)
    spec_file = engine_dir / ENGINE_FILE
    kw: dict[str, Any] = {"device": serving.device, "deterministic": serving.deterministic,
                          "kv_cache_dtype": serving.kv_cache_dtype}
    if spec_file.is_file():
        spec = read_json(spec_file, "no engine folder here; run `make engine` first", "rebuild it with `make build`")
        if isinstance(spec, dict) and spec.get("backend") != "embedded":
            raise ValueError(f"{spec_file}: backend is {repr(spec.get('backend'))[:200]}, not 'embedded'")
        spec = check_engine_spec(spec, spec_file)
        deterministic = overrides.get("deterministic", serving.deterministic)
        key = ("model_dir" if weights == "main" else
               _weights_key(spec, overrides.get("device") or serving.device, mode, deterministic))
        model_dir = engine_dir / spec[key]
        limits = spec["limits"]
        kw.update(max_batch_size=limits["max_batch_size"], max_seq_len=limits["max_seq_len"],
                  max_input_len=limits["max_input_len"])
        if key == "model_dir":  # the drafter learned the main weights' hidden states: other weights go without it
            kw.update(speculation(engine_dir, spec, mode, max_batch))
    elif (engine_dir / "config.json").is_file() or (engine_dir / GGUF_FILE).is_file():
        model_dir = engine_dir  # a plain checkpoint: no drafter, and EmbeddedEngine's defaults for the limits
        if (engine_dir / "config.json").is_file():  # ... within the positions the model was made for
            config = read_json(engine_dir / "config.json", "", "fix or replace the checkpoint's config.json")
            positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
            if isinstance(positions, int) and not isinstance(positions, bool) and 1 < positions < PLAIN_MAX_SEQ_LEN:
                kw["max_seq_len"] = positions
    else:
        raise FileNotFoundError(f"{engine_dir}: neither an embedded engine (engine.json) nor an HF checkpoint "
                                f"(config.json) nor a GGUF model ({GGUF_FILE}); run `make engine` first")
    if (model_dir / GGUF_FILE).is_file():  # llama.cpp serves it: on the CPU, its own cache, no drafter
        kw.update(runner="llamacpp", device="cpu", kv_cache_dtype="auto")
        kw.pop("drafter", None), kw.pop("speculative", None)
    kw.update(overrides)
    return model_dir, kw
