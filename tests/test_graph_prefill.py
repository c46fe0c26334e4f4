"""GraphRunner's prefill as decode-shaped steps (EMBEDDED_PREFILL_STEP_TOKENS): a short chunk runs as the
verify form's step, T tokens of the sequence's row causal over its cache, padded to a power of two with
tokens that write the scratch slot. Held against the eager prefill of the same runner kind: the same
logits and normed hidden states up to the kernels' rounding, the same keys and values in the slot, and
nothing written outside it but the scratch slot. On a CPU under Triton's interpreter (no graphs); on CUDA
with graphs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not (CUDA or importlib.util.find_spec("triton")),
                                reason="needs CUDA or Triton's interpreter")
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("fused_ops", [True, False])
def test_short_prefill_chunks_as_steps_match_the_eager_prefill(tiny_models, monkeypatch, fused_ops):
    from server.embedded import graph_runner
    from server.embedded.graph_runner import GraphRunner
    from server.embedded.loader import load_model

    model = load_model(tiny_models["llama-tir"]).float().to(DEVICE)
    monkeypatch.delenv(graph_runner.PREFILL_STEP_ENV, raising=False)
    eager = GraphRunner(model, 4, 128, attention="split", fused_ops=fused_ops)
    monkeypatch.setenv(graph_runner.PREFILL_STEP_ENV, "48")
    steps = GraphRunner(model, 4, 128, attention="split", fused_ops=fused_ops)
    assert (eager.prefill_step_tokens, steps.prefill_step_tokens) == (0, 48)
    assert steps.group == 2  # 64 query rows a step: at most 32 tokens, so the 40-token chunk takes two steps
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 200, (125,), generator=g).tolist()
    # on CUDA the split kernel's float32 dots run as TF32 (test_decode_attention.py's tolerance); the
    # interpreter computes them in float32
    slot, tol = 2, 3e-3 if CUDA else 1e-4
    # one token (T 1, the decode graph's shape), 4 + 1 padding, 19 -> 32, 40 -> 32 + 8, then 61: past 48, eager
    for start, end in ((0, 1), (1, 5), (5, 24), (24, 64), (64, 125)):
        (la, ha), (lb, hb) = (r.prefill(slot, prompt[start:end], start, hidden=True) for r in (eager, steps))
        torch.testing.assert_close(lb, la, rtol=tol, atol=tol)
        torch.testing.assert_close(hb, ha, rtol=tol, atol=tol)
        for i in range(len(eager.k)):
            for a, b in ((eager.k[i], steps.k[i]), (eager.v[i], steps.v[i])):
                torch.testing.assert_close(b[slot, :, :end], a[slot, :, :end], rtol=3 * tol, atol=3 * tol)
                assert not b[slot, :, end:].any()  # nothing past the prompt in the sequence's slot
                others = [s for s in range(4) if s != slot]
                assert not b[others].any()  # nor in any other sequence's (padding goes to scratch, slot 4)
    # the sequence decodes on from either prefill alike
    da, db = eager.decode([prompt[-1]], [125]), steps.decode([prompt[-1]], [125])
    torch.testing.assert_close(db, da, rtol=tol, atol=tol)


def test_prefill_steps_need_the_split_kernel(tiny_models, monkeypatch):
    """The other attention forms read slots 0..B-1 by batch row, not a sequence's own slot: the setting
    is ignored there and prefill stays eager."""
    from server.embedded import graph_runner
    from server.embedded.graph_runner import GraphRunner
    from server.embedded.loader import load_model

    monkeypatch.setenv(graph_runner.PREFILL_STEP_ENV, "48")
    model = load_model(tiny_models["llama-tir"]).float().to(DEVICE)
    assert GraphRunner(model, 2, 64, attention="rows").prefill_step_tokens == 0
