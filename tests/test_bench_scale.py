"""trtbuild.programs.bench_scale: its recipe is the mix's with random sources, its fit and projections, and a
failed stage named with its recipe (the whole benchmark runs on the H200 and, for 135M, here)."""

from __future__ import annotations

import pytest
import yaml

from aimo_spec.recipe import load_recipe
from trtbuild.programs import bench_scale


def test_the_scale_recipe_is_the_mixs_with_random_sources_and_loads(tmp_path):
    sources = {"cot": tmp_path / "cot", "tir": tmp_path / "tir"}
    for folder in sources.values():
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    data = bench_scale.recipe_for("0.5b", sources)
    mix = yaml.safe_load(bench_scale.MIX.read_text())
    assert data["merge"] == mix["merge"] and data["drafter"] == mix["drafter"] and data["quality"] == mix["quality"]
    assert data["quantize"]["formats"] == ["int8_wo", "fp8"] and "cpu_quantization" not in data["build"]
    path = tmp_path / "scale-0.5b.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(path)
    assert recipe.name == "scale-0_5b" and set(recipe.sources) == {"cot", "tir"}


def test_the_fit_is_linear_in_parameters_and_its_exponent_tells_the_growth():
    linear = [(1e8, 12.0), (5e8, 52.0), (1.5e9, 152.0)]  # 2 s + 1e-7 s a parameter
    f = bench_scale.fit(linear)
    assert f["a"] == pytest.approx(2.0) and f["b"] == pytest.approx(1e-7)
    quadratic = [(1e8, 1.0), (1e9, 100.0)]
    assert bench_scale.fit(quadratic)["exponent"] == pytest.approx(2.0)
    assert bench_scale.fit([(1e8, 1.0)]) == {"a": None, "b": None, "exponent": None}
    rows = [{"stage": s, "params": p, "seconds": t} for s in (*bench_scale.STAGES, "total") for p, t in linear]
    proj = bench_scale.summarize(rows)["total"]["projected_seconds"]
    assert proj["14b"] == pytest.approx(2.0 + 1e-7 * bench_scale.PROJECT["14b"], rel=1e-3)
    flat = [{"stage": "drafter", "params": p, "seconds": t} for p, t in [(1e8, 57.0), (4e8, 50.0), (1.3e9, 50.6)]]
    assert bench_scale.summarize(flat)["drafter"]["projected_seconds"]["14b"] == 50.6  # not a falling line's value


def test_a_failed_stage_names_the_stage_and_its_recipe(tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\n")  # no sources: the stage command refuses it
    with pytest.raises(RuntimeError, match=r"stage merge of .*bad.yaml failed"):
        bench_scale.run_stage("merge", bad, tmp_path / "bad")


def test_unknown_sizes_are_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_scale.main(["--sizes", "135m,70b", "--work", str(tmp_path / "w")])
    assert "unknown 70b" in capsys.readouterr().err and not (tmp_path / "w").exists()


def test_the_build_stages_run_where_trtbuild_device_says_and_name_a_bad_value(monkeypatch):
    import torch

    from server.embedded.loader import STAGE_DEVICE_ENV, stage_device

    monkeypatch.setenv(STAGE_DEVICE_ENV, "cpu")
    assert stage_device() == torch.device("cpu")
    monkeypatch.delenv(STAGE_DEVICE_ENV)
    assert stage_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    from server.embedded.loader import gate_dtype

    assert gate_dtype(torch.device("cuda")) == torch.bfloat16  # the stages' device decides, not the host's GPU
    assert gate_dtype(torch.device("cpu")) in (torch.bfloat16, torch.float32)
    monkeypatch.setenv(STAGE_DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="TRTBUILD_DEVICE='tpu'"):
        stage_device()


def test_a_run_cut_short_keeps_its_stages_and_resume_goes_on_from_the_first_missing(tmp_path, monkeypatch):
    import json

    ran, fail_at = [], {"drafter"}

    def fake_stage(stage, recipe, out_dir):  # the stages' processes are measured elsewhere: here, the bookkeeping
        if stage in fail_at:
            raise RuntimeError(f"stage {stage} failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        ran.append(stage)
        return {"stage": stage, "seconds": 1.0, "peak_rss_bytes": 10, "peak_gpu_bytes": None, "disk_bytes": 5}

    monkeypatch.setattr(bench_scale, "make_sources", lambda size, work: ({"cot": work, "tir": work}, 0.5))
    monkeypatch.setattr(bench_scale, "safetensors_params", lambda folder: 100_000_000)
    monkeypatch.setattr(bench_scale, "run_stage", fake_stage)
    out, work = tmp_path / "scale.json", tmp_path / "w"
    with pytest.raises(RuntimeError, match="drafter"):
        bench_scale.main(["--sizes", "135m", "--work", str(work), "--out", str(out), "--keep"])
    kept = json.loads(out.read_text())["rows"]
    assert [r["stage"] for r in kept] == ["sources", "merge", "quantize"]
    fail_at.clear()
    ran.clear()
    assert bench_scale.main(["--sizes", "135m", "--work", str(work), "--out", str(out), "--keep", "--resume"]) == 0
    assert ran == ["drafter", "build"]
    rows = json.loads(out.read_text())["rows"]
    total = rows[-1]
    assert total["stage"] == "total" and total["seconds"] == 5.0 and total["disk_bytes"] == 25
    ran.clear()
    bench_scale.main(["--sizes", "135m", "--work", str(work), "--out", str(out), "--keep", "--resume"])
    assert ran == []  # a finished size is not run again
    fail_at.add("build")
    with pytest.raises(RuntimeError):
        bench_scale.main(["--sizes", "0.5b", "--work", str(work), "--out", str(out), "--keep", "--resume"])
    import shutil

    shutil.rmtree(work / "scale-0_5b")  # its outputs gone (another machine): its stages are measured again
    ran.clear()
    fail_at.clear()
    assert bench_scale.main(["--sizes", "135m,0.5b", "--work", str(work), "--out", str(out), "--keep", "--resume"]) == 0
    assert ran == list(bench_scale.STAGES)
    rows = json.loads(out.read_text())["rows"]
    assert [r["stage"] for r in rows if r["size"] == "0.5b"] == [*bench_scale.STAGES, "total"]


def test_a_stage_process_reports_its_private_memory_beside_its_rss(tmp_path):
    import os
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 << 20); import time; time.sleep(1.0)"])
    peak = bench_scale.AnonPeak(holder.pid)
    os.waitid(os.P_PID, holder.pid, os.WEXITED | os.WNOWAIT)
    anon = peak.stop()
    _, status, usage = os.wait4(holder.pid, 0)
    if anon is None:
        pytest.skip("no /proc/<pid>/status RssAnon on this system")
    assert 64 << 20 <= anon <= usage.ru_maxrss * 1024
    assert bench_scale.anon_bytes(2 ** 22 + 12345) is None  # no such process: nothing, not an error
