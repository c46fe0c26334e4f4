"""The host sampler (server/embedded/sampler.py): a row's draw depends on its logits, parameters and
generator only, whichever rows share its batch (the batched softmax and top-k give each row the
numbers it gets alone)."""

from __future__ import annotations

import torch

from aimo_spec.protocol import SamplingParams
from server.embedded.sampler import draw, make_generator, row_distribution, sample


def _alone(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One row's draw from its own 1-D logits (softmax and top-k of that row only)."""
    return int(logits.argmax()) if p.temperature == 0 else draw(*row_distribution(logits, p), gen)


def test_a_batch_draws_what_each_row_draws_alone():
    g = torch.Generator().manual_seed(0)
    vocab = 5000
    logits = torch.randn(24, vocab, generator=g) * torch.linspace(0.5, 4, 24).unsqueeze(1)
    logits[::3, :7] += 9  # peaked rows (small nucleus) beside flat ones (nucleus past the candidates)
    logits = logits.to(torch.bfloat16).float()  # the model's rounding: ties among probabilities
    kinds = [SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0, top_k=20),
             SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_k=50, top_p=0.9),
             SamplingParams(temperature=1.3)]
    params = [kinds[i % len(kinds)] for i in range(len(logits))]
    for step in range(5):
        together, _ = sample(logits, params, [make_generator(100 * step + i) for i in range(len(logits))])
        alone = [_alone(logits[i], p, make_generator(100 * step + i)) for i, p in enumerate(params)]
        assert together == alone
        logits = logits.roll(1, 0)


def test_a_seed_past_64_bits_folds_as_torch_folds_a_negative_one():
    """A generator's seed is 64 bits: larger seeds are taken modulo 2**64 (they raised before), which is
    what torch itself does with a negative one, so every seed in range keeps its stream."""
    def draws(seed):
        return torch.rand(4, generator=make_generator(seed))

    def torch_draws(seed):
        return torch.rand(4, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draws(2 ** 64 + 5), torch_draws(5)) and torch.equal(draws(-5), torch_draws(-5))
    assert torch.equal(draws(2 ** 64 - 5), torch_draws(-5)) and torch.equal(draws(123), torch_draws(123))


def _nucleus_by_full_sort(logits: torch.Tensor, p: SamplingParams) -> dict[int, float]:
    """The rule written plainly: the whole row sorted, the smallest prefix whose mass reaches top_p."""
    probs = torch.softmax(logits.float() / p.temperature, -1)
    vals, ids = torch.sort(probs, descending=True)
    keep = int(torch.searchsorted(torch.cumsum(vals, -1), torch.tensor([p.top_p]))) + 1
    vals, ids = vals[:keep], ids[:keep]
    return dict(zip(ids.tolist(), (vals / vals.sum()).tolist()))


def test_a_nucleus_past_the_candidates_is_the_one_a_full_sort_gives():
    """Nuclei narrower than CANDIDATES, between it and WIDER_CANDIDATES, and wider than both (a flat row):
    the same tokens with the same probabilities as sorting the whole row."""
    from server.embedded.sampler import CANDIDATES, WIDER_CANDIDATES

    g = torch.Generator().manual_seed(3)
    vocab = 3 * WIDER_CANDIDATES
    widths = []
    for scale in (8.0, 3.0, 2.0, 1.0, 0.1):
        logits = torch.randn(vocab, generator=g) * scale  # float32: no ties (where tied tokens fall is any order's)
        p = SamplingParams(temperature=0.7, top_p=0.95)
        ids, probs = row_distribution(logits, p)
        got = dict(zip(ids.tolist(), probs.tolist()))
        want = _nucleus_by_full_sort(logits, p)
        assert got.keys() == want.keys() and all(abs(got[i] - want[i]) < 1e-6 for i in want)
        widths.append(len(want))
    assert min(widths) < CANDIDATES and max(widths) > WIDER_CANDIDATES
    assert any(CANDIDATES < w <= WIDER_CANDIDATES for w in widths), widths
