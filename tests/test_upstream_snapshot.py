"""The upstream snapshot itself: every fact names the file, repository and commit it came from."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from upstream import SNAPSHOT, snapshot

UPSTREAM = Path("/tmp/upstream")  # where extract.py's inputs were kept (absent on a fresh machine)


def test_every_source_is_named_by_repo_path_and_commit():
    data = snapshot()
    assert data["generated_by"] == "tests/upstream/extract.py"
    repos = {s["repo"] for s in data["sources"]}
    assert repos == {"NVIDIA/TensorRT-LLM", "triton-inference-server/tensorrtllm_backend"}
    for s in data["sources"]:
        assert re.fullmatch(r"[0-9a-f]{40}", s["commit"]), s
        assert s["path"] and s["kind"] in ("full", "excerpt", "condensed") and len(s["sha256"]) == 64
    assert any("1.2.0rc7" in line or "v1.2.x tag" in line for line in data["not_read"])


def test_the_facts_the_contract_tests_use_are_there():
    data = snapshot()
    assert {"trtllm-build", "quantize.py", "convert_checkpoint.py"} <= set(data["commands"])
    assert data["plugin_defaults"]["tokens_per_block"] == 32
    assert {"Request", "SamplingConfig", "OutputConfig", "ExecutorConfig", "KvCacheConfig"} <= set(
        data["executor"]["keywords"])
    assert set(data["triton"]["templates"]) == {"tensorrt_llm", "preprocessing", "postprocessing", "ensemble",
                                                "tensorrt_llm_bls"}


@pytest.mark.skipif(not (UPSTREAM / "manifest.json").is_file(), reason="no upstream source tree at /tmp/upstream")
def test_extract_reproduces_the_committed_snapshot(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("extract", SNAPSHOT.with_name("extract.py"))
    extract = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extract)
    out = tmp_path / "snap.json"
    assert extract.main(["--upstream", str(UPSTREAM), "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == snapshot()
