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
- `copy` / `swap` move a slot's cache, which is how prefixes are reused and slots kept packed.

Supported: decoder-only models with the llama layer layout (llama, qwen2, mistral without a sliding
window). Others are refused at load with the model type named.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "mistral")


@torch.inference_mode()
def copy_prefix(caches: tuple[torch.Tensor, ...], src: int, dst: int, length: int) -> None:
    """Slot dst's first `length` positions := slot src's, in every [slots, heads, positions, dim] cache."""
    if length <= 0 or src == dst:
        return
    for t in caches:
        t[dst, :, :length] = t[src, :, :length]


@torch.inference_mode()
def swap_prefix(caches: tuple[torch.Tensor, ...], a: int, b: int, length: int) -> None:
    """Exchange the first `length` positions of two slots in every cache."""
    if length <= 0 or a == b:
        return
    for t in caches:
        tmp = t[a, :, :length].clone()
        t[a, :, :length] = t[b, :, :length]
        t[b, :, :length] = tmp


def draft_then_verify(runner: Any, draft: Any, context: torch.Tensor, first: torch.Tensor, starts: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A speculative step run eagerly on any runner: drafts [n, L], then logits and hidden states of
    [first, drafts] from one `verify`."""
    drafts = draft(context, first)
    logits, hidden = runner.verify(torch.cat([first.view(-1, 1), drafts], 1), starts, hidden=True)
    return drafts, logits, hidden


class SlotRunner:
    def __init__(self, model: Any, num_slots: int, max_seq_len: int, initial_capacity: int = 256):
        cfg = model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"embedded runtime: model_type {cfg.model_type!r} is not supported (supported: {SUPPORTED})")
        if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            raise ValueError("embedded runtime: sliding-window attention layers are not supported")
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        first = next(p for p in model.parameters() if p.is_floating_point())
        self.dtype, self.device = first.dtype, first.device
        self.capacity = min(initial_capacity, max_seq_len)
        shape = (num_slots, self.num_kv_heads, self.capacity, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb

    # ---- cache management (under inference mode: caches grown inside a forward are inference tensors,
    # and in-place updates to them are allowed only there)
    @torch.inference_mode()
    def ensure_capacity(self, length: int) -> None:
        if length > self.max_seq_len:
            raise ValueError(f"sequence of {length} tokens exceeds the engine's max_seq_len {self.max_seq_len}")
        if length <= self.capacity:
            return
        new = self.capacity
        while new < length:
            new *= 2
        new = min(new, self.max_seq_len)
        pad = new - self.capacity
        self.k = [F.pad(t, (0, 0, 0, pad)) for t in self.k]
        self.v = [F.pad(t, (0, 0, 0, pad)) for t in self.v]
        self.capacity = new

    def copy(self, src: int, dst: int, length: int) -> None:
        copy_prefix((*self.k, *self.v), src, dst, length)

    def swap(self, a: int, b: int, length: int) -> None:
        swap_prefix((*self.k, *self.v), a, b, length)

    # ---- forward
    def _attention_layer(self, i: int, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         write: Any, read: Any, mask: torch.Tensor) -> torch.Tensor:
        attn = layer.self_attn
        b, t, _ = h.shape
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, k, cos, sin)
        write(self.k[i], k)
        write(self.v[i], v)
        keys, values = read(self.k[i]), read(self.v[i])
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

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
        n = len(token_ids)
        end = start + n
        self.ensure_capacity(end)
        dev = self.device
        ids = torch.tensor([token_ids], dtype=torch.long, device=dev)
        pos = torch.arange(start, end, device=dev).unsqueeze(0)
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, pos)
        mask = torch.arange(end, device=dev).unsqueeze(0) <= pos.view(n, 1)  # [n, end]: causal over the prefix

        def write(cache: torch.Tensor, new: torch.Tensor) -> None:
            cache[slot, :, start:end] = new[0]

        def read(cache: torch.Tensor) -> torch.Tensor:
            return cache[slot:slot + 1, :, :end]

        for i, layer in enumerate(self.layers):
            h = self._attention_layer(i, layer, h, cos, sin, write, read, mask)
        return self._head(h[0, -1], hidden)

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int], hidden: bool = False, first_slot: int = 0) -> Any:
        """One token for each slot first_slot..first_slot+n-1 at its position; logits [n, V] (and hidden
        [n, H])."""
        n = len(token_ids)
        longest = max(positions) + 1
        self.ensure_capacity(longest)
        dev = self.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev).view(n, 1)
        pos = torch.tensor(positions, dtype=torch.long, device=dev).view(n, 1)
        rows = torch.arange(first_slot, first_slot + n, device=dev)
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, pos)
        mask = (torch.arange(longest, device=dev).unsqueeze(0) <= pos).view(n, 1, 1, longest)

        def write(cache: torch.Tensor, new: torch.Tensor) -> None:
            cache[rows, :, pos[:, 0]] = new[:, :, 0]

        def read(cache: torch.Tensor) -> torch.Tensor:
            return cache[first_slot:first_slot + n, :, :longest]

        for i, layer in enumerate(self.layers):
            h = self._attention_layer(i, layer, h, cos, sin, write, read, mask)
        return self._head(h[:, -1], hidden)

    @torch.inference_mode()
    def draft_verify(self, draft: Any, context: torch.Tensor, first: torch.Tensor, starts: list[int],
                     draft_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft after each row's first token, then verify [first, drafts]: drafts, logits, hidden."""
        return draft_then_verify(self, draft, context, first, starts)

    @torch.inference_mode()
    def verify(self, token_rows: Any, starts: list[int], hidden: bool = False) -> Any:
        """T tokens for each slot 0..n-1 at positions [start, start+T), causal within the row; logits
        [n, T, V] (and hidden [n, T, H]). Speculative decoding checks a row's drafts with it; KV written
        past what is accepted is ignored (attention reads a slot only up to its length) and overwritten."""
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

        def write(cache: torch.Tensor, new: torch.Tensor) -> None:
            cache[rows, :, pos] = new.transpose(1, 2)  # [n, T, kv_heads, head_dim]

        def read(cache: torch.Tensor) -> torch.Tensor:
            return cache[:n, :, :longest]

        for i, layer in enumerate(self.layers):
            h = self._attention_layer(i, layer, h, cos, sin, write, read, mask)
        return self._head(h, hidden)
