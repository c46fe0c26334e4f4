"""The forward pass of the embedded engine over a slot-organised KV cache.

transformers' own generate keeps one cache per call, so sequences cannot join or leave a running
batch; its continuous-batching manager can, but is slower on CPU (see `make bench`). This runner
reuses the model's own modules (embeddings, norms, projections, MLPs, rotary embedding — the
quantized layers from `loader.py` included) and only owns attention and the cache:

- the cache is one tensor per layer and K/V of shape [slots, kv_heads, capacity, head_dim];
  capacity grows by doubling up to the engine's max_seq_len;
- `decode` runs one token for each of slots [0, n) (the scheduler keeps running sequences packed
  at the front), attending each to its own length with a mask;
- `prefill` runs a chunk of one slot's tokens with causal attention over its cached prefix;
- `copy` / `swap` move a slot's cache, which is how prefixes are reused and slots kept packed
  (those and prefill's opening are `BaseRunner`'s, base_runner.py).

Supported: the models `BaseRunner` accepts, without sliding-window attention layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from server.embedded.base_runner import BaseRunner


class SlotRunner(BaseRunner):
    def __init__(self, model: Any, num_slots: int, max_seq_len: int, initial_capacity: int = 256,
                 kv_cache_dtype: str = "auto"):
        super().__init__(model, num_slots, max_seq_len, kv_cache_dtype)
        cfg = model.config
        layer_types = getattr(cfg, "layer_types", None) or []
        if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
            raise ValueError("embedded runtime: sliding-window attention layers are not supported")
        self.layers = list(self.inner.layers)
        self.capacity = min(initial_capacity, max_seq_len)
        self._allocate_kv(num_slots, self.capacity)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb

    # the cache grows inside a forward, under inference mode: caches made there are inference tensors,
    # and in-place updates to them are allowed only there
    @torch.inference_mode()
    def ensure_capacity(self, length: int) -> None:
        super().ensure_capacity(length)
        if length <= self.capacity:
            return
        new = self.capacity
        while new < length:
            new *= 2
        new = min(new, self.max_seq_len)
        old = (self.k, self.v, self.k_scale, self.v_scale)
        self._allocate_kv(self.num_slots, new)
        for grown, kept in zip(self._caches(), (t for group in old for t in group)):
            grown[:, :, :self.capacity] = kept
        self.capacity = new

    # ---- forward
    def _attention_layer(self, i: int, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         write: tuple[Any, ...], as_written: Any, read: tuple[Any, ...], mask: torch.Tensor
                         ) -> torch.Tensor:
        """One decoder layer: K/V of h [B, T, H] go to cache[write] (shaped by `as_written` from
        [B, kv_heads, T, head_dim]), attention reads cache[read] under `mask`."""
        attn = layer.self_attn
        b, t, _ = h.shape
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, k, cos, sin)
        self._kv_put(i, write, as_written(k), as_written(v))
        keys, values = self._kv_read(i, read)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _prefill_layers(self, slot: int, start: int, end: int, ids: torch.Tensor, pos: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
        h = self.inner.embed_tokens(ids.unsqueeze(0))
        cos, sin = self.inner.rotary_emb(h, pos.unsqueeze(0))

        write, read = (slot, slice(None), slice(start, end)), (slice(slot, slot + 1), slice(None), slice(None, end))
        for i, layer in enumerate(self.layers):
            h = self._attention_layer(i, layer, h, cos, sin, write, lambda new: new[0], read, mask)
        return h[0]

    @torch.inference_mode()
    def decode(self, token_ids: Any, positions: list[int], hidden: bool = False, first_slot: int = 0) -> Any:
        """One token for each slot first_slot..first_slot+n-1 at its position (`token_ids`: a list or a
        tensor); logits [n, V] (and hidden [n, H])."""
        n = len(token_ids)
        longest = max(positions) + 1
        self.ensure_capacity(longest)
        dev = self.device
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=dev).view(n, 1)
        pos = torch.tensor(positions, dtype=torch.long, device=dev).view(n, 1)
        rows = torch.arange(first_slot, first_slot + n, device=dev)
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, pos)
        mask = (torch.arange(longest, device=dev).unsqueeze(0) <= pos).view(n, 1, 1, longest)

        write = (rows, slice(None), pos[:, 0])
        read = (slice(first_slot, first_slot + n), slice(None), slice(None, longest))
        for i, layer in enumerate(self.layers):
            h = self._attention_layer(i, layer, h, cos, sin, write, lambda new: new[:, :, 0], read, mask)
        return self._head(h[:, -1], hidden)

    @torch.inference_mode()
    def verify(self, token_rows: Any, starts: list[int], hidden: bool = False) -> Any:
        """T tokens for each slot 0..n-1 at positions [start, start+T), causal within the row (`BaseRunner.verify`)."""
        n, t = len(token_rows), len(token_rows[0])
        longest = max(starts) + t
        self.ensure_capacity(longest)
        dev = self.device
        ids = torch.as_tensor(token_rows, dtype=torch.long, device=dev)
        pos = torch.tensor(starts, dtype=torch.long, device=dev).view(n, 1) + torch.arange(t, device=dev)
        rows = torch.arange(n, device=dev).view(n, 1).expand(n, t)
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, pos)
        mask = (torch.arange(longest, device=dev).view(1, 1, longest) <= pos.unsqueeze(-1)).unsqueeze(1)

        write, read = (rows, slice(None), pos), (slice(None, n), slice(None), slice(None, longest))
        for i, layer in enumerate(self.layers):  # written as [n, T, kv_heads, head_dim]
            h = self._attention_layer(i, layer, h, cos, sin, write, lambda new: new.transpose(1, 2), read, mask)
        return self._head(h, hidden)
