"""The quantize stage's llama.cpp formats (gguf_q8_0): export by llama.cpp's converter, priced like the others.

ModelOpt's formats are checkpoints the torch runners load; a gguf_* format is a GGUF folder
(`model.gguf` + tokenizer files, trtbuild/gguf_export.py) that only the llama.cpp runner serves, on
the CPU. Its price therefore comes from that runner, the way the build prices the FP8 KV cache
(trtbuild/kv_price.py): the bf16 reference's recorded greedy replies teacher-forced through
`LlamaCppRunner.score`, KL and top-1 agreement against the bf16 model's logits on the same tokens,
and the GGUF model's own greedy replies (prefill + decode steps) for reply length and code calls.
Where llama.cpp's vocabulary and the HF model's differ in size (padded embedding rows), both sides
are cut to the shorter before the softmax, so the distributions compared are over the same tokens.
There is no calibration (Q8_0 is round-to-nearest per block of 32) and no reload check against
rounding bounds: the teacher-forced price is the check.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from aimo_spec.recipe import Recipe
from trtbuild import manifest as mf
from trtbuild.stages import SetupError

OUTTYPES = {"gguf_q8_0": "q8_0"}  # recipe format -> llama.cpp converter's --outtype
STAGE = "quantize"


def require() -> None:
    """Fail before any work, in one line naming `make setup`, where llama.cpp's parts are missing."""
    from trtbuild.gguf_export import CONVERTER_ENV, find_converter

    if find_converter() is None:
        raise SetupError("gguf formats need llama.cpp's converter (convert_hf_to_gguf.py), which is not set up; "
                         f"run `make setup` (or set {CONVERTER_ENV})")
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        raise SetupError(f"gguf formats need llama-cpp-python, which is not importable here ({e}); "
                         "run `make setup`") from None


def _cut(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    return logits[..., :vocab].float().log_softmax(-1)


def hf_logprobs(model: Any, vocab: int) -> Callable[[list[int], list[int]], torch.Tensor]:
    """The reference's teacher-forced log-probabilities over the first `vocab` tokens."""

    @torch.no_grad()
    def lp(prompt: list[int], reply: list[int]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([prompt + reply], device=model.device)).logits[0]
        return _cut(logits[len(prompt) - 1: len(prompt) + len(reply) - 1], vocab)

    return lp


def runner_logprobs(runner: Any, vocab: int) -> Callable[[list[int], list[int]], torch.Tensor]:
    """The GGUF model's teacher-forced log-probabilities through the llama.cpp runner's slot 0."""

    def lp(prompt: list[int], reply: list[int]) -> torch.Tensor:
        logits = runner.score(0, prompt + reply)[len(prompt) - 1: len(prompt) + len(reply) - 1]
        return _cut(logits, vocab)

    return lp


def price_gguf(gguf_dir: Path, ref: dict[str, Any], tokenizer: Any, recipe: Recipe) -> tuple[Any, dict[str, int]]:
    """(Price, vocabulary sizes) of the GGUF model in `gguf_dir` against the bf16 reference
    (`ref`: its model and recorded replies, as the quantize stage keeps them)."""
    from aimo_spec.layout import GGUF_FILE
    from server.embedded.llamacpp_runner import LlamaCppModel, LlamaCppRunner
    from trtbuild.kv_price import runner_replies
    from trtbuild.quality import price_of

    replies = ref["replies"]
    model = LlamaCppModel.load(gguf_dir / GGUF_FILE)
    length = max(len(p) for p in replies.prompts) + recipe.quality.max_new_tokens + 1
    length = -(-length // 256) * 256  # whole 256-cell streams: llama.cpp pads its context to 256s
    runner = LlamaCppRunner(model, 1, length)
    try:
        ref_vocab = int(ref["model"].get_output_embeddings().weight.shape[0])
        vocab = min(ref_vocab, runner.vocab_size)
        cand = runner_replies(runner, tokenizer, replies.prompts, recipe.quality.max_new_tokens)
        p = price_of(hf_logprobs(ref["model"], vocab), runner_logprobs(runner, vocab), replies, cand,
                     recipe.serving.code_tags)
    finally:
        runner.close()
    return p, {"hf": ref_vocab, "gguf": runner.vocab_size, "compared": vocab}


def quantize_gguf(recipe: Recipe, fmt: str, merged_dir: Path, final: Path, tmp: Path, ref: dict[str, Any]
                  ) -> dict[str, Any]:
    """tmp/gguf/ (model.gguf + tokenizer) from the merged bf16 checkpoint, and the manifest fields
    (the quantize stage renames tmp to `final` only when this returned)."""
    from aimo_spec.chat import load_tokenizer
    from trtbuild.gguf_export import export_gguf

    out = tmp / "gguf"
    mf.log(STAGE, f"{fmt}: llama.cpp's converter, --outtype {OUTTYPES[fmt]} ...")
    t = time.time()
    export_gguf(merged_dir, out, OUTTYPES[fmt])
    export_seconds = time.time() - t
    tok = load_tokenizer(merged_dir)
    mf.log(STAGE, f"{fmt}: quality vs bf16 on {len(ref['replies'].prompts)} recorded prompts (llama.cpp runner) ...")
    p, vocab = price_gguf(out, ref, tok, recipe)
    mf.log(STAGE, f"{fmt}: {p.summary()}")
    flags = p.verdict(recipe.quality)
    if flags:
        mf.log(STAGE, f"WARNING: {fmt} is outside the recipe's quality thresholds: {'; '.join(flags)}")
    return dict(
        format=fmt, quant_algo=OUTTYPES[fmt].upper(), runtime="llama.cpp",
        kv_cache_dtype="none (llama.cpp's own f16 cache; quantize.kv_cache_dtype is ModelOpt's)",
        export_seconds=round(export_seconds, 2), vocab=vocab, quality=p.as_dict(), quality_flags=flags,
        gguf_dir=str(final / "gguf"), gguf_bytes=mf.dir_size(out),
        files=mf.hash_tree(out, (".gguf", ".json", ".jinja", ".txt", ".model")),
    )
