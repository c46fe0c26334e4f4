"""Checkpoints and command lines the pipeline refuses before any stage works (the probe of stop 51): a source
whose config or safetensors header is not whole, sources a linear merge cannot add, a misspelt
TRTBUILD_FORCE, a backend that cannot serve the recipe's format, and a damaged manifest in `report`.
Each is one line naming the file or key, exit 2, nothing written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from aimo_spec.recipe import RecipeError, load_recipe
from aimo_spec.safetensors_header import SafetensorsError, check_whole, parameters, read_header
from trtbuild.__main__ import main


def write_safetensors(path: Path, tensors: dict[str, list[int]], header: object = None) -> None:
    """A float32 safetensors file of zeros with these shapes (or with `header` as its JSON header)."""
    entries, offset = {}, 0
    for name, shape in tensors.items():
        size = 4
        for d in shape:
            size *= d
        entries[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries if header is None else header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def checkpoint(folder: Path, shape: list[int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    write_safetensors(folder / "model.safetensors", {"model.embed_tokens.weight": shape, "norm.weight": [shape[1]]})
    return folder


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    checkpoint(tmp_path / "a", [4, 2])
    checkpoint(tmp_path / "b", [4, 2])
    path = tmp_path / "r.yaml"
    path.write_text("name: probe\nsources:\n  a: {kind: hf, path: a}\n  b: {kind: hf, path: b}\n"
                    "merge: {weights: {a: 0.5, b: 0.5}, base_model: b}\ndrafter: {kind: none}\n")
    return path


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_a_whole_header_is_read_and_counted(tmp_path):
    write_safetensors(tmp_path / "w.safetensors", {"x": [3, 5], "y": [7]})
    tensors = check_whole(tmp_path / "w.safetensors")
    assert parameters(tensors) == 22 and tensors["x"]["shape"] == [3, 5]


@pytest.mark.parametrize("content, words", [
    (b"\x10\x00", "truncated safetensors file (2 bytes)"),
    (struct.pack("<Q", 2 ** 64 - 1) + b"{}", "truncated or corrupt safetensors header"),
    (struct.pack("<Q", 4) + b"{not", "corrupt safetensors header"),
    (struct.pack("<Q", 2) + b"[]", "not a mapping"),
])
def test_a_header_that_is_not_whole_names_its_file(tmp_path, content, words):
    (tmp_path / "w.safetensors").write_bytes(content)
    with pytest.raises(SafetensorsError, match="w.safetensors: ") as e:
        read_header(tmp_path / "w.safetensors")
    assert words in str(e.value)


@pytest.mark.parametrize("entry, words", [
    ({"dtype": "F32", "shape": ["abc"], "data_offsets": [0, 4]}, "tensor 'x': not a safetensors entry"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 10 ** 6]}, "tensor 'x' ends at byte 1000000 of the data, "
                                                                   "but the file holds 4 (truncated or corrupt copy)"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "tensor 'x': not a safetensors entry"),
    ({"shape": [1], "data_offsets": [0, 4]}, "tensor 'x': not a safetensors entry"),
    ("a string", "tensor 'x': not a safetensors entry"),
])
def test_a_tensor_entry_out_of_its_file_is_refused(tmp_path, entry, words):
    write_safetensors(tmp_path / "w.safetensors", {"x": [1]}, header={"x": entry})
    with pytest.raises(SafetensorsError) as e:
        read_header(tmp_path / "w.safetensors")
    assert words in str(e.value)


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "model.safetensors: truncated safetensors file"),
    (lambda d: write_safetensors(d / "model.safetensors", {}, header={"x": {"dtype": "F32", "shape": "abc",
                                                                         "data_offsets": [0, 0]}}),
     "tensor 'x': not a safetensors entry"),
])
def test_check_plan_and_the_sources_stage_name_a_damaged_checkpoint(recipe, capsys, damage, words):
    """A garbage header passed `check`; `plan` said 'model size unknown (OverflowError ...)' without the file,
    and the sources stage marked the source done."""
    damage(recipe.parent / "b")
    for command in ("check", "plan", "sources"):
        rc, out = run(capsys, command, "--recipe", str(recipe))
        assert rc == 2 and f"r.yaml: sources.b.path: {recipe.parent / 'b'}" in out and words in out, (command, out)
    assert not (recipe.parent / "probe" / "sources" / "b").exists()


def test_the_sources_stage_refuses_a_config_that_is_not_json(recipe, capsys, monkeypatch):
    from trtbuild import sources

    (recipe.parent / "a" / "config.json").write_text("{not json")
    monkeypatch.setenv("TRTBUILD_SKIP_RESOURCE_CHECK", "1")
    with pytest.raises(RecipeError, match=r"sources.a.path: .*config.json: not a readable JSON config"):
        sources.checkpoint_tensors(recipe.parent / "a", f"{recipe}: sources.a.path")
    rc, out = run(capsys, "sources", "--recipe", str(recipe))
    assert rc == 2 and "config.json: not a readable JSON config" in out, out


def test_sources_a_linear_merge_cannot_add_are_refused_before_mergekit(recipe):
    from trtbuild.merge_stage import same_tensors

    r = load_recipe(recipe)
    same_tensors(r, {"a": recipe.parent / "a", "b": recipe.parent / "b"})  # the same shapes: fine
    checkpoint(recipe.parent / "b", [2, 4])
    with pytest.raises(RecipeError, match=r"merge.weights: sources 'a' and 'b' cannot be merged linearly: tensor "
                                          r"'model.embed_tokens.weight' is \[4, 2\] in 'a' and \[2, 4\] in 'b'"):
        same_tensors(r, {"a": recipe.parent / "a", "b": recipe.parent / "b"})


def test_a_misspelt_force_and_a_backend_that_cannot_serve_the_format_stop_before_any_stage(recipe, capsys,
                                                                                          monkeypatch):
    monkeypatch.setenv("TRTBUILD_FORCE", "sorces")
    rc, out = run(capsys, "sources", "--recipe", str(recipe))
    assert rc == 2 and "TRTBUILD_FORCE: no stage named 'sorces'" in out, out
    monkeypatch.setenv("TRTBUILD_FORCE", "sources, all")
    assert run(capsys, "check", "--recipe", str(recipe))[0] == 0
    monkeypatch.delenv("TRTBUILD_FORCE")
    text = recipe.read_text() + "quantize: {formats: [gguf_q8_0]}\nbuild: {quantization: gguf_q8_0}\n"
    recipe.write_text(text)
    rc, out = run(capsys, "engine", "--recipe", str(recipe), "--backend", "trtllm")
    assert rc == 2 and "TensorRT-LLM cannot serve GGUF" in out and not (recipe.parent / "probe").exists(), out


def test_report_names_a_manifest_it_cannot_read(recipe, capsys):
    merge = recipe.parent / "probe" / "merge"
    merge.mkdir(parents=True)
    (merge / "manifest.json").write_text(json.dumps({"status": "done", "seconds": 3}))
    rc, out = run(capsys, "report", "--recipe", str(recipe))
    assert rc == 0 and "merge/manifest.json: not a manifest this version reads (KeyError" in out, out


def test_a_folder_built_from_another_recipe_file_is_said(recipe, capsys, monkeypatch):
    """Two recipe files with one name share an output folder; each rebuilds what differs from the other's."""
    monkeypatch.setenv("TRTBUILD_SKIP_RESOURCE_CHECK", "1")
    other = recipe.parent / "other.yaml"
    other.write_text(recipe.read_text())
    rc, out = run(capsys, "sources", "--recipe", str(recipe))
    assert rc == 0 and "was last built from" not in out, out
    rc, out = run(capsys, "sources", "--recipe", str(other))
    assert rc == 0 and f"was last built from {recipe.resolve()}; this run, from {other.resolve()}" in out, out
    rc, out = run(capsys, "sources", "--recipe", str(other))
    assert rc == 0 and "was last built from" not in out, out


@pytest.mark.parametrize("where", ["merge", "build", "build/embedded", "quantize", "kaggle"])
def test_a_file_where_a_stage_keeps_a_folder_stops_the_run_before_any_stage(recipe, capsys, monkeypatch, where):
    """A file (or a link) at a stage's folder failed that stage midway with a traceback: named up front, and
    nothing under the output folder is changed."""
    monkeypatch.setenv("TRTBUILD_SKIP_RESOURCE_CHECK", "1")
    blocked = recipe.parent / "probe" / where
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_text("mine")

    def listing() -> list[Path]:  # the run's lock file aside
        return sorted(p.relative_to(recipe.parent) for p in (recipe.parent / "probe").rglob("*") if p.name != ".lock")
    before = listing()
    rc, out = run(capsys, "sources", "--recipe", str(recipe))
    assert rc == 2 and f"error: {blocked} is a file where make engine keeps a folder" in out, out
    assert "Traceback" not in out and blocked.read_text() == "mine"
    assert listing() == before
    blocked.unlink()
    blocked.symlink_to(recipe.parent / "nowhere")
    rc, out = run(capsys, "sources", "--recipe", str(recipe))
    assert rc == 2 and f"error: {blocked} is a link where make engine keeps a folder" in out, out


def test_a_max_seq_len_past_the_models_positions_is_noted(tmp_path):
    from trtbuild.build import positions_note

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"max_position_embeddings": 8192}))
    assert positions_note(8192, config) is None
    note = positions_note(16384, config)
    assert note and "build.max_seq_len 16384 is past the model's max_position_embeddings 8192" in note
    config.write_text(json.dumps({"max_position_embeddings": 8192, "rope_scaling": {"type": "yarn", "factor": 4}}))
    assert positions_note(16384, config) is None  # stretched positions: the model's own choice
    for broken in ("{not json", "[]", json.dumps({"max_position_embeddings": "many"})):
        config.write_text(broken)
        assert positions_note(16384, config) is None  # nothing said: the checkpoint checks name broken configs
    assert positions_note(16384, tmp_path / "missing.json") is None
