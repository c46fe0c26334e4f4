"""Is an engine folder complete? Cheap checks before loading it, so a broken folder fails at start
with the file named, instead of every request failing later.

Checked: `engine.json` (valid JSON, a known backend), the model folder (config and tokenizer), and
per backend: embedded, each `*.safetensors` header readable and its tensors ending exactly at the
end of the file (a truncated copy is caught without reading the weights); trtllm, `engine/` with
its `config.json` and a non-empty `rank*.engine` per rank.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


class EngineFolderError(ValueError):
    """The engine folder cannot be served; the message names the file and what is wrong."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_safetensors(path: Path) -> None:
    """The header parses and the tensors' data ends exactly at the file's end (8-byte length, JSON header, data)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise EngineFolderError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise EngineFolderError(f"{path}: truncated or corrupt safetensors header (header {n} bytes, file {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EngineFolderError(f"{path}: corrupt safetensors header ({e})") from None
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and "data_offsets" in t]
    expected = 8 + n + max(ends, default=0)
    if expected != size:
        raise EngineFolderError(f"{path}: {size} bytes but its header describes {expected} (truncated or corrupt copy)")


def check_engine_folder(folder: str | Path) -> dict[str, Any]:
    """The folder's engine.json, after checking that the folder holds what that backend loads."""
    from server.backends import read_engine_file

    folder = Path(folder)
    try:
        spec = read_engine_file(folder)
    except (FileNotFoundError, ValueError) as e:
        raise EngineFolderError(str(e)) from None
    model = folder / str(spec.get("model_dir", "model"))
    if not model.is_dir():
        raise EngineFolderError(f"{model}: missing (the engine's model/tokenizer folder); copy the whole build folder")
    if not any((model / t).is_file() for t in TOKENIZER_FILES):
        raise EngineFolderError(f"{model}: no tokenizer ({', '.join(TOKENIZER_FILES)})")
    if spec["backend"] == "embedded":
        if not (model / "config.json").is_file():
            raise EngineFolderError(f"{model / 'config.json'}: missing")
        weights = sorted(model.glob("*.safetensors"))
        if not weights:
            raise EngineFolderError(f"{model}: no *.safetensors weights")
        for w in weights:
            check_safetensors(w)
    elif spec["backend"] == "trtllm":
        trt = folder / str(spec.get("engine_dir", "engine"))
        if not (trt / "config.json").is_file():
            raise EngineFolderError(f"{trt / 'config.json'}: missing (the TensorRT engine folder is incomplete)")
        tp = int((spec.get("limits") or {}).get("tp_size", 1))
        for rank in range(tp):
            plan = trt / f"rank{rank}.engine"
            if not plan.is_file() or plan.stat().st_size == 0:
                raise EngineFolderError(f"{plan}: missing or empty (a TensorRT engine per rank, tp_size {tp})")
    return spec
