"""Test helper: recipes sized for tests (the tiny checkpoints come from `trtbuild.tiny_model`)."""

from __future__ import annotations

from pathlib import Path

import yaml

__all__ = ["write_recipe"]

def write_recipe(folder: Path, name: str, sources: dict, **sections) -> Path:
    """A recipe sized for tests (few prompts, short replies, small calibration)."""
    data = {
        "name": name,
        "sources": sources,
        "merge": {"weights": {"cot": 0.3, "tir": 0.7}, "base_model": "tir", "check_tensors": 8},
        "quantize": {"formats": ["int8_wo", "fp8"], "calibration": {"size": 8, "max_length": 96}},
        "quality": {"prompts": 4, "max_new_tokens": 12},
        "build": {"quantization": "int8_wo", "max_batch_size": 4, "max_input_len": 256, "max_seq_len": 512,
                  "max_num_tokens": 1024},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) and k != "sources" else v
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
