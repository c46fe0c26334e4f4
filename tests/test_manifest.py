"""The stage guard trusts a stage only when its manifest is readable and its files match it (sizes
always, sha256 of small files), rebuilds what fails, writes manifests atomically, and one lock per
model folder keeps two concurrent `make engine` runs from both doing the work."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from trtbuild import manifest as mf
from trtbuild import stages


def build_counter(payload: bytes = b"w" * 4096):
    calls = []

    def make(tmp: Path) -> dict:
        calls.append(time.monotonic())
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text('{"layers": 2}')
        (tmp / "model" / "model.safetensors").write_bytes(payload)
        return {"note": "test"}
    return make, calls


def test_an_intact_stage_is_current_and_records_what_it_verifies(tmp_path, capfd):
    final = tmp_path / "merge"
    make, calls = build_counter()
    stages.produce("merge", final, "fp1", make)
    stages.produce("merge", final, "fp1", make)
    assert len(calls) == 1 and "up to date" in capfd.readouterr().err
    rec = mf.read_manifest(final)["verify"]
    assert rec["sizes"] == {"model/config.json": 13, "model/model.safetensors": 4096}
    assert set(rec["sha256"]) == {"model/config.json", "model/model.safetensors"}


@pytest.mark.parametrize("damage,words", [
    (lambda f: (f / "model" / "model.safetensors").write_bytes(b"w" * 100),
     "model/model.safetensors is 100 bytes but was 4096"),
    (lambda f: (f / "model" / "config.json").unlink(), "model/config.json is missing"),
    (lambda f: (f / "model" / "config.json").write_text('{"layers": 9}'),
     "model/config.json changed since it was built"),
    (lambda f: (f / "manifest.json").write_text('{"stage": "merge", "fingerpr'), "manifest.json cannot be read"),
    (lambda f: (f / "manifest.json").write_bytes(b"\xff\xfe\x00garbage"), "manifest.json cannot be read"),
    (lambda f: (f / "manifest.json").write_text("null"), "not an object"),
])
def test_a_damaged_stage_is_rebuilt_with_a_line_saying_why(tmp_path, capfd, damage, words):
    final = tmp_path / "merge"
    make, calls = build_counter()
    stages.produce("merge", final, "fp1", make)
    damage(final)
    capfd.readouterr()
    stages.produce("merge", final, "fp1", make)
    err = capfd.readouterr().err
    assert len(calls) == 2 and words in err and "rebuilding the stage" in err
    assert mf.verify(final, mf.read_manifest(final)) is None  # whole again


def test_large_files_are_checked_by_size_only(tmp_path, monkeypatch):
    monkeypatch.setattr(mf, "VERIFY_HASH_BYTES", 1000)
    final = tmp_path / "merge"
    make, calls = build_counter(b"a" * 4096)
    stages.produce("merge", final, "fp1", make)
    rec = mf.read_manifest(final)["verify"]
    assert set(rec["sha256"]) == {"model/config.json"} and rec["sizes"]["model/model.safetensors"] == 4096
    (final / "model" / "model.safetensors").write_bytes(b"b" * 4096)  # same size: the documented blind spot
    assert mf.verify(final, mf.read_manifest(final)) is None


def test_a_manifest_from_before_verification_is_trusted(tmp_path):
    final = tmp_path / "merge"
    make, calls = build_counter()
    stages.produce("merge", final, "fp1", make)
    m = mf.read_manifest(final)
    del m["verify"]
    (final / "manifest.json").write_text(json.dumps(m))
    stages.produce("merge", final, "fp1", make)
    assert len(calls) == 1


def test_two_concurrent_runs_on_one_folder_do_the_work_once(tmp_path):
    final = tmp_path / "out" / "merge"
    make, calls = build_counter()

    building, waiting = threading.Event(), threading.Event()

    def slow(tmp: Path) -> dict:  # the first run builds until the second is seen waiting (no sleeps to race)
        building.set()
        waiting.wait(10)
        return make(tmp)
    waited = []

    def one_run():
        with mf.folder_lock(tmp_path / "out", wait_log=lambda m: waited.append(m) or waiting.set()):
            stages.produce("merge", final, "fp1", slow)
    runs = [threading.Thread(target=one_run) for _ in range(2)]
    runs[0].start()
    assert building.wait(10)  # the first holds the lock (its pid written) before the second tries it
    runs[1].start()
    for t in runs:
        t.join(10)
    assert len(calls) == 1 and len(waited) == 1 and "pid " in waited[0] and "waiting" in waited[0]
    assert (tmp_path / "out" / ".lock").read_text() == ""  # released


def test_the_build_command_takes_the_lock(tmp_path, monkeypatch):
    from small_recipes import write_recipe

    import trtbuild.__main__ as cli

    taken = []
    real = mf.folder_lock

    def spy(folder, wait_log=None):
        taken.append(folder)
        return real(folder, wait_log)
    monkeypatch.setattr(mf, "folder_lock", spy)
    monkeypatch.setattr(cli, "run_stage", lambda name, recipe, backend: None)
    recipe = write_recipe(tmp_path, "lk", {"cot": {"kind": "hf", "path": "a"}, "tir": {"kind": "hf", "path": "b"}})
    monkeypatch.setattr(cli, "load_recipe", lambda path: __import__("aimo_spec.recipe", fromlist=["x"]).load_recipe(
        path, check_paths=False))
    assert cli.main(["merge", "--recipe", str(recipe)]) == 0
    assert taken == [tmp_path / "lk"]


def test_stage_dir_removes_scratch_that_dead_runs_left_and_keeps_live_ones(tmp_path):
    """A stage killed by a signal (segfault, OOM killer) leaves its scratch folder; the next run removes
    it, keeps a running build's, and puts back an output set aside between the two renames."""
    import os
    import subprocess
    import sys

    from trtbuild.manifest import stage_dir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # ended and reaped: no process has this pid now (barring reuse)
    final = tmp_path / "quantize"
    stale = tmp_path / f".quantize.partial-{dead_pid}"
    live = tmp_path / f".quantize.partial-{os.getppid()}"
    set_aside = tmp_path / f".quantize.old-{dead_pid}"
    for d in (stale, live, set_aside):
        d.mkdir()
    (set_aside / "model.bin").write_text("the last good output")
    with stage_dir(final) as tmp:
        assert not stale.exists() and live.exists()
        assert (final / "model.bin").read_text() == "the last good output" and not set_aside.exists()
        (tmp / "model.bin").write_text("new")
    assert (final / "model.bin").read_text() == "new" and live.exists()


def test_link_tree_links_each_file_and_copies_where_links_fail(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"w" * 64)
    (src / "sub" / "tokenizer.json").write_text("{}")
    (src / mf.MANIFEST).write_text("{}")
    (src / "skip.bin").write_bytes(b"x")
    mf.link_tree(src, tmp_path / "linked", "*.bin")
    assert (tmp_path / "linked" / "model.safetensors").samefile(src / "model.safetensors")
    assert (tmp_path / "linked" / "sub" / "tokenizer.json").samefile(src / "sub" / "tokenizer.json")
    assert not (tmp_path / "linked" / mf.MANIFEST).exists() and not (tmp_path / "linked" / "skip.bin").exists()

    def cross_device(a, b):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(mf.os, "link", cross_device)
    mf.link_tree(src, tmp_path / "copied")
    copy = tmp_path / "copied" / "model.safetensors"
    assert copy.read_bytes() == b"w" * 64 and not copy.samefile(src / "model.safetensors")
