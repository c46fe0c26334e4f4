"""The whole `make engine` pipeline on tiny random models: real mergekit, real ModelOpt, real runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from small_recipes import write_recipe

from aimo_spec.recipe import load_recipe
from trtbuild import manifest as mf
from trtbuild.__main__ import main

STAGE_DIRS = ["sources/cot", "sources/tir", "merge", "quantize/int8_wo", "quantize/fp8", "build/embedded"]


def _finished(out: Path) -> dict[str, str]:
    return {d: mf.read_manifest(out / d)["finished_at"] + mf.read_manifest(out / d)["fingerprint"]
            for d in STAGE_DIRS if mf.read_manifest(out / d)}


@pytest.fixture(scope="module")
def qwen_build(tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("recipes")
    path = write_recipe(folder, "tinyqwen", {
        "cot": {"kind": "hf", "path": str(tiny_models["qwen-cot"])},
        "tir": {"kind": "hf", "path": str(tiny_models["qwen-tir"])},
    })
    assert main(["engine", "--recipe", str(path), "--backend", "embedded"]) == 0
    return load_recipe(path)


def test_every_stage_writes_a_manifest(qwen_build):
    out = qwen_build.out_dir
    for d in STAGE_DIRS:
        m = mf.read_manifest(out / d)
        assert m and m["status"] == "done" and m["seconds"] >= 0 and m["libraries"]["torch"], d
    merge = mf.read_manifest(out / "merge")
    assert merge["arithmetic_check"]["within_rounding"] and merge["arithmetic_check"]["tensors_checked"] == 8
    assert merge["weights"] == {"cot": 0.3, "tir": 0.7}
    assert set(merge["quality"]) >= {"vs_cot", "vs_tir"}
    assert all(len(v) == 64 for v in merge["inputs"]["cot"]["files"].values())  # sha256 per input file
    for fmt in ("int8_wo", "fp8"):
        q = mf.read_manifest(out / "quantize" / fmt)
        assert q["reload_error"]["max_error_over_bound"] <= 1.0 + 1e-3
        assert 0.0 <= q["quality"]["token_agreement"] <= 1.0 and q["quality"]["kl_mean"] >= 0.0
        assert q["quality"]["positions"] > 0
        assert (out / "quantize" / fmt / "trtllm" / "config.json").is_file()
        assert (out / "quantize" / fmt / "trtllm" / "rank0.safetensors").is_file()
        trt = json.loads((out / "quantize" / fmt / "trtllm" / "config.json").read_text())
        assert trt["quantization"]["quant_algo"] == {"int8_wo": "W8A16", "fp8": "FP8"}[fmt]
        assert trt["mapping"]["tp_size"] == 1


def test_merged_weights_are_the_weighted_sum(qwen_build, tiny_models):
    from safetensors.torch import load_file

    out = qwen_build.out_dir
    merged = load_file(str(out / "merge" / "model" / "model.safetensors"))
    a = load_file(str(tiny_models["qwen-cot"] / "model.safetensors"))
    b = load_file(str(tiny_models["qwen-tir"] / "model.safetensors"))
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias", "lm_head.weight"):
        expected = (0.3 * a[name].float() + 0.7 * b[name].float()).to(torch.bfloat16)
        # fp32 sum then one bf16 rounding; mergekit's fused multiply-add may flip a rare tie
        same = (merged[name] == expected).float().mean().item()
        assert same > 0.99, (name, same)
        assert (merged[name].float() - expected.float()).abs().max() <= expected.float().abs().max() * 2 ** -7


def test_arithmetic_check_catches_a_wrong_tensor(qwen_build, tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from merge.check import check_arithmetic

    out = qwen_build.out_dir
    t = load_file(str(out / "merge" / "model" / "model.safetensors"))
    for k in t:
        t[k] = t[k] * 1.01 if t[k].is_floating_point() else t[k]
    save_file(t, str(tmp_path / "model.safetensors"))
    dirs = {"cot": tiny_models["qwen-cot"], "tir": tiny_models["qwen-tir"]}
    good = check_arithmetic(out / "merge" / "model", dirs, {"cot": 0.3, "tir": 0.7}, n=50)
    bad = check_arithmetic(tmp_path, dirs, {"cot": 0.3, "tir": 0.7}, n=50)
    assert good["within_rounding"] and good["max_error_ulps"] <= 0.5 + 1e-3
    assert not bad["within_rounding"]


def test_quantized_exports_reload_within_rounding(qwen_build):
    from safetensors.torch import load_file

    from aimo_spec.checkpoint import CheckpointTensors
    from server.embedded.loader import load_model
    from trtbuild.quantize import reload_error

    out = qwen_build.out_dir
    original = load_file(str(out / "merge" / "model" / "model.safetensors"))
    for fmt, dtype in (("int8_wo", torch.int8), ("fp8", torch.float8_e4m3fn)):
        exported = load_file(str(out / "quantize" / fmt / "hf" / "model.safetensors"))
        assert exported["model.layers.0.mlp.down_proj.weight"].dtype == dtype
        model = load_model(out / "quantize" / fmt / "hf")
        err = reload_error(original, model)
        assert err["layers"] == 2 * 7 and err["max_error_over_bound"] <= 1.0 + 1e-3
        assert reload_error(CheckpointTensors(out / "merge" / "model"), model) == err  # read a tensor at a time


def test_checkpoint_tensors_read_each_tensor_as_stored(qwen_build, tmp_path):
    from safetensors.torch import load_file, save_file

    from aimo_spec.checkpoint import CheckpointTensors

    merged = qwen_build.out_dir / "merge" / "model"
    whole = load_file(str(merged / "model.safetensors"))
    lazy = CheckpointTensors(merged)
    assert set(lazy) == set(whole) and len(lazy) == len(whole)

    class Counting(CheckpointTensors):
        reads = 0

        def __getitem__(self, name):
            self.reads += 1
            return super().__getitem__(name)

    counting = Counting(merged)
    assert all(k in counting for k in whole) and "no.such.weight" not in counting
    assert counting.reads == 0  # membership from the index: no tensor read to answer it
    assert all(torch.equal(lazy[k], v) and lazy[k].dtype == v.dtype for k, v in whole.items())
    names = sorted(whole)
    save_file({k: whole[k] for k in names[:3]}, str(tmp_path / "a.safetensors"))  # a sharded folder
    save_file({k: whole[k] for k in names[3:5]}, str(tmp_path / "b.safetensors"))
    assert torch.equal(CheckpointTensors(tmp_path)[names[4]], whole[names[4]])
    with pytest.raises(KeyError):
        CheckpointTensors(tmp_path)[names[6]]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        CheckpointTensors(tmp_path / "nothing")


def test_engine_folder_serves_tokens(qwen_build):
    from aimo_spec.chat import load_tokenizer
    from server.embedded.loader import load_model

    engine = qwen_build.out_dir / "build" / "embedded"
    cfg = json.loads((engine / "engine.json").read_text())
    assert cfg["backend"] == "embedded" and cfg["quantization"] == "int8_wo"
    assert cfg["limits"]["max_batch_size"] == 4 and "serving" not in cfg  # the recipe's, not the build's
    model = load_model(engine / cfg["model_dir"])
    tok = load_tokenizer(engine / cfg["model_dir"])
    ids = torch.tensor([tok("What is 2+3?")["input_ids"]])
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5


def test_the_engine_links_the_quantized_weights_instead_of_copying_them(qwen_build):
    engine = qwen_build.out_dir / "build" / "embedded" / "model"
    quantized = qwen_build.layout.weights("int8_wo")
    shared = [p.name for p in quantized.glob("*.safetensors") if (engine / p.name).samefile(p)]
    assert shared and not (engine / "manifest.json").exists()


def test_the_build_prices_the_fp8_kv_cache_and_the_report_shows_it(qwen_build):
    from trtbuild.__main__ import report

    m = json.loads((qwen_build.out_dir / "build" / "embedded" / "manifest.json").read_text())
    price = m["kv_cache_price"]["fp8"]
    assert price["positions"] > 0 and 0 < price["kl_mean"] and 0 < price["token_agreement"] <= 1
    assert price["reply_len_ref"] > 0 and isinstance(m["kv_cache_price"]["flags"], list)
    assert "FP8 KV cache vs model-dtype cache: KL" in report(qwen_build)


def test_second_run_does_no_work(qwen_build, capfd):
    before = _finished(qwen_build.out_dir)
    capfd.readouterr()
    assert main(["engine", "--recipe", str(qwen_build.path), "--backend", "embedded"]) == 0
    err = capfd.readouterr().err
    assert _finished(qwen_build.out_dir) == before
    for stage in ("sources", "merge", "quantize", "build"):
        assert f"[{stage}] " in err and "up to date" in err


def test_serving_edits_rebuild_nothing(qwen_build, capfd):
    """Sampling, votes, budget, device and the engine's modes are the runtime's: editing them in the
    recipe leaves every fingerprint as it was, and `make engine` finds every stage up to date."""
    import yaml

    from trtbuild import stages

    data = yaml.safe_load(qwen_build.path.read_text())
    recipe = load_recipe(qwen_build.path)
    data["serving"] = {"sampling": {"temperature": 0.2, "top_p": 0.8}, "device": "cpu", "deterministic": True,
                       "solver": {"vote": "entropy", "samples": 6, "early_stop_first": 4, "early_stop_agree": 3,
                                  "enough_finished": 5},
                       "budget": {"policy": "aimo3", "low_seconds": 100, "high_seconds": 400}}
    path = qwen_build.path.with_name("tinyqwen-serving.yaml")  # same name, so the same engines/tinyqwen/
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    edited = load_recipe(path)
    assert edited.out_dir == recipe.out_dir and edited.serving != recipe.serving
    for name, args in (("sources", ()), ("merge", ()), ("quantize", ()), ("build", ("embedded",)),
                       ("build", ("trtllm",))):
        assert stages.fingerprint(edited, name, *args) == stages.fingerprint(recipe, name, *args), name
    before = _finished(qwen_build.out_dir)
    capfd.readouterr()
    assert main(["engine", "--recipe", str(path), "--backend", "embedded"]) == 0
    err = capfd.readouterr().err
    assert _finished(qwen_build.out_dir) == before
    assert "[build] up to date" in err and "building" not in err


def test_trtllm_backend_missing_is_a_clear_error(qwen_build, capfd):
    assert main(["build", "--recipe", str(qwen_build.path), "--backend", "trtllm"]) == 1
    err = capfd.readouterr().err
    assert "BACKEND=trtllm is not usable here: TensorRT-LLM is not installed" in err


def test_failed_stage_keeps_earlier_outputs_and_resumes(tiny_models, tmp_path, monkeypatch, capfd):
    """A TIR fine-tune source, then a forced fp8 failure: int8 and earlier stages survive; rerun resumes."""
    import trtbuild.quantize as quantize

    path = write_recipe(tmp_path, "tinyllama", {
        "cot": {"kind": "hf", "path": str(tiny_models["llama-cot"])},
        "tir": {"kind": "tir_finetune", "base": "cot", "traces": 24, "steps": 3, "batch_size": 4, "max_length": 128},
    })
    real = quantize._quantize_one

    def failing(recipe, fmt, *args, **kwargs):
        if fmt == "fp8":
            raise RuntimeError("forced failure for the test")
        return real(recipe, fmt, *args, **kwargs)

    monkeypatch.setattr(quantize, "_quantize_one", failing)
    assert main(["engine", "--recipe", str(path), "--backend", "embedded"]) == 1
    assert "[quantize] FAILED: RuntimeError: forced failure" in capfd.readouterr().err
    out = tmp_path / "tinyllama"
    tir = mf.read_manifest(out / "sources" / "tir")
    assert tir["training"]["train_traces"] == 24 and len(tir["training"]["loss_curve"]) == 3
    assert mf.read_manifest(out / "quantize" / "int8_wo") is not None
    assert not (out / "quantize" / "fp8").exists() and not (out / "build").exists()
    assert not list((out / "quantize").glob(".*partial*"))
    before = _finished(out)

    monkeypatch.setattr(quantize, "_quantize_one", real)
    assert main(["engine", "--recipe", str(path), "--backend", "embedded"]) == 0
    after = _finished(out)
    for d in ("sources/cot", "sources/tir", "merge", "quantize/int8_wo"):
        assert after[d] == before[d], f"{d} was redone"
    assert "quantize/fp8" in after and "build/embedded" in after


def test_recipe_change_reruns_only_affected_stages(qwen_build, tmp_path):
    import yaml

    data = yaml.safe_load(qwen_build.path.read_text())
    data["build"]["max_batch_size"] = 8
    path = qwen_build.path.with_name("tinyqwen.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    before = _finished(qwen_build.out_dir)
    assert main(["engine", "--recipe", str(path), "--backend", "embedded"]) == 0
    after = _finished(qwen_build.out_dir)
    assert {d for d in STAGE_DIRS if after[d] != before[d]} == {"build/embedded"}


def test_code_change_is_reported_not_silent_and_force_rebuilds(qwen_build, monkeypatch, capfd):
    """One staleness rule: the fingerprint decides; a code edit without a VERSION bump is reported
    on the skipped stage, and FORCE rebuilds exactly the named stage."""
    from trtbuild import stages

    real = stages.code_hashes
    monkeypatch.setattr(stages, "code_hashes",
                        lambda name: {**real(name), "trtbuild/quality.py": "edited"} if name == "merge" else real(name))
    before = _finished(qwen_build.out_dir)
    capfd.readouterr()
    assert main(["merge", "--recipe", str(qwen_build.path)]) == 0
    err = capfd.readouterr().err
    assert "trtbuild/quality.py changed since it was built" in err and "FORCE=merge" in err
    assert _finished(qwen_build.out_dir) == before
    monkeypatch.setattr(stages, "code_hashes", real)
    monkeypatch.setenv(stages.FORCE_ENV, "build")
    assert main(["engine", "--recipe", str(qwen_build.path), "--backend", "embedded"]) == 0
    err = capfd.readouterr().err
    assert "[build] embedded: building" in err and "[build] up to date" not in err
    assert "[merge] up to date" in err and "[quantize] up to date" in err
    after = _finished(qwen_build.out_dir)
    assert {d for d in STAGE_DIRS if after[d] != before[d]} <= {"build/embedded"}


def test_stage_table_matches_the_layout(qwen_build):
    """Every stage of the table has run; its manifest records the hashes of the stage's code."""
    from trtbuild import stages

    layout = qwen_build.layout
    folders = {"sources": layout.sources, "merge": layout.merge, "quantize": layout.quantize,
               "build": layout.engine("embedded")}
    for name, folder in folders.items():
        m = mf.read_manifest(folder)
        assert m and set(m["code"]) == set(stages.code_hashes(name)) and m["code"], name


def test_solve_end_to_end_on_the_built_engine(qwen_build, tmp_path, capsys):
    """`python -m server.programs.solve` on the pipeline's int8 engine, with the real sandbox.

    A random model writes no python, so the code tags are taken from its own greedy reply: the
    TIR loop then really intercepts a "code block", runs it in the sandbox (a syntax error) and feeds
    the error back, and the solver votes over real samples.
    """
    import asyncio
    import json

    import yaml

    from aimo_spec.protocol import Final, Request, SamplingParams
    from server.embedded.engine import EmbeddedEngine
    from server.programs.solve import main as solve_main

    eng = EmbeddedEngine.from_dir(qwen_build.out_dir / "build" / "embedded")

    async def greedy():
        async for ev in eng.generate(Request(eng.chat_prompt("What is 6 times 7?"),
                                             SamplingParams(temperature=0, max_tokens=48))):
            if isinstance(ev, Final):
                return ev.text
    text = asyncio.run(greedy())
    eng.shutdown()
    j = next(j for j in range(4, len(text) - 1) if text.find(text[j:j + 2]) == j)
    tags = {"code_start": text[:2], "code_end": text[j:j + 2], "output_start": "<out>\n", "output_end": "</out>\n"}

    data = yaml.safe_load(qwen_build.path.read_text())
    data["serving"] = {"code_tags": tags, "sampling": {"temperature": 0.0, "max_tokens": 48}, "max_code_calls": 2,
                       "solver": {"samples": 3, "early_stop_first": 3, "early_stop_agree": 3, "enough_finished": 3},
                       "budget": {"policy": "aimo2", "base_seconds": 60, "max_extra_seconds": 10}}
    recipe = qwen_build.path.with_name("solve.yaml")
    recipe.write_text(yaml.safe_dump(data))
    problems = tmp_path / "p.csv"
    problems.write_text('id,problem,answer\nsix,What is 6 times 7?,42\nother,"Name a prime, please.",\n')
    out = tmp_path / "run"
    assert solve_main(["--recipe", str(recipe), "--problems", str(problems), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "tok/s (whole run)" in table and "six" in table
    summary = json.loads((out / "results.json").read_text())
    assert summary["problems"] == 2 and summary["scored"] == 1 and summary["tokens"] > 0
    traces = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == 6
    six = [t for t in traces if t["problem_id"] == "six"]
    assert all(t["code_calls"] and t["code_calls"][0]["status"] == "error" for t in six)
    assert all("<out>\n" in t["text"] for t in six) and all(t["tool_seconds"] > 0 for t in six)


def test_solve_reports_bad_problem_files(qwen_build, tmp_path, capsys):
    from server.programs.solve import main as solve_main

    bad = tmp_path / "bad.csv"
    bad.write_text("id,question\n1,hi\n")
    assert solve_main(["--recipe", str(qwen_build.path), "--problems", str(bad)]) == 2
    assert "missing column 'problem'" in capsys.readouterr().err
    bad.write_text("id,problem,answer\n1,hi,seven\n")
    assert solve_main(["--recipe", str(qwen_build.path), "--problems", str(bad)]) == 2
    assert "line 2: column 'answer' must be an integer (got 'seven')" in capsys.readouterr().err


def test_a_merge_written_in_shards_quantizes_and_checks_across_them(tiny_models, tmp_path, monkeypatch):
    """Large models merge into many shards (mergekit holds a shard in host memory until it is full):
    the exactness check, ModelOpt and the rounding check read across them."""
    import trtbuild.merge_stage as merge_stage

    monkeypatch.setattr(merge_stage, "SHARD_BYTES", 50_000)
    path = write_recipe(tmp_path, "tinyshards", {
        "cot": {"kind": "hf", "path": str(tiny_models["qwen-cot"])},
        "tir": {"kind": "hf", "path": str(tiny_models["qwen-tir"])},
    }, quantize={"formats": ["int8_wo"], "calibration": {"size": 4, "max_length": 64}})
    for stage in ("sources", "merge", "quantize"):
        assert main([stage, "--recipe", str(path)]) == 0, stage
    out = load_recipe(path).out_dir
    shards = sorted((out / "merge" / "model").glob("*.safetensors"))
    assert len(shards) > 1 and (out / "merge" / "model" / "model.safetensors.index.json").is_file()
    assert mf.read_manifest(out / "merge")["arithmetic_check"]["within_rounding"]
    q = mf.read_manifest(out / "quantize" / "int8_wo")
    assert q["reload_error"]["layers"] == 2 * 7 and q["reload_error"]["max_error_over_bound"] <= 1.0 + 1e-3
