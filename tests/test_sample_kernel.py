"""The fused device draw (server/embedded/sample_kernel.py, through sampler.draw_fused) against the eager
rule it replaces (sampler.reference_draw): the same tokens for greedy, tempered, top-k and top-p rows,
mixed in one batch, and a row's token independent of its batch.

On CUDA the kernels run compiled; on a CPU with Triton installed under its interpreter (conftest.py
sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from aimo_spec.protocol import SamplingParams
from server.embedded.sampler import draw_fused, gumbel_noise, reference_draw

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not (CUDA or importlib.util.find_spec("triton")),
                                reason="needs CUDA or Triton's interpreter")
DEVICE = "cuda" if CUDA else "cpu"
VOCAB = 9000  # over two of the kernel's blocks (sample_kernel.BLOCK), and not a multiple of one

ROWS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=7), SamplingParams(temperature=0.9, top_k=40, top_p=0.8),
        SamplingParams(temperature=2.0, top_p=0.999), SamplingParams(temperature=0.0, top_p=0.9)]


def _logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=g) * 3
    x[:, 5] = x[:, 9] = x.max() + 1  # a tie for the first place: the first of them is the greedy token
    return x.to(DEVICE)


@pytest.mark.parametrize("truncated", [False, True])
def test_the_fused_draw_gives_the_eager_tokens(truncated):
    rows = ROWS if truncated else [p for p in ROWS if not (p.top_k or p.top_p < 1.0)]
    logits = _logits(len(rows), 1)
    for step in (0, 1, 57):
        seeds = [3 + i + (i << 40) for i in range(len(rows))]  # past 32 bits: both halves of the seed mix in
        want = reference_draw(logits, rows, seeds, [step] * len(rows))
        got = draw_fused(logits, rows, seeds, [step] * len(rows))
        assert got.dtype == torch.long and got.tolist() == want.tolist(), step
    greedy = [i for i, p in enumerate(rows) if p.temperature == 0]
    assert all(got[i] == 5 for i in greedy)


def test_a_fused_draw_depends_on_its_row_alone():
    logits = _logits(len(ROWS), 2)
    seeds, steps = list(range(100, 100 + len(ROWS))), list(range(len(ROWS)))
    batch = draw_fused(logits, ROWS, seeds, steps).tolist()
    for i, p in enumerate(ROWS):
        assert draw_fused(logits[i:i + 1], [p], seeds[i:i + 1], steps[i:i + 1]).tolist() == [batch[i]]


def test_the_fused_draw_keeps_to_the_nucleus():
    """Over many seeds, a top-p row draws only inside its nucleus and a top-k row only its k best."""
    logits = _logits(1, 3)
    nucleus, topk = SamplingParams(temperature=1.0, top_p=0.3), SamplingParams(temperature=1.0, top_k=3)
    n = 64
    probs, order = torch.softmax(logits[0].float().cpu(), -1).sort(descending=True, stable=True)
    inside = order[: int(((probs.cumsum(0) - probs) < 0.3).sum())].tolist()
    for p, allowed in ((nucleus, inside), (topk, order[:3].tolist())):
        got = draw_fused(logits.repeat(n, 1), [p] * n, list(range(n)), [0] * n).tolist()
        assert set(got) <= set(allowed) and len(set(got)) > 1, p


def test_the_kernel_noise_is_the_eager_noise():
    """Its integers bit for bit: a temperature-1 draw over logits of zeros is the argmax of the noise."""
    logits = torch.zeros(4, VOCAB, device=DEVICE)
    seeds, steps = [0, 1, (1 << 62) - 1, 12345 << 33], [0, 7, 1 << 20, 3]
    p = SamplingParams(temperature=1.0)
    want = gumbel_noise(torch.tensor(seeds, device=DEVICE), torch.tensor(steps, device=DEVICE),
                        torch.arange(VOCAB, device=DEVICE).view(1, -1)).argmax(-1)
    assert draw_fused(logits, [p] * 4, seeds, steps).tolist() == want.tolist()


@pytest.mark.parametrize("truncated", [False, True])
def test_the_fused_acceptance_gives_the_eager_verdicts(truncated):
    """Kept drafts and next tokens as speculative.reference_accept decides them, for drafts that are the
    target's likely tokens, unlikely ones and out of the nucleus, at several steps."""
    from server.embedded.speculative import accept_fused, reference_accept

    rows = ROWS if truncated else [p for p in ROWS if not (p.top_k or p.top_p < 1.0)]
    n, L = len(rows), 3
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(n, L + 1, VOCAB, generator=g) * 2).to(DEVICE)
    order = logits.argsort(dim=-1, descending=True, stable=True)
    kinds = [order[:, :L, 0], order[:, :L, 1], order[:, :L, 50],
             torch.randint(0, VOCAB, (n, L), generator=g).to(DEVICE)]
    verdicts = set()
    for step, drafts in enumerate(kinds):
        drafts = drafts.clone()
        drafts[::2, 1] = order[::2, 1, 0]  # mixed runs: a likely draft after an unlikely one
        seeds = [11 + i + (i << 35) for i in range(n)]
        want = reference_accept(logits, drafts, rows, seeds, [step] * n)
        got = accept_fused(logits, drafts, rows, seeds, [step] * n)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist(), step
        verdicts |= set(got[0].tolist())
    assert {0, L} <= verdicts  # rows rejected at once and rows that kept every draft


def test_a_fused_kernel_that_fails_gives_way_to_the_eager_rule(monkeypatch, capsys):
    """A kernel this GPU's Triton cannot build: the draw and the acceptance fall back to the eager rules
    (said once on stderr), and stay there for the process."""
    from server.embedded import sampler, speculative

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(sampler, "_FUSED_FAILED", [])
    monkeypatch.setattr(sampler, "draw_fused", broken)
    monkeypatch.setattr(speculative, "accept_fused", broken)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # take the CUDA branch on any device
    sampler.fused_sampler.cache_clear()
    logits = _logits(len(ROWS), 6).cpu()
    seeds, steps = list(range(len(ROWS))), [0] * len(ROWS)
    drafts = logits[:, :3].argsort(dim=-1).long()
    try:
        for first in ("draw", "accept"):
            sampler._FUSED_FAILED.clear()
            sampler.fused_sampler.cache_clear()
            for call in (first, "accept" if first == "draw" else "draw"):
                if call == "draw":
                    got = sampler.draw_device(logits, ROWS, seeds, steps)
                    assert got.tolist() == sampler.reference_draw(logits, ROWS, seeds, steps).tolist()
                else:
                    wide = logits.view(len(ROWS), 1, VOCAB).repeat(1, 4, 1)
                    got = speculative.accept_device(wide, drafts, ROWS, seeds, steps)
                    want = speculative.reference_accept(wide, drafts, ROWS, seeds, steps)
                    assert [x.tolist() for x in got] == [x.tolist() for x in want]
            assert not sampler.fused_sampler()
            assert capsys.readouterr().err.count("fused sampling kernels failed") == 1, first
    finally:
        sampler.fused_sampler.cache_clear()


def test_the_noise_stays_finite_at_the_hash_s_largest_value():
    """Token 1452045 at seed 0, step 0 hashes to the top of the uniform's range: with 24 bits its
    uniform rounded to exactly 1.0 and its noise was infinite (that token drawn whatever its logit);
    with 23 bits it stays below 1, in the kernels as in the eager rule."""
    from server.embedded.sampler import hashed_uniform

    seed, step, token = torch.tensor([0]), torch.tensor([0]), torch.tensor([[1452045]])
    u = hashed_uniform(seed, step, token)
    assert 0 < float(u) < 1 and float(u) == 1 - 2 ** -24
    assert torch.isfinite(gumbel_noise(seed, step, token)).all()
    logits = torch.full((1, 1452046), -30.0, device=DEVICE)
    logits[0, 7] = 30.0  # all the mass on token 7: a finite noise cannot lift 1452045 over it
    p = SamplingParams(temperature=1.0)
    assert draw_fused(logits, [p], [0], [0]).tolist() == [7]
    assert reference_draw(logits, [p], [0], [0]).tolist() == [7]


def test_the_steps_build_their_sampling_kernels_at_warm_up(monkeypatch):
    """The engine warms its step's sampling kernels at start on CUDA (without a GPU: the kernels under the
    interpreter, the CUDA branch taken on the CPU): the draw's and, drafting, the acceptance's."""
    from types import SimpleNamespace

    from server.embedded import sample_kernel, sampler
    from server.embedded.sequence import EngineStats
    from server.embedded.speculative import SpecConfig
    from server.embedded.steps import PlainStep, SpeculativeStep

    calls = []
    for name in ("draw_full", "draw_sorted", "accept"):
        real = getattr(sample_kernel, name)
        monkeypatch.setattr(sample_kernel, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    monkeypatch.setattr(sampler, "_FUSED_FAILED", [])
    if not CUDA:  # the CUDA branch on the CPU, the kernels under the interpreter
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    sampler.fused_sampler.cache_clear()
    runner = SimpleNamespace(device=torch.device(DEVICE), graphs=False, decode=None)
    try:
        PlainStep(runner, EngineStats(), lambda *a: False, overlap=False).warm_up(VOCAB)
        assert calls == ["draw_full", "draw_sorted"]
        SpeculativeStep(runner, EngineStats(), lambda *a: False, None, None, SpecConfig(3), 4).warm_up(VOCAB)
        assert calls[2:] == ["draw_full", "draw_sorted", "accept", "accept"] and not sampler._FUSED_FAILED
    finally:
        sampler.fused_sampler.cache_clear()


@pytest.mark.parametrize("max_chunks", [1, 2])
def test_chunks_of_several_blocks_and_ties_across_blocks(monkeypatch, max_chunks):
    """With fewer chunks a row than blocks, a program's loop runs over several blocks (its running best,
    its rescaled mass): the same tokens and verdicts, and equal maxima in three blocks give the first."""
    from server.embedded import sample_kernel
    from server.embedded.speculative import accept_fused, reference_accept

    monkeypatch.setattr(sample_kernel, "MAX_CHUNKS", max_chunks)
    assert sample_kernel.chunks(VOCAB)[0] > sample_kernel.BLOCK
    n, L = len(ROWS), 3
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(n, L + 1, VOCAB, generator=g) * 2).to(DEVICE)
    top = logits.max() + 1
    for t in (8192 + 5, 5, 4096 + 5):  # the first of them is every greedy row's token
        logits[:, :, t] = top
    seeds, steps = [21 + i for i in range(n)], [3] * n
    assert draw_fused(logits[:, 0], ROWS, seeds, steps).tolist() == reference_draw(logits[:, 0], ROWS, seeds,
                                                                                     steps).tolist()
    plain = [p for p in ROWS if not (p.top_k or p.top_p < 1.0)]
    for rows in (ROWS, plain):
        k = len(rows)
        drafts = torch.tensor([[5, 4096 + 5, 7]] * k, device=DEVICE)
        got = accept_fused(logits[:k], drafts, rows, seeds[:k], steps[:k])
        want = reference_accept(logits[:k], drafts, rows, seeds[:k], steps[:k])
        assert [x.tolist() for x in got] == [x.tolist() for x in want]
    greedy = [i for i, p in enumerate(ROWS) if p.temperature == 0]
    assert all(draw_fused(logits[:, 0], ROWS, seeds, steps)[i] == 5 for i in greedy)
