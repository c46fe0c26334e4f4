"""Shared by the Kaggle runner tests (test_kaggle.py: predict; test_kaggle_package.py: `make kaggle`):
an engine folder like build/embedded/, with or without the tiny model, and the serving settings they run with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from small_recipes import write_recipe

from aimo_spec.recipe import ServingSpec, load_recipe, parse_section
from trtbuild.build import engine_config

ROOT = Path(__file__).resolve().parents[1]


def serving_spec(**serving) -> ServingSpec:
    """The serving settings these tests run with: short replies, two samples, a short budget."""
    data = {"sampling": {"max_tokens": 24}, "solver": {"samples": 2, "early_stop_first": 2, "early_stop_agree": 2,
                                                       "enough_finished": 2, "vote": "majority"},
            "budget": {"policy": "aimo2", "base_seconds": 20, "max_extra_seconds": 10}, **serving}
    return parse_section(data, ServingSpec, "serving", "<test>")


def engine_folder(tmp_path: Path, tiny_models=None) -> Path:
    """An engine folder like build/embedded/: engine.json (+ the tiny model when given)."""
    sources = {"cot": {"kind": "hf", "path": str(tiny_models["llama-cot"]) if tiny_models else "a"},
               "tir": {"kind": "hf", "path": str(tiny_models["llama-tir"]) if tiny_models else "b"}}
    recipe = load_recipe(write_recipe(tmp_path, "kg", sources), check_paths=False)
    out = tmp_path / "engine"
    out.mkdir()
    (out / "engine.json").write_text(json.dumps(engine_config(recipe, "embedded")))
    if tiny_models:
        shutil.copytree(tiny_models["llama-tir"], out / "model")
    return out
