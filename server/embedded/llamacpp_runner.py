"""The embedded engine's forward on llama.cpp: a GGUF model behind the runner interface, for CPUs.

On a CPU the decode step of a small model is bound by bytes and by the cost of each operation;
llama.cpp's quantized kernels (Q8_0, Q4_x: blocks of 32 weights with their own scale) read a half or
a quarter of bf16's bytes and run about 4x faster than PyTorch's eager step on the same 2-core
machine (issue 23). So the engine keeps everything it does itself (scheduling, prefix reuse,
sampling, stop strings, streaming) and hands only the forward and the KV cache to llama.cpp, through
llama-cpp-python's low-level bindings (`llama_decode` over a batch of sequences).

How the runner interface maps onto llama.cpp: slot i is llama.cpp sequence i, with its own KV
stream of `max_seq_len` cells (allocated whole, as the GPU runner's static cache). `copy` moves a
sequence's cells through llama.cpp's per-sequence state (`llama_state_seq_get_data` / `set_data`: the
cells it holds, so the cost follows its length) and removes the tail; `swap` reads both states, then
writes each into the other. (`llama_memory_seq_cp` copies between streams only whole: a
deferred copy of all `max_seq_len` cells, 16 ms a copy for SmolLM2 at 4096 cells on 2 cores against 5.5
for a 100-token state, measured; in a TIR run every request that ends or resumes swaps slots, and
those copies took a third of the engine's time.) Slots keep their sequence ids because
llama.cpp puts only consecutive increasing sequence ids in one micro-batch: a decode step over slots
0..n-1 is one pass over the weights only while they are sequences 0..n-1 (exchanging ids in a table
instead made every step after a request finished about 1.6x slower, measured). `prefill` first
removes the slot's cells from `start` on (what follows a reused prefix), and `decode` does the same
where a row's position was written before, so a slot never holds two cells at one position
(llama.cpp refuses a batch that would). Not the unified cache (`kv_unified`, where a copy only tags
cells): measured with llama-cpp-python 0.3.36, a decode row placed in cells freed by another
sequence's removal got wrong logits (tests/test_llamacpp_runner.py holds the runner to the fresh
result). Every call returns float32 logits as a torch tensor copied out of llama.cpp's buffer. Not
available: `verify` and hidden states (no speculative decoding), the FP8 cache, GPUs.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch

from server.embedded.base_runner import check_capacity

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h at llama-cpp-python 0.3.36's commit)


def _llama() -> Any:
    try:
        import llama_cpp
        from llama_cpp import _logger
    except ImportError as e:  # the optional CPU backend: said with how to get it
        raise ImportError("the llama.cpp runner needs llama-cpp-python (requirements/embedded.txt, "
                          "`make setup`)") from e
    _logger.set_verbose(False)  # llama.cpp's errors only (it logs every tensor it loads)
    return llama_cpp


@dataclass
class LlamaCppModel:
    """A GGUF file loaded by llama.cpp, with what the engine reads from a model: `config` (the end-of-
    sequence ids, vocabulary size, model type) and `path`."""

    path: Path
    handle: Any  # llama_model*
    config: SimpleNamespace
    contexts: int = 0  # live runners on this model: it is freed only when none is left

    @classmethod
    def load(cls, path: str | Path) -> "LlamaCppModel":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"llama.cpp runner: no GGUF file at {path}")
        ll = _llama()
        ll.llama_backend_init()
        params = ll.llama_model_default_params()
        handle = ll.llama_model_load_from_file(str(path).encode(), params)
        if not handle:
            raise ValueError(f"llama.cpp runner: {path}: llama.cpp could not load this GGUF file")
        vocab = ll.llama_model_get_vocab(handle)
        eos = {ll.llama_vocab_eos(vocab), ll.llama_vocab_eot(vocab)} - {-1}
        config = SimpleNamespace(model_type="gguf", vocab_size=ll.llama_vocab_n_tokens(vocab),
                                 eos_token_id=sorted(eos), n_ctx_train=ll.llama_model_n_ctx_train(handle))
        return cls(path, handle, config)

    def __del__(self) -> None:
        if getattr(self, "handle", None) and not self.contexts:
            try:
                _llama().llama_model_free(self.handle)
            except (ImportError, TypeError, AttributeError):  # at interpreter exit, llama_cpp may be torn down
                pass
            self.handle = None


class LlamaCppRunner:
    """Slots 0..num_slots-1 as llama.cpp sequences of one context; see the module docstring."""

    def __init__(self, model: LlamaCppModel, num_slots: int, max_seq_len: int, threads: Optional[int] = None,
                 batch_tokens: int = 512, kv_cache_dtype: str = "auto"):
        if kv_cache_dtype != "auto":
            raise ValueError(f"llama.cpp runner: kv_cache_dtype {kv_cache_dtype!r} is not supported (auto only)")
        if not 0 < num_slots <= min(batch_tokens, MAX_SEQUENCES):  # a decode step's rows fit one batch
            raise ValueError(f"llama.cpp runner: {num_slots} slots (max_batch_size) is not in 1..{MAX_SEQUENCES} "
                             f"(llama.cpp's sequences) and at most batch_tokens {batch_tokens}")
        ll = self.ll = _llama()
        self.model = model
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.vocab_size = model.config.vocab_size
        threads = threads or max(1, os.cpu_count() or 1)
        params = ll.llama_context_default_params()
        params.n_ctx = num_slots * max_seq_len  # one stream of max_seq_len cells a slot
        params.n_batch = params.n_ubatch = batch_tokens
        params.n_seq_max = num_slots
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        self.ctx = ll.llama_init_from_model(model.handle, params)
        if not self.ctx:
            raise ValueError(f"llama.cpp runner: no context of {params.n_ctx} tokens for {model.path}")
        model.contexts += 1
        self.memory = ll.llama_get_memory(self.ctx)
        self.batch_tokens = batch_tokens
        self.batch = ll.llama_batch_init(batch_tokens, 0, 1)

    def close(self) -> None:
        """Free the context and its KV cache (the engine does at shutdown; idempotent)."""
        if getattr(self, "ctx", None):
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ctx = None
            self.model.contexts -= 1

    def __del__(self) -> None:
        try:
            self.close()
        except (TypeError, AttributeError):  # at interpreter exit, llama_cpp's bindings may be torn down already
            pass

    # ---- cache management
    def ensure_capacity(self, length: int) -> None:
        check_capacity(length, self.max_seq_len)

    def _remove(self, slot: int, start: int = 0) -> None:
        if not self.ll.llama_memory_seq_rm(self.memory, slot, start, -1):  # recurrent models cannot cut a sequence
            raise RuntimeError(f"llama.cpp runner: could not remove positions {start}.. of slot {slot} "
                               f"({self.model.path.name}: a model whose state cannot be cut back)")

    def _state(self, slot: int) -> tuple[Any, int]:
        """(buffer, bytes) of the slot's sequence state: its cells' K/V and positions."""
        size = self.ll.llama_state_seq_get_size(self.ctx, slot)
        buf = (ctypes.c_uint8 * max(1, size))()
        got = self.ll.llama_state_seq_get_data(self.ctx, buf, size, slot)
        if got != size:  # llama.cpp returns 0 where it failed: never write a partial or empty state
            raise RuntimeError(f"llama.cpp runner: read {got} of {size} bytes of slot {slot}'s state")
        return buf, got

    def _restore(self, slot: int, state: tuple[Any, int], length: int) -> None:
        """Slot := a state read by `_state`, cut to its first `length` positions."""
        self._remove(slot)
        buf, size = state
        if size and not self.ll.llama_state_seq_set_data(self.ctx, buf, size, slot):
            raise RuntimeError(f"llama.cpp runner: could not write {size} bytes of state into slot {slot} "
                               "(no room in its KV stream)")
        self._remove(slot, length)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot dst := slot src's first `length` positions."""
        if length <= 0 or src == dst:
            return
        self._restore(dst, self._state(src), length)

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the first `length` positions of two slots (what follows is removed)."""
        if length <= 0 or a == b:
            return
        state_a, state_b = self._state(a), self._state(b)
        self._restore(a, state_b, length)
        self._restore(b, state_a, length)

    # ---- forward
    def _run(self, rows: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """llama_decode over (token, position, slot, wants logits) rows, at most one batch; the logits
        of the rows that want them, in order, as float32 [n, V]."""
        if len(rows) > self.batch_tokens:
            raise ValueError(f"llama.cpp runner: {len(rows)} tokens in one step, the batch holds {self.batch_tokens}")
        b = self.batch
        b.n_tokens = len(rows)
        for i, (tok, pos, seq, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            why = "no room in the KV cache" if rc == 1 else f"llama_decode returned {rc}"
            raise RuntimeError(f"llama.cpp runner: {why} ({len(rows)} tokens)")
        n = sum(1 for r in rows if r[3])
        if not n:  # a batch of prompt tokens whose logits come with a later batch
            return np.empty((0, self.vocab_size), dtype=np.float32)
        ptr = ctypes.cast(self.ll.llama_get_logits(self.ctx), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(ptr, shape=(n, self.vocab_size)).copy()

    def _prefill_logits(self, items: list[tuple[int, list[int], int]], every: bool) -> np.ndarray:
        """KV for each (slot, token_ids, start) at positions [start, start+n) of its slot, all in as few
        llama_decode calls as a batch holds; the logits of every token (`every`) or of each one's last."""
        rows: list[tuple[int, int, int, bool]] = []
        for slot, token_ids, start in items:
            self.ensure_capacity(start + len(token_ids))
            if not token_ids:
                raise ValueError(f"llama.cpp runner: prefill of no tokens (slot {slot})")
            self._remove(slot, start)
            rows += [(t, start + i, slot, every or i == len(token_ids) - 1) for i, t in enumerate(token_ids)]
        return np.concatenate([self._run(rows[lo:lo + self.batch_tokens])
                               for lo in range(0, len(rows), self.batch_tokens)])

    def prefill(self, slot: int, token_ids: list[int], start: int, hidden: bool = False) -> torch.Tensor:
        """Write KV for token_ids at positions [start, start+n) of `slot`; logits [V] of the last one."""
        _no_hidden(hidden)
        return torch.from_numpy(self._prefill_logits([(slot, list(token_ids), start)], every=False)[-1])

    def prefill_rows(self, items: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """`prefill` of several slots in one llama_decode (more where they exceed a batch): (slot,
        token_ids, start) each; logits [n, V] of each one's last token, in order. A prefill is a pass
        over the weights whatever its length, and the samples of one problem are admitted together,
        each with one token to compute past the prompt copied from the first: one pass serves them all
        (llama.cpp groups a batch's sequences into micro-batches of equal token counts)."""
        return torch.from_numpy(self._prefill_logits(items, every=False))

    def score(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        """Prefill from position 0; logits [n, V] after every token (teacher forcing)."""
        return torch.from_numpy(self._prefill_logits([(slot, list(token_ids), 0)], every=True))

    def decode(self, token_ids: Any, positions: list[int], hidden: bool = False) -> torch.Tensor:
        """One token for each slot 0..n-1 at its position; logits [n, V]."""
        _no_hidden(hidden)
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        for slot, pos in enumerate(positions):
            self.ensure_capacity(pos + 1)
            if self.ll.llama_memory_seq_pos_max(self.memory, slot) >= pos:  # a position written before
                self._remove(slot, pos)
        return torch.from_numpy(self._run([(int(t), p, s, True) for s, (t, p) in enumerate(zip(token_ids, positions))]))

    def verify(self, token_rows: Any, starts: list[int], hidden: bool = False) -> Any:
        raise NotImplementedError("llama.cpp runner: no verify step (speculative decoding runs on the torch runners)")


def _no_hidden(hidden: bool) -> None:
    if hidden:
        raise NotImplementedError("llama.cpp runner: no hidden states (the drafter reads them: torch runners only)")
