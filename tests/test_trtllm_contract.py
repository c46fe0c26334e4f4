"""Contract tests of the TensorRT-LLM 1.2.x build path (no GPU and no TensorRT-LLM here; NOT a GPU run).

The build is run against a test double of the `tensorrt_llm` module (tests/trtllm_double.py) and a
runner that checks every command against the real tools' flags (tests/trtllm_command_double.py):
these tests pin the exact commands, flags, files and calls the toolkit produces for W8A16, FP8,
W8A16 + ReDrafter and tp=2 recipes, the preflight errors, resume, the GPU smoke run's plan and what
upstream source says about quantized drafters. The runtime over the executor is
tests/test_trtllm_runtime_contract.py. What they cannot show (that TensorRT-LLM accepts them and the
engine is right) is what `make gpu-smoke` checks on a GPU host.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import trtllm_double as dbl
from trtllm_command_double import FakeRunner, drafter_modules
from trtllm_contract_kit import A100, H100, PY, drafter_folder, examples, flags, gpu_env, project  # noqa: F401
from upstream import snapshot

from aimo_spec.recipe import RecipeError
from trtbuild import build as build_stage
from trtbuild import manifest as mf
from trtbuild.trtllm.env import parse_nvidia_smi


# ------------------------------------------------------------------ build: commands and calls
def test_w8a16_converts_in_process_and_builds_with_the_aimo2_flags(project, examples):
    recipe = project()
    runner = FakeRunner()
    out = build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples), runner=runner)
    assert [name for name, _, _ in runner.commands] == ["checkpoint", "engine"]
    _, ckpt, env = runner.commands[0]
    merged = recipe.out_dir / "merge" / "model"
    assert ckpt[:3] == [PY, "-m", "trtbuild.programs.trtllm_convert"]
    assert ckpt[3:] == ["--model_dir", str(merged), "--output_dir", ckpt[6], "--dtype", "bfloat16",
                        "--tp_size", "1", "--quant_algo", "W8A16"]
    assert env["PYTHONPATH"] == str(Path(__file__).resolve().parents[1])
    (name, call), (_, save) = [c for c in dbl.CALLS if c[0].endswith("from_hugging_face") or c[0] == "save_checkpoint"]
    assert name == "QWenForCausalLM.from_hugging_face"
    assert call["hf_model_or_dir"] == str(merged) and call["dtype"] == "bfloat16"
    assert call["quant_config"].quant_algo == dbl.QuantAlgo.W8A16
    assert (call["mapping"].world_size, call["mapping"].rank, call["mapping"].tp_size) == (1, 0, 1)
    assert save["save_config"] is True
    _, eng, _ = runner.commands[1]
    assert eng[0] == "trtllm-build"
    assert flags(eng, 1) == {
        "--checkpoint_dir": str(recipe.out_dir / "trtllm" / "checkpoint"), "--output_dir": str(eng[4]),
        "--gemm_plugin": "bfloat16", "--use_paged_context_fmha": "enable", "--kv_cache_type": "paged",
        "--max_batch_size": "4", "--max_seq_len": "512", "--max_input_len": "256", "--max_num_tokens": "1024",
        "--max_beam_width": "1", "--workers": "1"}
    spec = json.loads((out / "engine.json").read_text())
    assert spec["backend"] == "trtllm" and spec["engine_dir"] == "engine" and spec["drafter"] is None
    assert spec["trtllm"]["enable_kv_cache_reuse"] is True
    assert (out / "engine" / "config.json").is_file() and (out / "engine" / "rank0.engine").is_file()
    assert (out / "model" / "tokenizer.json").is_file() and not list((out / "model").glob("*.safetensors"))
    m = mf.read_manifest(out)
    assert [s["step"] for s in m["steps"]] == ["checkpoint", "engine"] and m["steps"][1]["command"] == eng
    ckpt_manifest = mf.read_manifest(recipe.out_dir / "trtllm" / "checkpoint")
    assert ckpt_manifest["command"][:3] == ckpt[:3]


def test_fp8_calibrates_with_quantize_py_on_the_recipes_tir_traces(project, examples):
    recipe = project(build={"quantization": "fp8"}, trtllm={"calib_size": 6})
    runner = FakeRunner()
    build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples), runner=runner)
    _, q, _ = runner.commands[0]
    assert q[:2] == [PY, str(examples / "quantization" / "quantize.py")]
    calib = recipe.out_dir / "trtllm" / "calibration"
    f = flags(q, 2)
    assert {k: v for k, v in f.items() if k != "--output_dir"} == {
        "--model_dir": str(recipe.out_dir / "merge" / "model"), "--dtype": "bfloat16", "--qformat": "fp8",
        "--calib_dataset": str(calib), "--calib_size": "6", "--calib_max_seq_length": "96", "--batch_size": "1",
        "--tp_size": "1", "--seed": "1"}
    rows = [json.loads(line) for line in (calib / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(set(r) == {"text"} for r in rows)
    assert rows[0]["text"].startswith("<|im_start|>user\n") and "```python\n" in rows[0]["text"]
    assert "```output\n" in rows[0]["text"] and "\\boxed{" in rows[0]["text"]
    _, eng, _ = runner.commands[1]
    assert flags(eng, 1)["--gemm_plugin"] == "fp8"


def test_fp8_kv_cache_adds_the_flag_and_int8_weights_use_quantize_py_too(project, examples):
    recipe = project(quantize={"kv_cache_dtype": "fp8"})
    runner = FakeRunner()
    build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples), runner=runner)
    f = flags(runner.commands[0][1], 2)
    assert f["--qformat"] == "int8_wo" and f["--kv_cache_dtype"] == "fp8"


def test_fp8_from_the_modelopt_export_skips_calibration(project, examples):
    recipe = project(build={"quantization": "fp8"}, trtllm={"fp8_checkpoint": "modelopt_export"})
    runner = FakeRunner()
    build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(None), runner=runner)  # needs no examples/
    assert [n for n, _, _ in runner.commands] == ["engine"]
    assert flags(runner.commands[0][1], 1)["--checkpoint_dir"] == str(recipe.out_dir / "quantize" / "fp8" / "trtllm")


def test_w8a16_with_redrafter_attaches_the_drafter_then_builds_explicit_draft_tokens(project, examples, tmp_path):
    d = drafter_folder(tmp_path)
    recipe = project(drafter={"kind": "redrafter", "path": str(d), "num_beams": 1, "draft_len_per_beam": 3})
    runner = FakeRunner()
    out = build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples), runner=runner)
    assert [n for n, _, _ in runner.commands] == ["checkpoint", "redrafter", "engine"]
    _, rd, _ = runner.commands[1]
    assert rd[:2] == [PY, str(examples / "redrafter" / "convert_checkpoint.py")]
    f = flags(rd, 2)
    assert {k: v for k, v in f.items() if k != "--output_dir"} == {
        "--base_model_checkpoint_dir": str(recipe.out_dir / "trtllm" / "checkpoint"), "--drafter_model_dir": str(d),
        "--dtype": "bfloat16", "--tp_size": "1", "--redrafter_num_beams": "1", "--redrafter_draft_len_per_beam": "3"}
    e = flags(runner.commands[2][1], 1)
    assert e["--speculative_decoding_mode"] == "explicit_draft_tokens"
    assert e["--checkpoint_dir"] == str(recipe.out_dir / "trtllm" / "redrafter")
    assert json.loads((out / "engine.json").read_text())["drafter"]["draft_len_per_beam"] == 3


def test_sampled_drafting_passes_no_greedy_search(project, examples, tmp_path):
    recipe = project(drafter={"kind": "redrafter", "path": str(drafter_folder(tmp_path)), "greedy": False})
    runner = FakeRunner()
    build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples), runner=runner)
    assert "--redrafter_no_greedy_search" in runner.commands[1][1]


def test_tp2_converts_each_rank_and_builds_with_two_workers(project, examples):
    recipe = project(build={"tp_size": 2})
    runner = FakeRunner()
    out = build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples, (H100, H100)), runner=runner)
    convert = [c for c in dbl.CALLS if c[0].endswith("from_hugging_face")]
    assert [(c["mapping"].rank, c["mapping"].tp_size, c["mapping"].world_size)
            for _, c in convert] == [(0, 2, 2), (1, 2, 2)]
    assert [c["save_config"] for n, c in dbl.CALLS if n == "save_checkpoint"] == [True, False]
    ckpt_cmd = runner.commands[0][1]
    assert ckpt_cmd[ckpt_cmd.index("--tp_size") + 1] == "2"
    assert flags(runner.commands[1][1], 1)["--workers"] == "2"
    assert (out / "engine" / "rank1.engine").is_file()
    ckpt = recipe.out_dir / "trtllm" / "checkpoint"
    assert (ckpt / "rank0.safetensors").is_file() and (ckpt / "rank1.safetensors").is_file()


# ------------------------------------------------------------------ preflight: before any GPU work
@pytest.mark.parametrize("sections, gpus, key, words", [
    (dict(build={"quantization": "fp8"}), (A100,), "build.quantization", "SM 80"),
    (dict(quantize={"kv_cache_dtype": "fp8"}), (A100,), "quantize.kv_cache_dtype", "8.9"),
    (dict(build={"tp_size": 3}), (H100, H100, H100), "build.tp_size", "num_attention_heads (4)"),
    (dict(build={"tp_size": 2}), (H100,), "build.tp_size", "needs 2 GPUs"),
    (dict(drafter={"kind": "redrafter", "draft_len_per_beam": 4}), (H100,), "drafter.draft_len_per_beam",
     "trained for 3"),
    (dict(drafter={"kind": "redrafter", "draft_len_per_beam": 2, "path": "missing"}), (H100,), "drafter.path",
     "no such folder"),
])
def test_bad_recipes_fail_before_any_gpu_work(project, examples, tmp_path, sections, gpus, key, words):
    if sections.get("drafter", {}).get("path") is None and "drafter" in sections:
        sections["drafter"]["path"] = str(drafter_folder(tmp_path))
    runner = FakeRunner()
    with pytest.raises(RecipeError) as err:
        recipe = project(**sections)
        build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples, gpus), runner=runner)
    msg = str(err.value)
    assert f": {key}: " in msg and words in msg and "trt.yaml" in msg, msg
    assert runner.commands == [] and not dbl.Executor.instances


def test_fp8_without_the_examples_folder_names_the_setting(project):
    recipe = project(build={"quantization": "fp8"})
    with pytest.raises(RecipeError, match="TRTLLM_EXAMPLES"):
        build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(None), runner=FakeRunner())


def test_a_failed_engine_build_keeps_the_checkpoint_and_resumes(project, examples):
    recipe = project()
    env = gpu_env(examples)
    with pytest.raises(RuntimeError, match="trtllm engine step failed"):
        build_stage.run(recipe, "trtllm", trtllm_env=env, runner=FakeRunner(fail_step="engine"))
    assert mf.read_manifest(recipe.out_dir / "trtllm" / "checkpoint")["status"] == "done"
    assert not (recipe.out_dir / "build" / "trtllm").exists()
    runner = FakeRunner()
    build_stage.run(recipe, "trtllm", trtllm_env=env, runner=runner)
    assert [n for n, _, _ in runner.commands] == ["engine"]
    again = FakeRunner()
    build_stage.run(recipe, "trtllm", trtllm_env=env, runner=again)
    assert again.commands == []  # nothing changed: no work


def test_nvidia_smi_parsing_and_the_fp8_capability():
    gpus = parse_nvidia_smi("0, NVIDIA H200, 9.0, 143771\n1, NVIDIA L4, 8.9, 23034\n2, Tesla T4, 7.5, 15360\n")
    assert [(g.index, g.sm, g.supports_fp8) for g in gpus] == [(0, 90, True), (1, 89, True), (2, 75, False)]


def test_doctor_says_why_trtllm_is_not_usable_here(capsys):
    from trtbuild.__main__ import main

    root = Path(__file__).resolve().parents[1]
    rc = main(["doctor", "--recipe", str(root / "engines" / "mix.yaml")])
    out = capsys.readouterr().out
    assert rc == 0 and "embedded   yes" in out
    assert "trtllm     no" in out and "TensorRT-LLM is not installed" in out


def test_mpirun_launch_for_tensor_parallel():
    from server.programs.trtllm_launch import mpirun_command

    assert mpirun_command(1, ["python", "-m", "server.programs.solve"]) == ["python", "-m", "server.programs.solve"]
    assert mpirun_command(2, ["python", "x"], as_root=True) == [
        "mpirun", "-n", "2", "--allow-run-as-root", "--oversubscribe", "python", "x"]


def test_gpu_smoke_builds_bf16_and_fp8_and_checks_streaming_and_cancel(examples, tmp_path, monkeypatch):
    """The smoke run's plan and checks, against the double (its token checks need the real GPU)."""
    from trtbuild.programs import gpu_smoke as smoke

    dbl.install(monkeypatch)
    dbl.Executor.script = staticmethod(lambda p: [7] * 500)
    dbl.Executor.step_seconds = 0.001
    runner = FakeRunner()
    report = smoke.run(tmp_path / "smoke", env=gpu_env(examples), runner=runner, compare_hf=False)
    assert [n for n, _, _ in runner.commands] == ["checkpoint", "engine", "checkpoint", "engine"]
    assert runner.commands[0][1][-1] == "none"  # bf16: convert without quantization
    assert flags(runner.commands[2][1], 2)["--qformat"] == "fp8"
    assert report["tokens_ok"] and report["stream_ok"] and report["cancel_ok"] and report["passed"]
    assert report["fp8_vs_bf16_agreement"] == 1.0 and report["stream_finals"] == 1
    cfg = [c for n, c in dbl.CALLS if n == "Request"]
    assert all(c["end_id"] == -1 for c in cfg)  # ignore_eos: fixed-length replies


def test_gpu_smoke_refuses_clearly_without_tensorrt_llm(tmp_path, capsys):
    from trtbuild.programs import gpu_smoke as smoke

    assert smoke.main(["--out", str(tmp_path)]) == 2
    assert "gpu-smoke needs a usable TensorRT-LLM" in capsys.readouterr().err


@pytest.mark.parametrize("packages, words", [
    ({"tensorrt-llm": "1.3.0rc1"}, "targets 1.2.x"),
    ({"numpy": "1.26.4"}, "TensorRT-LLM is not installed in"),
])
def test_probe_reads_the_trtllm_environment_without_importing_it(tmp_path, monkeypatch, packages, words):
    from trtbuild.trtllm import env as trtenv

    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\necho '{json.dumps(packages)}'\n")
    fake_python.chmod(0o755)
    monkeypatch.setenv(trtenv.PYTHON_ENV, str(fake_python))
    env = trtenv.probe()
    assert env.python == str(fake_python) and env.packages == packages
    assert not env.usable and words in env.summary() and "nvidia-smi" in env.summary()


def test_the_trained_drafter_is_attached_by_default(project, examples, tmp_path):
    """drafter.kind redrafter without a path: the drafter stage's output (engines/<m>/drafter/model)."""
    recipe = project(drafter={"kind": "redrafter"})
    trained = recipe.out_dir / "drafter" / "model"
    trained.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(drafter_folder(tmp_path), trained)
    runner = FakeRunner()
    build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples), runner=runner)
    assert flags(runner.commands[1][1], 2)["--drafter_model_dir"] == str(trained)


# ------------------------------------------------------------------ issue 17: what upstream source says
def test_int8_wo_with_redrafter_keeps_the_drafter_out_of_quantization(project, examples, tmp_path):
    """W8A16 + ReDrafter (engines/mix.yaml): QuantConfig must carry a list, or the converter leaves the
    drafter quantized and trtllm-build stops (snapshot: redrafter, quantization)."""
    from trtbuild.trtllm.convert import DEFAULT_EXCLUDE_MODULES

    up = snapshot()["quantization"]
    assert list(DEFAULT_EXCLUDE_MODULES) == up["default_exclude_modules"]
    recipe = project(drafter={"kind": "redrafter", "path": str(drafter_folder(tmp_path))})
    runner = FakeRunner()
    build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples), runner=runner)
    (_, call), = [c for c in dbl.CALLS if c[0].endswith("from_hugging_face")]
    assert set(up["default_exclude_modules"]) <= set(call["quant_config"].exclude_modules)
    attached = json.loads((recipe.out_dir / "trtllm" / "redrafter" / "config.json").read_text())
    assert set(drafter_modules(2, True)) <= set(attached["quantization"]["exclude_modules"])
    assert [n for n, _, _ in runner.commands] == ["checkpoint", "redrafter", "engine"]


def test_int8_wo_with_fp8_kv_through_quantize_py_also_excludes_the_drafter(project, examples, tmp_path):
    """quantize.py accepts int8_wo with an FP8 KV cache (ModelOpt leaves the weights, the checkpoint says
    W8A16); its exclude_modules may be null, so the build writes the list before ReDrafter."""
    up = snapshot()
    assert "int8_wo" in up["commands"]["quantize.py"]["flags"]["--qformat"]["choices"]
    assert "fp8" in up["commands"]["quantize.py"]["flags"]["--kv_cache_dtype"]["choices"]
    assert up["quantization"]["quantize_py_int8_wo"]["checkpoint_quant_algo"] == "W8A16"
    recipe = project(quantize={"kv_cache_dtype": "fp8"},
                     drafter={"kind": "redrafter", "path": str(drafter_folder(tmp_path))})
    runner = FakeRunner()
    build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples), runner=runner)
    assert flags(runner.commands[0][1], 2)["--qformat"] == "int8_wo"
    ckpt = json.loads((recipe.out_dir / "trtllm" / "checkpoint" / "config.json").read_text())
    assert ckpt["quantization"]["exclude_modules"] == up["quantization"]["default_exclude_modules"]
    assert [n for n, _, _ in runner.commands] == ["checkpoint", "redrafter", "engine"]


def test_a_modelopt_export_without_an_exclusion_list_is_refused_before_redrafter(project, examples, tmp_path):
    recipe = project(build={"quantization": "fp8"}, trtllm={"fp8_checkpoint": "modelopt_export"},
                     drafter={"kind": "redrafter", "path": str(drafter_folder(tmp_path))})
    runner = FakeRunner()
    with pytest.raises(RuntimeError, match="exclude_modules is null"):
        build_stage.run(recipe, "trtllm", trtllm_env=gpu_env(examples), runner=runner)
    assert runner.commands == []
