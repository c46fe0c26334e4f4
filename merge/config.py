"""Translate the recipe's merge section into a mergekit configuration (plain data, YAML-ready)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aimo_spec.recipe import MergeSpec


def mergekit_config(spec: MergeSpec, source_dirs: dict[str, Path]) -> dict[str, Any]:
    """A `merge_method: linear` config. `base_model` is set so the tokenizer donor is deterministic."""
    return {
        "merge_method": spec.method,
        "base_model": str(source_dirs[spec.base_model]),
        "models": [
            {"model": str(source_dirs[name]), "parameters": {"weight": float(w)}}
            for name, w in spec.weights.items()
        ],
        "parameters": {"normalize": spec.normalize},
        "dtype": spec.dtype,
    }


def effective_weights(spec: MergeSpec) -> dict[str, float]:
    """The coefficients mergekit applies: normalised to sum 1 when `normalize` is on."""
    total = sum(spec.weights.values()) if spec.normalize else 1.0
    return {k: w / total for k, w in spec.weights.items()}
