"""Is an engine folder complete? Cheap checks before loading it, so a broken folder fails at start
with the file named, instead of every request failing later.

Checked: `engine.json` (valid JSON, a known backend), the model folder (config and tokenizer), and
per backend: embedded, each `*.safetensors` header readable and its tensors ending exactly at the
end of the file (a truncated copy is caught without reading the weights); trtllm, `engine/` with
its `config.json` and a non-empty `rank*.engine` per rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aimo_spec.gguf_header import GGUFError, read_table
from aimo_spec.layout import GGUF_FILE
from aimo_spec.safetensors_header import SafetensorsError, check_whole


class EngineFolderError(ValueError):
    """The engine folder cannot be served; the message names the file and what is wrong."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_safetensors(path: Path) -> None:
    """The header parses and the tensors' data ends exactly at the file's end (8-byte length, JSON header, data)."""
    try:
        check_whole(path)
    except SafetensorsError as e:
        raise EngineFolderError(str(e)) from None


def _check_json(path: Path) -> None:
    """A JSON file the loaders read (a config, a tokenizer) parses, or an error naming it."""
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise EngineFolderError(f"{path}: not valid JSON ({str(e)[:200]})") from None


def _check_model_folder(model: Path, weights: bool) -> None:
    """A model folder's tokenizer and, with `weights`, its weights: a GGUF file (served by llama.cpp) or
    config.json + safetensors, each checked against its own header."""
    if not model.is_dir():
        raise EngineFolderError(f"{model}: missing (the engine's model/tokenizer folder); copy the whole build folder")
    if not any((model / t).is_file() for t in TOKENIZER_FILES):
        raise EngineFolderError(f"{model}: no tokenizer ({', '.join(TOKENIZER_FILES)})")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        if (model / name).is_file():
            _check_json(model / name)
    if not weights:
        return
    if (model / GGUF_FILE).is_file():
        check_gguf(model / GGUF_FILE)
        return
    if not (model / "config.json").is_file():
        raise EngineFolderError(f"{model / 'config.json'}: missing (nor a {GGUF_FILE})")
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise EngineFolderError(f"{model}: no *.safetensors weights")
    for w in files:
        check_safetensors(w)


def check_gguf(path: Path) -> None:
    """A GGUF file whose tensor table is readable and whose tensors all lie inside it (a truncated copy
    fails); the tensors' byte sizes come from the `gguf` package's table of ggml types, and where it is not
    installed (a serving-only environment) only their start offsets are checked."""
    try:
        table = read_table(path)
    except GGUFError as e:
        raise EngineFolderError(str(e)) from None
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        GGML_QUANT_SIZES = None
    end, running = table.data_start, 0
    for t in table.tensors:
        nbytes = 0
        if GGML_QUANT_SIZES is not None:
            try:
                block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
            except (ValueError, KeyError):
                raise EngineFolderError(f"{path}: tensor {t.name!r:.80} has ggml type {t.ggml_type}, which the "
                                        "gguf package does not know (corrupt, or newer than it)") from None
            nbytes = -(-t.elements // block) * type_bytes  # a partial block still takes its bytes
            if t.offset != running:  # llama.cpp lays tensors out back to back, each padded to the alignment
                raise EngineFolderError(f"{path}: tensor {t.name!r:.80} starts at {t.offset} of the data, not at "
                                        f"{running} where the tensors before it end (corrupt table)")
            running += -(-nbytes // table.alignment) * table.alignment
        end = max(end, table.data_start + t.offset + nbytes)
    size = path.stat().st_size
    if end > size:
        raise EngineFolderError(f"{path}: {size} bytes but its tensors end at {end} (truncated copy)")


def check_engine_folder(folder: str | Path) -> dict[str, Any]:
    """The folder's engine.json, after checking that the folder holds what that backend loads."""
    from server.backends import read_engine_file

    folder = Path(folder)
    try:
        spec = read_engine_file(folder)
    except (FileNotFoundError, ValueError) as e:
        raise EngineFolderError(str(e)) from None
    model = folder / str(spec.get("model_dir", "model"))
    _check_model_folder(model, spec["backend"] == "embedded")
    if spec["backend"] == "embedded" and spec.get("cpu_model_dir"):  # the weights a CPU serves (cpu_quantization)
        _check_model_folder(folder / str(spec["cpu_model_dir"]), True)
    if spec["backend"] == "embedded" and spec.get("drafter_dir"):  # the ReDrafter head
        drafter = folder / spec["drafter_dir"]
        for name in ("config.json", "model.safetensors"):
            if not (drafter / name).is_file():
                raise EngineFolderError(f"{drafter / name}: missing (the engine's drafter; copy the whole build "
                                        "folder)")
        _check_json(drafter / "config.json")
        check_safetensors(drafter / "model.safetensors")
    if spec["backend"] == "trtllm":
        trt = folder / str(spec.get("engine_dir", "engine"))
        if not (trt / "config.json").is_file():
            raise EngineFolderError(f"{trt / 'config.json'}: missing (the TensorRT engine folder is incomplete)")
        tp = int((spec.get("limits") or {}).get("tp_size", 1))
        for rank in range(tp):
            plan = trt / f"rank{rank}.engine"
            if not plan.is_file() or plan.stat().st_size == 0:
                raise EngineFolderError(f"{plan}: missing or empty (a TensorRT engine per rank, tp_size {tp})")
    return spec
