"""Test doubles of tensorrtllm_backend, built from the upstream snapshot (tests/upstream/trtllm_1_2.json).

`write_templates(root)` writes an `all_models/inflight_batcher_llm` folder whose config.pbtxt files hold
every `${...}` placeholder of the upstream templates, in the same kind of position (inside a string, or
bare where a number, a bool or a data type goes: those make the file unparseable when left), and each
model's inputs with their data types. The layout around them is generic, not upstream's text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from upstream import snapshot

PYTHON_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")


def template_text(model: str, drop: tuple[str, ...] = (), extra_bare: tuple[str, ...] = (),
                  extra_quoted: tuple[str, ...] = ()) -> str:
    facts = snapshot()["triton"]["templates"][model]
    bare = [k for k in facts["bare_placeholders"] if k not in drop] + list(extra_bare)
    quoted = [k for k in facts["placeholders"] if k not in facts["bare_placeholders"] and k not in drop]
    quoted += list(extra_quoted)
    lines = [f'name: "{model}"']
    typed = {t["data_type"] for t in facts["inputs"].values()}
    lines += [f"setting_{k}: ${{{k}}}" for k in bare if f"${{{k}}}" not in typed]
    lines.append("input [")
    entries = []
    for name, t in facts["inputs"].items():
        dtype = t["data_type"]
        if dtype.startswith("${") and dtype[2:-1] in drop:
            dtype = "TYPE_FP32"
        entries.append(f'  {{ name: "{name}" data_type: {dtype} dims: [ -1 ]{" optional: true" if t["optional"] else ""} }}')
    lines += [",\n".join(entries), "]"]
    lines += [f'parameters: {{ key: "{k}" value: {{ string_value: "${{{k}}}" }} }}' for k in quoted]
    return "\n".join(lines) + "\n"


def write_templates(root: Path, drop: Optional[tuple[str, str]] = None, extra_bare: tuple[str, str] = ("", ""),
                    extra_quoted: tuple[str, str] = ("", "")) -> Path:
    """The templates folder; `drop` (model, key) removes a placeholder, `extra_*` (model, key) adds one."""
    out = root / "inflight_batcher_llm"
    for model in snapshot()["triton"]["templates"]:
        (out / model / "1").mkdir(parents=True)
        text = template_text(model, drop=(drop[1],) if drop and drop[0] == model else (),
                             extra_bare=(extra_bare[1],) if extra_bare[0] == model else (),
                             extra_quoted=(extra_quoted[1],) if extra_quoted[0] == model else ())
        (out / model / "config.pbtxt").write_text(text)
        if model in PYTHON_MODELS:
            (out / model / "1" / "model.py").write_text("# the backend's python model\n")
    return out
