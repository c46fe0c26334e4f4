"""Serving settings have one home, the recipe: `serving_settings` resolves them (recipe, then the
environment, then flags) for every surface, the embedded engine takes them from there, an engine
folder holds only what the build decided, and editing them changes no build fingerprint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from small_recipes import write_recipe

from aimo_spec.recipe import ServingSpec, SpeculativeSpec, load_recipe
from server.embedded.settings import DETERMINISTIC_ENV, DEVICE_ENV, SPECULATIVE_ENV, engine_options, serving_settings
from trtbuild import stages
from trtbuild.build import engine_config

SOURCES = {"cot": {"kind": "hf", "path": "a"}, "tir": {"kind": "hf", "path": "b"}}


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    for name in (DEVICE_ENV, SPECULATIVE_ENV, DETERMINISTIC_ENV):
        monkeypatch.delenv(name, raising=False)


def recipe(tmp_path: Path, name: str = "set", **sections):
    return load_recipe(write_recipe(tmp_path, name, SOURCES, **sections), check_paths=False)


def edited(base, tmp_path: Path, **sections):
    """`base` with its sections edited, as if its file had been (the same folder, so the same sources)."""
    folder = tmp_path / "edited"
    folder.mkdir(exist_ok=True)
    return dataclasses.replace(recipe(folder, base.name, **sections), path=base.path)


def engine_folder(tmp_path: Path, drafter: bool = False, stale_serving: dict | None = None) -> Path:
    """build/embedded/ as the build writes it (with a drafter when asked); `stale_serving`: the copy
    folders built before this change carry in engine.json."""
    sections = {"drafter": {"kind": "redrafter", "num_beams": 2, "draft_len_per_beam": 2}} if drafter else {}
    folder = tmp_path / "engine"
    folder.mkdir()
    spec = engine_config(recipe(tmp_path, **sections), "embedded", "drafter" if drafter else None)
    if stale_serving is not None:
        spec["serving"] = stale_serving
    (folder / "engine.json").write_text(json.dumps(spec))
    return folder


def test_the_recipe_then_the_environment_then_the_flags(tmp_path, monkeypatch):
    r = recipe(tmp_path, serving={"device": "cpu", "deterministic": True, "sampling": {"temperature": 0.3},
                                  "speculative": {"enabled": "off", "max_batch": 3}})
    assert serving_settings(r) == r.serving  # nothing overridden: the recipe's section as it is
    assert serving_settings() == ServingSpec()  # no recipe: the defaults
    monkeypatch.setenv(DEVICE_ENV, "cuda:1")
    monkeypatch.setenv(SPECULATIVE_ENV, "auto")
    monkeypatch.setenv(DETERMINISTIC_ENV, "0")
    s = serving_settings(r)
    assert (s.device, s.speculative.enabled, s.deterministic) == ("cuda:1", "auto", False)
    assert s.speculative.max_batch == 3 and s.sampling.temperature == 0.3  # the rest is the recipe's
    s = serving_settings(r, device="cpu", speculative="on", deterministic=True)
    assert (s.device, s.speculative.enabled, s.deterministic) == ("cpu", "on", True)
    assert serving_settings(r.serving) == serving_settings(r)  # a section read elsewhere (Kaggle) resolves alike


@pytest.mark.parametrize("name,value,words", [(SPECULATIVE_ENV, "sometimes", "not auto, on or off"),
                                              (DETERMINISTIC_ENV, "yes", "EMBEDDED_DETERMINISTIC='yes'")])
def test_a_bad_override_is_named(monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=words):
        serving_settings()


def test_the_engine_runs_with_the_serving_settings_not_a_stale_copy_in_the_folder(tmp_path):
    folder = engine_folder(tmp_path, drafter=True, stale_serving={"device": "cuda:7", "deterministic": True,
                                                                  "speculative": {"enabled": "off"}})
    model_dir, kw = engine_options(folder, {"serving": ServingSpec(device="cpu")})
    assert model_dir == folder / "model" and kw["device"] == "cpu" and kw["deterministic"] is False
    assert kw["drafter"] == folder / "drafter" and kw["speculative"].num_beams == 2  # the build's drafter shape
    assert (kw["max_batch_size"], kw["max_seq_len"], kw["max_input_len"]) == (4, 512, 256)  # the build's limits
    _, kw = engine_options(folder, {"serving": ServingSpec(device="cpu", deterministic=True, kv_cache_dtype="fp8",
                                                           speculative=SpeculativeSpec(enabled="off"))})
    assert kw["deterministic"] is True and "drafter" not in kw and kw["kv_cache_dtype"] == "fp8"


def test_without_a_recipe_the_defaults_under_the_environment(tmp_path, monkeypatch):
    folder = engine_folder(tmp_path, stale_serving={"device": "cuda:7"})
    _, kw = engine_options(folder, {})
    assert kw["device"] == "auto" and kw["deterministic"] is False
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    plain = {"device": "cpu", "deterministic": False, "kv_cache_dtype": "auto"}
    assert engine_options(hf, {}) == (hf, plain)
    assert engine_options(hf, {"device": "auto", "threads": 1})[1] == {**plain, "device": "auto",
                                                                       "threads": 1}  # a keyword wins


def test_keywords_win_over_the_serving_settings(tmp_path):
    folder = engine_folder(tmp_path, drafter=True)
    off = ServingSpec(speculative=SpeculativeSpec(enabled="off", max_batch=2))
    _, kw = engine_options(folder, {"serving": off, "speculative": "on", "speculative_max_batch": 9})
    assert kw["speculative"].max_batch == 9 and "speculative_max_batch" not in kw
    _, kw = engine_options(folder, {"serving": ServingSpec(speculative=SpeculativeSpec(enabled="auto", max_batch=2))})
    assert kw["speculative"].max_batch == 2


def test_the_engine_folder_holds_only_what_the_build_decided(tmp_path):
    spec = engine_config(recipe(tmp_path, serving={"device": "cpu"}), "embedded")
    assert "serving" not in spec
    assert set(spec) == {"format_version", "model", "backend", "quantization", "model_dir", "limits", "drafter"}


@pytest.mark.parametrize("edit", [
    {"sampling": {"temperature": 0.1, "top_p": 0.5, "max_tokens": 99}},
    {"solver": {"vote": "local_entropy", "samples": 4, "early_stop_first": 3, "early_stop_agree": 2,
                "enough_finished": 3, "modulus": 1000}},
    {"budget": {"policy": "fixed", "base_seconds": 12.5}},
    {"device": "cpu", "deterministic": True, "kv_cache_dtype": "fp8",
     "speculative": {"enabled": "off", "max_batch": 4}},
    {"max_code_calls": 9, "output_chars": 200, "tool": {"wall_seconds": 3, "stateful": False}},
], ids=["sampling", "votes", "budget", "engine modes", "tools"])
def test_editing_serving_settings_changes_no_build_fingerprint(tmp_path, edit):
    before = recipe(tmp_path)
    after = edited(before, tmp_path, serving=edit)
    assert after.serving != before.serving
    for backend in ("embedded", "trtllm"):
        assert stages.fingerprint(after, "build", backend) == stages.fingerprint(before, "build", backend), backend
    for name in ("sources", "merge", "quantize"):
        assert stages.fingerprint(after, name) == stages.fingerprint(before, name), name


def test_the_build_fingerprint_follows_what_the_build_reads(tmp_path):
    base = recipe(tmp_path)

    def fp(backend: str, **sections) -> str:
        return stages.fingerprint(edited(base, tmp_path, **sections), "build", backend)

    assert fp("embedded", build={"max_batch_size": 8}) != stages.fingerprint(base, "build", "embedded")
    prompt = {"system_prompt": "Reason, then box the answer."}  # TensorRT-LLM's calibration set is rendered with it
    assert fp("trtllm", serving=prompt) != stages.fingerprint(base, "build", "trtllm")
    assert fp("embedded", serving=prompt) == stages.fingerprint(base, "build", "embedded")


def test_a_kv_cache_dtype_outside_the_schema_is_named(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        recipe(tmp_path, serving={"kv_cache_dtype": "int4"})
