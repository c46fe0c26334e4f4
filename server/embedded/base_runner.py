"""What the embedded engine's model runners share: the model's parts, slot-organised KV, and prefill.

A runner owns the forward pass and the KV cache; the engine's scheduler only moves KV between slots
(`copy`, `swap`) and its step policies call `prefill`, `decode`, `verify` and `draft_verify`. The cache
is one tensor per layer for K and for V, `[slots, kv_heads, positions, head_dim]`. Two runners
implement it: `SlotRunner` (runner.py: the model's own layers, a growing cache; the CPU's) and
`GraphRunner` (graph_runner.py: static KV, fused projections, CUDA graphs; the GPU's).

The cache holds the model's dtype, or FP8 e4m3 with one float32 scale per (slot, KV head, position)
(`kv_cache_dtype="fp8"`, decode_attention.quantize_kv): half the bytes a long-context step reads, at
a price the quality report measures. Runners write through `_kv_put` and read through `_kv_read`,
which quantize and dequantize; the GPU's split-KV attention reads the FP8 cache in place.

Prefill is the same for both: a chunk of one slot's tokens at positions [start, end), causal over the
slot's cached prefix, then the head on the last token. Only the layers differ (`_prefill_layers`).

Supported: decoder-only models with the llama layer layout (llama, qwen2, mistral). Others are
refused at load with the model type named.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

import torch

from server.embedded.decode_attention import KV_DTYPES, dequantize_kv, quantize_kv

SUPPORTED = ("llama", "qwen2", "mistral")

Draft = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (context [n, H], first [n]) -> drafts [n, L]


def check_capacity(length: int, max_seq_len: int) -> None:
    """A sequence of `length` positions fits the engine's max_seq_len (every runner, the llama.cpp one too)."""
    if length > max_seq_len:
        raise ValueError(f"sequence of {length} tokens exceeds the engine's max_seq_len {max_seq_len}")


class BaseRunner(ABC):
    """The shared half of a runner: the model's parts and head counts, the caches and moving them,
    the head, prefill, and speculative drafting then verifying."""

    def __init__(self, model: Any, num_slots: int, max_seq_len: int, kv_cache_dtype: str = "auto"):
        cfg = model.config
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"embedded runtime: kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_DTYPES}")
        self.kv_fp8 = kv_cache_dtype == "fp8"
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"embedded runtime: model_type {cfg.model_type!r} is not supported "
                             f"(supported: {SUPPORTED})")
        self.model, self.inner = model, model.model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        first = next(p for p in model.parameters() if p.is_floating_point())
        self.dtype, self.device = first.dtype, first.device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.k_scale: list[torch.Tensor] = []  # FP8 caches only: [slots, kv_heads, positions] float32
        self.v_scale: list[torch.Tensor] = []

    def _allocate_kv(self, slots: int, positions: int) -> None:
        """Zeroed K and V caches (and FP8 scales), one per layer, of `slots` slots and `positions` positions."""
        shape = (slots, self.num_kv_heads, positions, self.head_dim)
        dtype = torch.float8_e4m3fn if self.kv_fp8 else self.dtype
        n = len(self.inner.layers)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n)]
        if self.kv_fp8:
            self.k_scale = [torch.zeros(shape[:-1], dtype=torch.float32, device=self.device) for _ in range(n)]
            self.v_scale = [torch.zeros(shape[:-1], dtype=torch.float32, device=self.device) for _ in range(n)]

    def _caches(self) -> tuple[torch.Tensor, ...]:
        """Every per-slot tensor of the cache: K, V and (FP8) their scales, slot and position first."""
        return (*self.k, *self.v, *self.k_scale, *self.v_scale)

    def _scales(self, i: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Layer i's K and V scales (FP8 caches), or (None, None): what the CUDA kernels take."""
        return (self.k_scale[i], self.v_scale[i]) if self.kv_fp8 else (None, None)

    def _kv_put(self, i: int, index: tuple[Any, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i's cache[index] := k, v (index over slot, head, position; k and v end in head_dim)."""
        if self.kv_fp8:
            (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
            self.k[i][index], self.k_scale[i][index] = kq, ks
            self.v[i][index], self.v_scale[i][index] = vq, vs
        else:
            self.k[i][index], self.v[i][index] = k, v

    def _kv_read(self, i: int, index: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values at index, in the model's dtype."""
        if self.kv_fp8:
            return (dequantize_kv(self.k[i][index], self.k_scale[i][index], self.dtype),
                    dequantize_kv(self.v[i][index], self.v_scale[i][index], self.dtype))
        return self.k[i][index], self.v[i][index]

    # ---- cache management
    def ensure_capacity(self, length: int) -> None:
        """Room for `length` positions per slot (a runner with a growing cache grows it here)."""
        check_capacity(length, self.max_seq_len)

    @torch.inference_mode()
    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot dst's first `length` positions := slot src's, in every cache."""
        if length <= 0 or src == dst:
            return
        for t in self._caches():
            t[dst, :, :length] = t[src, :, :length]

    @torch.inference_mode()
    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the first `length` positions of two slots in every cache."""
        if length <= 0 or a == b:
            return
        for t in self._caches():
            tmp = t[a, :, :length].clone()
            t[a, :, :length] = t[b, :, :length]
            t[b, :, :length] = tmp

    # ---- forward
    def _head(self, h: torch.Tensor, hidden: bool) -> Any:
        """Logits (float32) of the last hidden states; with `hidden`, also those states after the final
        norm (what the drafter reads)."""
        normed = self.inner.norm(h)
        logits = self.model.lm_head(normed).float()
        return (logits, normed) if hidden else logits

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], start: int, hidden: bool = False) -> Any:
        """Write KV for token_ids at positions [start, start+n) of `slot`; logits [V] of the last one
        (and its normed hidden state [H] with `hidden`)."""
        return self._head(self._prefill_hidden(slot, token_ids, start)[-1], hidden)

    @torch.inference_mode()
    def score(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        """Prefill `token_ids` into `slot` from position 0 and return the logits [n, V] after every
        token: teacher forcing through the serving cache (what a quality gate prices it with)."""
        return self._head(self._prefill_hidden(slot, token_ids, 0), False)

    def _prefill_hidden(self, slot: int, token_ids: list[int], start: int) -> torch.Tensor:
        n = len(token_ids)
        end = start + n
        self.ensure_capacity(end)
        dev = self.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        pos = torch.arange(start, end, device=dev)
        mask = torch.arange(end, device=dev).unsqueeze(0) <= pos.unsqueeze(1)  # [n, end]: causal over the prefix
        return self._prefill_layers(slot, start, end, ids, pos, mask)

    @abstractmethod
    def _prefill_layers(self, slot: int, start: int, end: int, ids: torch.Tensor, pos: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
        """The decoder layers over ids [n] at positions pos [n] = [start, end) of `slot`, writing their KV
        (`mask` [n, end] over the slot's keys): hidden states [n, H] before the final norm."""

    @abstractmethod
    def decode(self, token_ids: Any, positions: list[int], hidden: bool = False) -> Any:
        """One token for each slot 0..n-1 at its position (`token_ids`: a list of ints, or a tensor on
        the runner's device: the step before's draws); logits [n, V] (and hidden [n, H])."""

    @abstractmethod
    def verify(self, token_rows: Any, starts: list[int], hidden: bool = False) -> Any:
        """T tokens for each slot 0..n-1 at positions [start, start+T), causal within the row; logits
        [n, T, V] (and hidden [n, T, H]). Speculative decoding checks a row's drafts with it; KV written
        past what is accepted is ignored (attention reads a slot only up to its length) and overwritten."""

    @torch.inference_mode()
    def draft_then_verify(self, draft: Draft, context: torch.Tensor, first: torch.Tensor, starts: list[int]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A speculative step run eagerly: drafts [n, L], then logits and hidden states of [first, drafts]
        from one `verify`."""
        drafts = draft(context, first)
        logits, hidden = self.verify(torch.cat([first.view(-1, 1), drafts], 1), starts, hidden=True)
        return drafts, logits, hidden

    @torch.inference_mode()
    def draft_verify(self, draft: Draft, context: torch.Tensor, first: torch.Tensor, starts: list[int],
                     draft_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft `draft_len` tokens after each row's first token, then verify [first, drafts]: drafts,
        logits, hidden (a runner may fuse the two; here they run one after the other)."""
        return self.draft_then_verify(draft, context, first, starts)
