"""The host sampler's cost per step, its nucleus search against a plain full sort, side by side in one run.

    python -m server.bench.sampler [--vocab 49152] [--rows 11] [--threads 1] [--out bench/sampler-cpu.json]

A step's logits for `--rows` rows (the mean batch of `make solve MODEL=mix`) under the mix's sampling
(temperature 0.7, top-p 0.95, top logprobs 5), in two shapes: peaked rows (the nucleus within the 256
candidates, as most of a solve's rows are) and flat rows (a nucleus of thousands of tokens). For each, the
median of `--repeats` calls of `server.embedded.sampler.sample` as it is, and with its wider search off
(WIDER_CANDIDATES set past the vocabulary: the whole row sorted, as before it). The draws are the same.
`--threads 1` is what the llama.cpp runner gives torch (its own threads run the forward).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import torch

    from aimo_spec.protocol import SamplingParams
    from server.embedded import sampler

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(args.rows, args.vocab, generator=g)
    peaked[:, :30] += 12
    shapes = {"peaked": peaked, "flat": torch.randn(args.rows, args.vocab, generator=g) * 3}
    params = [SamplingParams(temperature=0.7, top_p=0.95, top_k=0, top_logprobs=5)] * args.rows

    def timed(logits: torch.Tensor) -> tuple[float, list[int]]:
        seconds, tokens = [], []
        for _ in range(args.repeats):
            gens = [sampler.make_generator(i) for i in range(args.rows)]
            t0 = time.perf_counter()
            tokens, _ = sampler.sample(logits, params, gens)
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds) * 1e3, tokens

    wider = sampler.WIDER_CANDIDATES
    rows = {}
    for name, logits in shapes.items():
        ms, tokens = timed(logits)
        sampler.WIDER_CANDIDATES = args.vocab + 1  # off: past the candidates, the whole row is sorted
        try:
            ms_full, tokens_full = timed(logits)
        finally:
            sampler.WIDER_CANDIDATES = wider
        rows[name] = {"ms_per_step": round(ms, 3), "ms_per_step_full_sort": round(ms_full, 3),
                      "speedup": round(ms_full / ms, 2), "same_draws": tokens == tokens_full}
        print(f"{name:>6} rows: {ms:7.2f} ms a step, {ms_full:7.2f} ms with the whole row sorted "
              f"({ms_full / ms:.2f}x); same draws: {tokens == tokens_full}")
    if args.out:
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, torch threads {args.threads}",
            "torch": torch.__version__, "vocab": args.vocab, "rows": args.rows, "repeats": args.repeats,
            "wider_candidates": wider, "shapes": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
