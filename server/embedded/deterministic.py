"""Deterministic mode: a request's tokens depend on the request alone, not on what else runs.

Batching changes floating-point results: a GEMM over 8 rows reduces in another order than over one
(measured here on the CPU: rows of an M=1 product differ from the same rows in M=2, 3 or 5), an
attention over the batch's longest sequence has other shapes than over a row's own, and a prefix
reused from another request's KV was computed in other chunks than a fresh prefill would use. So at
temperature 0 the same prompt can give other text alone than beside 15 others (issue 33 measured 11
of 16). SGLang's deterministic inference and vLLM's batch-invariant mode fix the kernels; this
engine fixes the shapes instead, which holds for any BLAS and any device:

- **decode one row at a time** (`decode_rows`): every row is an M=1 forward over its own length,
  exactly what it would be alone. The price is the batching gain of the decode GEMMs (measured in
  `python -m server.bench.deterministic`, docs/serving.md);
- **prefill in aligned chunks** of `CHUNK` positions: the KV of positions [kC, kC + C) is always
  computed by the same chunk over the same prefix, so it is a function of the tokens alone;
- **reuse only such KV**: a kept prefix counts up to the last full aligned chunk its own prefill
  wrote (`canonical`); positions written by decode steps or a partial last chunk are recomputed;
- no speculative decoding (a verify of several tokens is another shape again).

Sampling needs nothing: greedy is an argmax per row, and seeded sampling draws from each request's
own generator (already independent of the batch).
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK = 16  # aligned prefill chunk: the reuse granularity (a prompt re-prefills at most 15 tokens it could reuse)


def whole_chunks(n: int) -> int:
    """The first `n` positions cut to whole aligned chunks: the canonical part of a prefill of `n`
    tokens from 0, and how much of an `n`-token matched prefix a new request may keep."""
    return n // CHUNK * CHUNK


def decode_rows(runner: Any, token_ids: list[int], positions: list[int], hidden: bool = False) -> Any:
    """`runner.decode` for slots 0..n-1, each row alone (M=1 over its own length): logits [n, V]
    (and hidden [n, H]) equal to what each row gives without the others."""
    outs = [runner.decode([t], [p], hidden=hidden, first_slot=i) for i, (t, p) in enumerate(zip(token_ids, positions))]
    if hidden:
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
    return torch.cat(outs)
