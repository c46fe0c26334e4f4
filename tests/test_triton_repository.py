"""Contract tests of the tensorrtllm_backend model repository and launch command (no Triton needed).

The templates here are a test double of tensorrtllm_backend v1.2.x's `all_models/inflight_batcher_llm`
written from the upstream snapshot (every placeholder of the upstream templates, in the same kind of
position: tests/triton_double.py); the checks pin what the generated config.pbtxt files say for an
engine built from the recipe, and that nothing is left unfilled that Triton could not parse.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from triton_double import write_templates
from upstream import snapshot

from server.triton import repository
from server.triton.repository import MODELS, launch_command, make_repository


def templates(tmp_path: Path, drop: tuple[str, str] | None = None, **extra) -> Path:
    return write_templates(tmp_path, drop, **extra)


def engine(tmp_path: Path, drafter: bool = False, devices=None) -> Path:
    d = tmp_path / "build" / "trtllm"
    (d / "engine").mkdir(parents=True)
    (d / "model").mkdir()
    spec = {"backend": "trtllm", "engine_dir": "engine", "model_dir": "model",
            "limits": {"max_batch_size": 32, "max_input_len": 30000, "max_seq_len": 32000, "max_num_tokens": 32000,
                       "tp_size": 2},
            "drafter": {"kind": "redrafter", "num_beams": 1, "draft_len_per_beam": 3} if drafter else None,
            "trtllm": {"kv_cache_free_gpu_mem_fraction": 0.85, "enable_kv_cache_reuse": True,
                       "enable_chunked_context": True, "max_queue_delay_microseconds": 100,
                       "gpu_device_ids": devices}}
    (d / "engine.json").write_text(json.dumps(spec))
    return d


def params(config: str) -> dict[str, str]:
    """Parameter values, and the double's bare settings (`setting_<key>: value`), by placeholder name."""
    out = {}
    for line in config.splitlines():
        if line.startswith("setting_"):
            key, value = line[len("setting_"):].split(": ", 1)
            out[key] = value
        if line.startswith("parameters"):
            key = line.split('key: "')[1].split('"')[0]
            out[key] = line.split('string_value: "')[1].split('"')[0]
    return out


def test_repository_for_a_redrafter_tp2_engine(tmp_path):
    eng = engine(tmp_path, drafter=True, devices=[0, 1])
    out = tmp_path / "repo"
    report = make_repository(eng, out, templates(tmp_path))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(MODELS)
    trt = params((out / "tensorrt_llm" / "config.pbtxt").read_text())
    assert trt["triton_backend"] == "tensorrtllm" and trt["decoupled_mode"] == "true"
    assert trt["batching_strategy"] == "inflight_fused_batching" and trt["triton_max_batch_size"] == "32"
    assert trt["engine_dir"] == str((eng / "engine").resolve())
    assert trt["kv_cache_free_gpu_mem_fraction"] == "0.85" and trt["enable_kv_cache_reuse"] == "true"
    assert trt["enable_chunked_context"] == "true" and trt["exclude_input_in_output"] == "true"
    assert trt["max_queue_delay_microseconds"] == "100" and trt["decoding_mode"] == "redrafter"
    assert trt["gpu_device_ids"] == "0,1" and trt["max_beam_width"] == "1"
    assert 'name: "draft_logits" data_type: TYPE_FP32' in (out / "tensorrt_llm" / "config.pbtxt").read_text()
    assert trt["max_tokens_in_paged_kv_cache"] == "${max_tokens_in_paged_kv_cache}"  # the backend's default
    for model in ("preprocessing", "postprocessing"):
        p = params((out / model / "config.pbtxt").read_text())
        assert p["tokenizer_dir"] == str((eng / "model").resolve()) and p["triton_max_batch_size"] == "32"
    assert params((out / "preprocessing" / "config.pbtxt").read_text())["add_special_tokens"] == "false"
    bls = params((out / "tensorrt_llm_bls" / "config.pbtxt").read_text())
    assert bls["decoupled_mode"] == "true" and bls["tensorrt_llm_model_name"] == "tensorrt_llm"
    assert (out / "preprocessing" / "1" / "model.py").is_file()  # the backend's own model code is kept
    assert "max_tokens_in_paged_kv_cache" in report["models"]["tensorrt_llm"]["backend_defaults"]
    assert json.loads((out / "repository.json").read_text())["models"]["tensorrt_llm"]["filled"]["engine_dir"]


def test_plain_engine_leaves_decoding_mode_and_devices_to_the_backend(tmp_path):
    out = tmp_path / "repo"
    make_repository(engine(tmp_path), out, templates(tmp_path))
    trt = params((out / "tensorrt_llm" / "config.pbtxt").read_text())
    assert trt["decoding_mode"] == "${decoding_mode}" and trt["gpu_device_ids"] == "${gpu_device_ids}"


def test_templates_of_another_version_fail_loudly(tmp_path):
    with pytest.raises(ValueError, match="no placeholder for engine_dir"):
        make_repository(engine(tmp_path), tmp_path / "repo", templates(tmp_path, drop=("tensorrt_llm", "engine_dir")))


def test_embedded_engines_are_refused_with_the_right_command(tmp_path):
    d = tmp_path / "build" / "embedded"
    d.mkdir(parents=True)
    (d / "engine.json").write_text(json.dumps({"backend": "embedded", "limits": {}}))
    with pytest.raises(ValueError, match="make triton"):
        make_repository(d, tmp_path / "repo", templates(tmp_path))


def test_launch_command_one_gpu_and_tensor_parallel(tmp_path):
    repo = tmp_path / "repo"
    one = launch_command(repo, 1, 9001, 9000, 9002)
    assert one == ["tritonserver", f"--model-repository={repo}", "--disable-auto-complete-config",
                   "--backend-config=python,shm-region-prefix-name=prefix0_", "--grpc-port=9001", "--http-port=9000",
                   "--metrics-port=9002"]
    two = launch_command(repo, 2)
    assert two[:4] == ["mpirun", "--allow-run-as-root", "-n", "1"] and two.count(":") == 1
    rank1 = two[two.index(":") + 1:]
    assert rank1[:3] == ["-n", "1", "tritonserver"] and "--load-model=tensorrt_llm" in rank1
    assert "--allow-grpc=false" in rank1 and "--backend-config=python,shm-region-prefix-name=prefix1_" in rank1


def test_deploy_without_a_trtllm_engine_says_what_to_build(tiny_models, tmp_path, capsys):
    from small_recipes import write_recipe

    from server.programs.triton_deploy import main

    recipe = write_recipe(tmp_path, "nobuild", {"cot": {"kind": "hf", "path": str(tiny_models["llama-cot"])},
                                                "tir": {"kind": "hf", "path": str(tiny_models["llama-tir"])}})
    assert main(["--recipe", str(recipe), "--out", str(tmp_path / "repo")]) == 2
    assert "make engine MODEL=nobuild BACKEND=trtllm" in capsys.readouterr().err


# ------------------------------------------------------------------ issue 17: what upstream's templates need
def test_fill_template_defaults_are_upstreams():
    """tools/fill_template.py fills these in every template unless told otherwise."""
    assert getattr(repository, 'FILL_TEMPLATE_DEFAULTS', None) == {
        k: str(v) for k, v in snapshot()["triton"]["fill_template_defaults"].items()}


def filled(tmp_path: Path, model: str) -> tuple[str, dict]:
    out = tmp_path / "repo"
    report = make_repository(engine(tmp_path), out, templates(tmp_path))
    return (out / model / "config.pbtxt").read_text(), report["models"][model]


def no_bare_placeholders(model: str, text: str) -> None:
    bare = [k for k in snapshot()["triton"]["templates"][model]["bare_placeholders"] if f"${{{k}}}" in text]
    assert bare == [], f"{model}: {bare} left unfilled outside a string: Triton cannot parse the file"


def test_item1_tensorrt_llm_queue_policy_is_filled(tmp_path):
    text, report = filled(tmp_path, "tensorrt_llm")
    no_bare_placeholders("tensorrt_llm", text)
    trt = params(text)
    assert trt["max_queue_size"] == "0" and trt["max_queue_delay_microseconds"] == "100"
    assert set(report["backend_defaults"]) <= getattr(repository, 'BACKEND_DEFAULTS', {}).get("tensorrt_llm", set())


def test_item2_preprocessing_dynamic_batching_is_filled(tmp_path):
    text, _ = filled(tmp_path, "preprocessing")
    no_bare_placeholders("preprocessing", text)
    pre = params(text)
    assert pre["max_queue_size"] == "0" and pre["max_queue_delay_microseconds"] == "100"


def test_item3_tensorrt_llm_prompt_embedding_table_type_is_filled(tmp_path):
    assert "prompt_embedding_table_data_type" in snapshot()["triton"]["docs_fill_keys"]["tensorrt_llm"]
    text, _ = filled(tmp_path, "tensorrt_llm")
    assert 'name: "prompt_embedding_table" data_type: TYPE_FP16' in text


def test_no_model_keeps_a_placeholder_triton_cannot_parse(tmp_path):
    out = tmp_path / "repo"
    make_repository(engine(tmp_path), out, templates(tmp_path))
    for model in MODELS:
        no_bare_placeholders(model, (out / model / "config.pbtxt").read_text())


def test_every_upstream_string_placeholder_is_filled_or_a_known_backend_default(tmp_path):
    """A new upstream parameter must be classified here before deploying with those templates."""
    from server.triton.repository import values

    spec = json.loads((engine(tmp_path, drafter=True, devices=[0]) / "engine.json").read_text())
    vals = values(tmp_path / "build" / "trtllm", spec)
    for model, facts in snapshot()["triton"]["templates"].items():
        quoted = set(facts["placeholders"]) - set(facts["bare_placeholders"])
        unclassified = quoted - set(vals[model]) - getattr(repository, 'BACKEND_DEFAULTS', {}).get(model, set())
        assert not unclassified, f"{model}: {sorted(unclassified)}"
        assert set(facts["bare_placeholders"]) <= set(vals[model]), model


@pytest.mark.parametrize("extra", [dict(extra_bare=("preprocessing", "max_new_queue_knob")),
                                   dict(extra_quoted=("tensorrt_llm", "new_parameter"))])
def test_a_placeholder_the_toolkit_does_not_know_fails_naming_file_and_key(tmp_path, extra):
    model, key = next(iter(extra.values()))
    with pytest.raises(ValueError, match=rf"{model}/config.pbtxt: .*\$\{{{key}\}}"):
        make_repository(engine(tmp_path), tmp_path / "repo", templates(tmp_path, **extra))
