"""Recipe schema: the shipped recipe is valid; every kind of mistake fails with file, key and value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from refusals import assert_refused

from aimo_spec.recipe import RecipeError, load_recipe, parse_recipe

ROOT = Path(__file__).resolve().parents[1]


def _base() -> dict:
    return yaml.safe_load((ROOT / "engines" / "mix.yaml").read_text())


def test_shipped_recipe_is_valid():
    r = load_recipe(ROOT / "engines" / "mix.yaml")
    assert r.name == "mix"
    assert r.merge.weights == {"cot": 0.3, "tir": 0.7}
    assert r.out_dir == (ROOT / "engines" / "mix").resolve()
    assert r.serving.code_tags.code_start == "```python\n"
    assert set(r.quantize.formats) == {"fp8", "int8_wo", "gguf_q8_0"}
    assert (r.build.quantization, r.build.cpu_quantization) == ("int8_wo", "gguf_q8_0")  # llama.cpp on CPUs


def _error(tmp_path: Path, mutate) -> str:
    data = _base()
    mutate(data)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg
    return msg


def test_serving_defaults_are_the_anchors():
    # issue 19: stateful sessions, 1000 characters fed back, a notice past the code-call limit
    from aimo_spec.recipe import ServingSpec, SolverSpec, ToolSpec

    s = ServingSpec()
    assert ToolSpec().stateful and s.output_chars == 1000 and "no more code will run" in s.code_limit_notice
    assert SolverSpec().weight_cap == 4.0 and SolverSpec().vote in ("majority", "entropy", "local_entropy")
    r = load_recipe(ROOT / "engines" / "mix.yaml")
    assert r.serving.tool.stateful and r.serving.output_chars == 1000 and r.serving.code_limit_notice


@pytest.mark.parametrize("mutate, key, value", [
    (lambda d: d["merge"].update(wieghts={"cot": 1}), "merge.wieghts", "unknown key"),
    (lambda d: d["merge"]["weights"].update(cot="heavy"), "merge.weights.cot", "'heavy'"),
    (lambda d: d["merge"]["weights"].update(sft=0.5), "merge.weights.sft", "'sft'"),
    (lambda d: d["merge"].update(base_model="nope"), "merge.base_model", "'nope'"),
    (lambda d: d["quantize"].update(formats=["int4"]), "quantize.formats[0]", "'int4'"),
    (lambda d: d["build"].update(quantization="fp8", max_batch_size="big"), "build.max_batch_size", "'big'"),
    (lambda d: d["build"].update(max_batch_size=True), "build.max_batch_size", "True"),
    (lambda d: d["build"].update(max_input_len=9000), "build.max_input_len", "9000"),
    (lambda d: d["quantize"].update(formats=["fp8"]), "build.quantization", "'int8_wo'"),
    (lambda d: d["build"].update(cpu_quantization="gguf_q4_0"), "build.cpu_quantization", "'gguf_q4_0'"),
    (lambda d: (d["quantize"].update(formats=["int8_wo"]), d["build"].update(cpu_quantization="fp8")),
     "build.cpu_quantization", "'fp8'"),
    (lambda d: d["sources"]["cot"].update(kind="s3"), "sources.cot.kind", "'s3'"),
    (lambda d: d["sources"].update(cot={"kind": "hf", "path": "/no/such/ckpt"}), "sources.cot.path", "/no/such/ckpt"),
    (lambda d: d["sources"]["tir"].update(base="tir"), "sources.tir.base", "'tir'"),
    (lambda d: d.pop("merge"), "merge", "missing required key"),
    (lambda d: d["serving"]["sampling"].update(top_p=0), "serving.sampling.top_p", "0"),
    (lambda d: d["serving"]["code_tags"].update(code_end=""), "serving.code_tags.code_end", "''"),
    (lambda d: d["serving"].update(speculative={"enabled": "yes"}), "serving.speculative.enabled", "'yes'"),
    (lambda d: d["serving"].update(speculative={"max_batch": -1}), "serving.speculative.max_batch", "-1"),
    (lambda d: (d["drafter"].update(kind="none"), d["serving"].update(speculative={"enabled": "on"})),
     "serving.speculative.enabled", "'on'"),
    (lambda d: d["serving"]["solver"].update(weight_cap=0.5), "serving.solver.weight_cap", "0.5"),
    (lambda d: d["serving"]["solver"].update(answer_window=0), "serving.solver.answer_window", "0"),
    (lambda d: d["serving"]["solver"].update(vote="local_entropy", top_logprobs=1), "serving.solver.top_logprobs", "1"),
    (lambda d: d["serving"]["solver"].update(vote="median"), "serving.solver.vote", "'median'"),
    (lambda d: d["serving"].update(code_limit_notice=3), "serving.code_limit_notice", "3"),
    (lambda d: d["serving"]["tool"].update(stateful="yes"), "serving.tool.stateful", "'yes'"),
    (lambda d: d.setdefault("serving", {}).setdefault("budget", {}).update(total_seconds=0),
     "serving.budget.total_seconds", "0"),
    (lambda d: d.setdefault("serving", {}).setdefault("budget", {}).update(total_seconds=-5.0),
     "serving.budget.total_seconds", "-5.0"),
    (lambda d: d["merge"]["weights"].update(cot=float("nan")), "merge.weights.cot", "nan"),
    (lambda d: d["merge"]["weights"].update(tir=float("inf")), "merge.weights.tir", "inf"),
    (lambda d: d["sources"].update(cot={"kind": "gguf_package", "package": "no-such-pkg-zz", "file": "m.gguf"}),
     "sources.cot.package", "'no-such-pkg-zz'"),
    (lambda d: d.update(kaggle={"answer_range": 1}), "kaggle.answer_range", "1"),
    (lambda d: (d.update(kaggle={"competition": "aimo2"}), d.setdefault("serving", {}).setdefault("budget", {}).update(
        policy="aimo2", base_seconds=1500, max_extra_seconds=290)), "serving.budget.max_extra_seconds", "290"),
    (lambda d: d.setdefault("serving", {}).setdefault("budget", {}).update(policy="aimo3", high_seconds=40000),
     "serving.budget.high_seconds", "40000"),
    (lambda d: d.update(kaggle={"competition": "aimo9"}), "kaggle.competition", "'aimo9'"),
    # the probe of stop 51: names that are paths, values out of range, keys that were named wrongly
    (lambda d: (d["sources"].update({"../../victim": d["sources"].pop("cot")}), d["sources"]["tir"].update(
        base="../../victim")), "sources", "'../../victim'"),
    (lambda d: d["sources"].update({".": d["sources"]["cot"]}), "sources", "'.'"),
    (lambda d: d.update(name="x" * 101), "name", "xxx"),
    (lambda d: d["sources"]["cot"].update(package="ssl.x"), "sources.cot.package", "'ssl.x'"),
    (lambda d: d["sources"]["cot"].update(file="/etc/passwd"), "sources.cot.file", "'/etc/passwd'"),
    (lambda d: d["sources"]["tir"].update(lr=10 ** 400), "sources.tir.lr", "expected a finite number"),
    (lambda d: d["sources"]["tir"].update(lr=0), "sources.tir.lr", "0"),
    (lambda d: d["sources"]["tir"].update(lora_alpha=-5), "sources.tir.lora_alpha", "-5"),
    (lambda d: d["merge"]["weights"].update(cot=1e308, tir=1e308), "merge.weights", "finite sum"),
    (lambda d: d["quantize"]["calibration"].update(max_length=0), "quantize.calibration.max_length", "0"),
    (lambda d: d["serving"]["sampling"].update(top_k=-1), "serving.sampling.top_k", "-1"),
    (lambda d: d["serving"]["tool"].update(memory_mb=0), "serving.tool.memory_mb", "0"),
    (lambda d: d["serving"].update(output_chars=0), "serving.output_chars", "0"),
    (lambda d: d["serving"]["solver"].update(early_stop_first=0), "serving.solver.early_stop_first", "0"),
    (lambda d: d["serving"]["solver"].update(top_logprobs=25), "serving.solver.top_logprobs", "25"),
    (lambda d: d["drafter"].update(num_beams=100), "drafter.num_beams", "100"),  # engine.json's bound
    (lambda d: d["build"].update(max_batch_size=20000), "build.max_batch_size", "20000"),
    (lambda d: d["quality"].update(min_agreement=5.0), "quality.min_agreement", "5.0"),
    (lambda d: d["quality"].update(max_kl=-1), "quality.max_kl", "-1"),
    (lambda d: d.update(trtllm={"gpu_device_ids": [-1, -1]}), "trtllm.gpu_device_ids", "[-1, -1]"),
    (lambda d: d.update(trtllm={"max_queue_delay_microseconds": -1}), "trtllm.max_queue_delay_microseconds", "-1"),
    (lambda d: d["drafter"].update(num_beams=0), "drafter.num_beams", "0"),
    (lambda d: d["drafter"]["train"].update(lr=0), "drafter.train.lr", "0"),
    (lambda d: d["drafter"].update(kind="none", path="/no/such/drafter"), "drafter.path", "'/no/such/drafter'"),
    (lambda d: d["drafter"].update(path="/etc/hostname"), "drafter.path", "is a file"),
])
def test_bad_recipe_names_file_key_and_value(tmp_path, mutate, key, value):
    msg = _error(tmp_path, mutate)
    assert key in msg and value in msg, msg


def test_yaml_syntax_error_names_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("name: x\nmerge: [1, 2\n")
    with pytest.raises(RecipeError, match=r"broken.yaml: line \d+: not valid YAML"):
        load_recipe(p)


@pytest.mark.parametrize("content,words", [
    (b"", "the recipe is empty"), (b"# nothing but a comment\n", "the recipe is empty"),
    (b"name: x\nmerge:\n  base_model: caf\xe9\n", r"line 3: not UTF-8 \(byte 0xe9\)"),
    (b"- a\n- b\n", "a recipe is a mapping of sections"),
])
def test_empty_or_undecodable_recipes_say_so(tmp_path, content, words):
    assert_refused(tmp_path / "r.yaml", content, load_recipe, RecipeError, words)


def test_kaggle_section_defaults_per_competition(tmp_path):
    from aimo_spec.recipe import ANSWER_RANGES

    data = _base()
    r = parse_recipe({**data, "name": "x", "kaggle": {"competition": "aimo2"}}, check_paths=False)
    assert r.kaggle.answers_modulo == 1000 == ANSWER_RANGES["aimo2"]
    assert parse_recipe({**data, "name": "x"}, check_paths=False).kaggle.answers_modulo == 100000
    r = parse_recipe({**data, "name": "x", "kaggle": {"answer_range": 77}}, check_paths=False)
    assert r.kaggle.answers_modulo == 77


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="a folder, not a recipe file"):
        load_recipe(tmp_path)


def _written(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_yaml_reads_as_yaml_1_2_without_duplicate_keys(tmp_path):
    """YAML 1.1 read `on` as true, `010` as 8, `1:30` as 90 and `2e-3` as a string; a key given twice
    silently replaced the first (a second `build:` dropped the whole first section)."""
    base = (ROOT / "engines" / "mix.yaml").read_text()
    r = load_recipe(_written(tmp_path, base.replace("enabled: auto", "enabled: on").replace(
        "max_batch_size: 16", "max_batch_size: 010").replace("lr: 2.0e-3", "lr: 2e-3")))
    assert (r.serving.speculative.enabled, r.build.max_batch_size, r.sources["tir"].lr) == ("on", 10, 0.002)
    with pytest.raises(RecipeError, match=r"r.yaml: line \d+: not valid YAML: duplicate key 'build' \(first on line"):
        load_recipe(_written(tmp_path, base + "\nbuild:\n  quantization: fp8\n"))
    with pytest.raises(RecipeError, match="duplicate key 'name'"):
        load_recipe(_written(tmp_path, "name: a\nname: b\n" + base.replace("name: mix\n", "")))
    with pytest.raises(RecipeError, match="sources: every key must be a string"):
        load_recipe(_written(tmp_path, base.replace("  cot:\n", "  1:\n").replace("base: cot", "base: '1'")))


def test_merge_keys_override_and_names_may_hold_dots(tmp_path):
    """A key a mapping merges with `<<` may be overridden (YAML's point of merging); a key given twice on one
    line is a duplicate; model-style names (qwen2.5-math) are names; samples below the early-stop defaults."""
    base = (ROOT / "engines" / "mix.yaml").read_text()
    text = base.replace("  sampling: {temperature: 0.7, top_p: 0.95, top_k: 0, max_tokens: 1024}",
                        "  sampling:\n    <<: {temperature: 0.7, top_p: 0.95, top_k: 0, max_tokens: 1024}\n"
                        "    temperature: 0.5")
    assert text != base
    r = load_recipe(_written(tmp_path, text))
    assert (r.serving.sampling.temperature, r.serving.sampling.top_p) == (0.5, 0.95)
    with pytest.raises(RecipeError, match="duplicate key 'top_p'"):
        load_recipe(_written(tmp_path, base.replace("top_p: 0.95, top_k: 0", "top_p: 0.95, top_p: 0.5")))
    dotted = base.replace("  cot:\n", "  qwen2.5-math:\n").replace("base: cot", "base: qwen2.5-math").replace(
        "{cot: 0.3, tir: 0.7}", "{qwen2.5-math: 0.3, tir: 0.7}")
    assert "qwen2.5-math" in load_recipe(_written(tmp_path, dotted)).sources
    few = base.replace("    samples: 12\n", "    samples: 3\n").replace("    early_stop_first: 5\n", "").replace(
        "    early_stop_agree: 4\n", "").replace("    enough_finished: 10\n", "    enough_finished: 3\n")
    assert load_recipe(_written(tmp_path, few)).serving.solver.samples == 3  # the solver caps the early stop
    with pytest.raises(RecipeError, match=r"r.yaml: line \d+: not valid YAML: a number of 5000 digits"):
        load_recipe(_written(tmp_path, base.replace("  seed: 1234\n", "  seed: " + "9" * 5000 + "\n")))


def test_an_alias_bomb_is_quoted_short(tmp_path):
    """A few lines of YAML aliases stand for 10^9 items: quoting the value whole in the error took minutes
    and gigabytes. The error quotes a few of them (here 10^6, so that the old way stays quick)."""
    def level(i: int) -> str:
        if i == 0:
            return "&a0 [" + ", ".join(["1"] * 10) + "]"
        return f"&a{i} [{level(i - 1)}, " + ", ".join([f"*a{i - 1}"] * 9) + "]"
    base = (ROOT / "engines" / "mix.yaml").read_text()
    assert "  seed: 1234\n" in base
    with pytest.raises(RecipeError) as e:
        load_recipe(_written(tmp_path, base.replace("  seed: 1234\n", f"  seed: {level(5)}\n")))
    assert "quality.seed: expected an integer" in str(e.value) and len(str(e.value)) < 4000, len(str(e.value))


def test_names_that_cannot_be_a_folder(tmp_path):
    base = (ROOT / "engines" / "mix.yaml").read_text().replace("name: mix\n", "")
    with pytest.raises(RecipeError, match=r"no name key and its file name 'my recipe' is not a name.*name: my-recipe"):
        load_recipe(_written(tmp_path, base, "my recipe.yaml"))
    (tmp_path / "taken").write_text("a file where the output folder goes")
    with pytest.raises(RecipeError, match=r"name: the output folder .*taken exists and is not a folder"):
        load_recipe(_written(tmp_path, base, "taken.yaml"))


def test_hf_path_resolves_against_recipe_folder(tmp_path, tiny_models):
    (tmp_path / "ckpt").symlink_to(tiny_models["llama-cot"])
    data = {"name": "t", "sources": {"cot": {"kind": "hf", "path": "ckpt"},
                                     "tir": {"kind": "tir_finetune", "base": "cot"}},
            "merge": {"weights": {"cot": 0.3, "tir": 0.7}, "base_model": "tir"}}
    r = parse_recipe(data, where="t.yaml", path=tmp_path / "t.yaml")
    assert r.resolve("ckpt") == tmp_path / "ckpt"
    assert r.out_dir == tmp_path / "t"


def test_core_imports_without_heavy_libraries():
    code = ("import sys, trtbuild, aimo_spec.recipe, trtbuild.manifest, trtbuild.backends, trtbuild.__main__, "
            "merge, merge.config, server, server.embedded\n"
            "heavy = [m for m in ('torch', 'transformers', 'mergekit', 'modelopt', 'tensorrt_llm') "
            "if m in sys.modules]\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
