"""The embedded engine's forward on a GPU: static KV, fused projections, CUDA graphs per batch bucket.

A `BaseRunner` like `SlotRunner` (prefill, decode, copy, swap over slot-organised KV), built for the
shape of a decode step on a GPU, where launches and small kernels, not bytes, set the time of a
small model (gpt-fast's lesson):

- **Static KV**: one preallocated tensor per layer for K and V, `[slots + 1, kv_heads, max_seq_len,
  head_dim]`; nothing grows inside a step. The extra slot is scratch: padded rows of a batch bucket
  write there, so parked slots (kept for prefix reuse) are never touched.
- **Fused projections**: q/k/v and gate/up are concatenated into one GEMM each (bf16 weights;
  int8 weight-only with per-channel scales; FP8 where the linears share their input scale, each
  output channel keeping its module's weight scale: the activation is quantized once, exactly as
  each would quantize it).
- **Decode attention without GQA expansion**, in one of three forms (`attention`; `auto` is `split` on
  CUDA, from measurements, and `rows` on a CPU): `rows`, the `group` query heads of one KV head laid out
  as `group` query rows of one SDPA over that head's keys (the CPU runner's logits bit for bit); `gqa`,
  SDPA's grouped-query form; `split`, the split-KV Triton kernel (decode_attention.py), which reads
  the cache in place, bf16 or FP8, and spreads long contexts over the whole GPU. An FP8 cache
  (`kv_cache_dtype="fp8"`) is read by `split` on CUDA; elsewhere it is dequantised for SDPA.
- **CUDA graphs**: one captured decode step per (batch bucket, context bucket): the batch is padded
  up to a bucket size and the keys read up to a power-of-two context, so a handful of graphs serve
  every step. Inputs go through static buffers; one graph replay is the whole step, lm_head included.
- **Fused elementwise kernels** (`fused_ops`, on by default on CUDA): residual add + RMSNorm, RoPE +
  the KV write, and SiLU * up as one Triton kernel each (fused_ops.py), so a layer's decode step is
  its GEMMs, attention and three small kernels instead of about thirty.
- `compile=True` runs the work around attention (norms, projections, RoPE, SiLU*mul, residuals) of
  layers with plain bf16 weights through `torch.compile` (inductor fuses the elementwise ops),
  compiled once with dynamic shapes and shared by every layer (weights are arguments).

On a CPU the same code runs eagerly (no graphs), which is how the tests check it against
`SlotRunner` token for token.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from server.embedded.base_runner import BaseRunner, Draft
from server.embedded.decode_attention import interpreted, one_pass_counters, split_kv_attention, write_kv
from server.embedded.fused_ops import add_rms_norm, rope_write_kv, silu_mul
from server.embedded.gpu_kernels import dense_linear, silu_dense_applies, silu_dense_linear
from server.embedded.qlinear import Fp8Linear, Int8WeightOnlyLinear, project, quantized_input
from server.embedded.transfer import copy_into

FUSED_OPS_ENV = "EMBEDDED_FUSED_OPS"  # 0: eager elementwise ops on CUDA too, for side-by-side measurements
FP8_FUSE_ENV = "EMBEDDED_FP8_FUSE"  # 0: FP8 q/k/v and gate/up as separate GEMMs, for side-by-side measurements
ATTENTION_ENV = "EMBEDDED_ATTENTION"  # rows|gqa|split: the decode attention's form, for side-by-side measurements
ATTENTION_FORMS = ("auto", "rows", "gqa", "split")
# 1: the split kernel's last program of a (row, KV head) combines its partials (one launch a layer, not
# two; decode_attention.split_kv_attention's `counters`). Off until measured on a GPU against two launches.
ONE_PASS_ENV = "EMBEDDED_SPLIT_ONE_PASS"
# `auto`: on CUDA the split-KV kernel for every step. It is the one form that reads an FP8 cache in place
# and runs verify steps well (1+3 tokens at 8k keys: 27-64 us against SDPA's 169-180, H200,
# bench/attention-h200.json), and the one that reads only a row's own keys: SDPA's forms read the whole
# context bucket, so a row just past a power of two pays for twice its keys (H100, 14B, 8.4k keys in a
# 16k bucket: batch 16 190 us against SDPA gqa's 357, batch 1 23 against 37,
# bench/gpu-fp8-verify-h100.json). With the bucket full they are within 2% at batch 16 and split is
# faster at batch 1 (H100, bench/attention-tune-h100.json). On a CPU, `rows` (the CPU runner's logits).

MIN_CONTEXT_BUCKET = 256
# Prefill chunks of at most this many tokens run as decode-shaped steps: T tokens of the sequence's row,
# causal over its cache (the verify form, in the split kernel), in the step's CUDA graph for (context
# bucket, T), T a power of two of at most STEP_QUERY_ROWS // group tokens a step. The eager prefill pays
# about fifty launches a layer, each with Python's launch cost: on an H100 the mix's `make solve` spent 15
# of its engine's 19 s prefilling ~280 chunks of ~6 new tokens (bench/solve-h100.json), slower than the
# 2-core CPU. Longer chunks stay eager (one pass over the weights for many tokens). 0: off, until measured
# on a GPU (.gpu/prefill.sh); the step's logits differ from the eager prefill's by the kernels' rounding.
PREFILL_STEP_ENV = "EMBEDDED_PREFILL_STEP_TOKENS"
# the split kernel's query tile holds a step's tokens times the group's query heads (64: a 16-row
# decode tile's registers four times over, the verify's 1+3 tokens at 14B's group of 5 taking 32)
STEP_QUERY_ROWS = 64


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two up to max_batch, and max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is above the largest bucket {buckets[-1]}")


def context_bucket(length: int, max_seq_len: int) -> int:
    c = MIN_CONTEXT_BUCKET
    while c < length:
        c *= 2
    return min(c, max_seq_len)


class _Concatenated:
    """Plain linears of one input as one GEMM: their weights (and biases) concatenated (or one linear's own,
    `of`). `dense_linear` picks the GEMM (cuBLAS, or the Triton kernel for small weights at few rows)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        self.weight, self.bias = weight, bias

    @classmethod
    def of(cls, linear: Any) -> Any:
        """A plain `nn.Linear` as one; any other layer (quantized) as it is."""
        if type(linear) is torch.nn.Linear:
            return cls(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)

    def after_silu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up): one Triton GEMM that makes the activation as it loads it where
        `silu_dense_applies` (few rows on CUDA), else the fused SiLU kernel and then the GEMM."""
        if silu_dense_applies(gate_up, self.weight):
            return silu_dense_linear(gate_up, self.weight, self.bias)
        return self(silu_mul(gate_up))


def _fuse(mods: list[Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One callable computing the concatenated outputs of several linear layers of the same input."""
    if all(type(m) is torch.nn.Linear for m in mods):
        w = torch.cat([m.weight.detach() for m in mods], 0)
        bias = [m.bias for m in mods]
        b = torch.cat([x.detach() for x in bias], 0) if all(x is not None for x in bias) else None
        if any(x is not None for x in bias) and b is None:
            return lambda x: torch.cat([m(x) for m in mods], -1)
        return _Concatenated(w, b)
    if (all(isinstance(m, Int8WeightOnlyLinear) for m in mods)
            and all((m.bias is None) == (mods[0].bias is None) for m in mods)):
        fused = Int8WeightOnlyLinear(torch.cat([m.weight for m in mods], 0), torch.cat([m.scale for m in mods], 0),
                                     None if mods[0].bias is None else torch.cat([m.bias for m in mods], 0),
                                     mods[0].scale.dtype)
        return fused
    if all(isinstance(m, Fp8Linear) for m in mods) and os.environ.get(FP8_FUSE_ENV, "1") != "0":
        fp8 = Fp8Linear.concatenate(mods)
        if fp8 is not None:
            return fp8
    return lambda x: torch.cat([m(x) for m in mods], -1)


class _Layer:
    """One decoder layer's weights, as the step needs them: `pre` (norm, q/k/v, RoPE) and `post`
    (o_proj, residual, norm, MLP, residual) around the attention the runner does itself."""

    def __init__(self, layer: Any, fuse: bool, compiled: Optional[tuple[Any, Any]] = None):
        a, m = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.compiled = compiled if compiled is not None and _plain(layer) else None
        if self.compiled is not None:  # plain bf16 weights as tensors: one compiled graph serves every layer
            self.t_qkv_w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).detach()
            biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
            self.t_qkv_b = torch.cat([b.detach() for b in biases], 0) if biases[0] is not None else None
            self.t_gu_w = torch.cat([m.gate_proj.weight, m.up_proj.weight], 0).detach()
            self.t_o_w, self.t_down_w = a.o_proj.weight.detach(), m.down_proj.weight.detach()
            self.t_n1, self.t_n2 = self.norm1.weight.detach(), self.norm2.weight.detach()
            self.eps = _eps(self.norm1)
        if fuse:
            self.qkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
            self.gate_up = _fuse([m.gate_proj, m.up_proj])
        else:
            self.qkv = lambda x: torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], -1)
            self.gate_up = lambda x: torch.cat([m.gate_proj(x), m.up_proj(x)], -1)
        self.o_proj, self.down, self.act = _Concatenated.of(a.o_proj), _Concatenated.of(m.down_proj), m.act_fn
        # the fused path's q/k/v GEMM without its bias, for one-row steps, where the RoPE kernel after it adds
        # the bias: at one row torch adds a bias with a kernel of its own (cuBLASLt's bias epilogue wants two
        # rows). The sum rounds once more than in the GEMM (at most one step of the model's dtype on q/k/v).
        self.qkv_bias = self.qkv.bias if isinstance(self.qkv, _Concatenated) else None
        self.qkv_gemm = _Concatenated(self.qkv.weight, None) if self.qkv_bias is not None else self.qkv
        # FP8 GEMMs whose input the fused kernel before them quantizes (None: it stays in the model's dtype)
        self.qkv_fp8, self.o_fp8, self.gate_up_fp8, self.down_fp8 = (
            p.e4m3_input_scale() if isinstance(p, Fp8Linear) else None
            for p in (self.qkv, self.o_proj, self.gate_up, self.down))
        # what the fused kernels need: RMSNorm weights and SiLU (the llama layout's norms and activation)
        self.fusable = (hasattr(self.norm1, "weight") and hasattr(self.norm2, "weight")
                        and type(self.act).__name__ in ("SiLU", "SiLUActivation"))
        self.norm_eps = _eps(self.norm1)

    def pre(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int, d: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.compiled is not None:
            return self.compiled[0](h, self.t_n1, self.eps, self.t_qkv_w, self.t_qkv_b, cos, sin, nq, nkv, d)
        return _pre_attention(h, self.norm1, self.qkv, cos, sin, nq, nkv, d)

    def post(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled[1](h, o, self.t_o_w, self.t_n2, self.eps, self.t_gu_w, self.t_down_w)
        return _post_attention(h, o, self.o_proj, self.norm2, self.gate_up, self.down, self.act)


def _plain(layer: Any) -> bool:
    """bf16 nn.Linear projections (biases only on q/k/v), HF RMSNorms and SiLU: the compiled path."""
    a, m = layer.self_attn, layer.mlp
    lins = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
    return (all(type(x) is torch.nn.Linear for x in lins) and all(x.bias is None for x in lins[3:])
            and (a.q_proj.bias is None) == (a.k_proj.bias is None) == (a.v_proj.bias is None)
            and type(m.act_fn).__name__ in ("SiLU", "SiLUActivation") and hasattr(layer.input_layernorm, "weight"))


def _eps(norm: Any) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama/Qwen2), op for op."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _pre_tensors(h: torch.Tensor, n_w: torch.Tensor, eps: float, qkv_w: torch.Tensor, qkv_b: Optional[torch.Tensor],
                 cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int, d: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = F.linear(_rms_norm(h, n_w, eps), qkv_w, qkv_b)
    q, k, v = x.split([nq * d, nkv * d, nkv * d], -1)
    q, k, v = q.view(-1, nq, d), k.view(-1, nkv, d), v.view(-1, nkv, d)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * c + _rotate_half(q) * s).to(h.dtype), (k * c + _rotate_half(k) * s).to(h.dtype), v


def _post_tensors(h: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, n_w: torch.Tensor, eps: float,
                  gu_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    h = h + F.linear(o, o_w)
    g, u = F.linear(_rms_norm(h, n_w, eps), gu_w).chunk(2, -1)
    return h + F.linear(F.silu(g) * u, down_w)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _pre_attention(h: torch.Tensor, norm: Any, qkv: Any, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int,
                   d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, hidden] -> q [T, nq, d], k and v [T, nkv, d] with RoPE applied (T tokens, any rows)."""
    x = qkv(norm(h))
    q, k, v = x.split([nq * d, nkv * d, nkv * d], -1)
    q, k, v = q.view(-1, nq, d), k.view(-1, nkv, d), v.view(-1, nkv, d)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q = (q * c + _rotate_half(q) * s).to(h.dtype)
    k = (k * c + _rotate_half(k) * s).to(h.dtype)
    return q, k, v


def _post_attention(h: torch.Tensor, o: torch.Tensor, o_proj: Any, norm: Any, gate_up: Any, down: Any,
                    act: Any) -> torch.Tensor:
    h = h + o_proj(o)
    g, u = gate_up(norm(h)).chunk(2, -1)
    return h + down(act(g) * u)


class GraphRunner(BaseRunner):
    def __init__(self, model: Any, num_slots: int, max_seq_len: int, graphs: Optional[bool] = None,
                 compile: bool = False, fuse: Optional[bool] = None, attention: Optional[str] = None,
                 kv_cache_dtype: str = "auto", fused_ops: Optional[bool] = None):
        """`attention`: the decode/verify attention's form (module docstring): rows, gqa, split, or auto
        (the default): on CUDA the measured faster form, `split` (see `auto` above), on a
        CPU rows. EMBEDDED_ATTENTION overrides it (for side-by-side measurements). `fused_ops`: the
        fused elementwise kernels in decode and verify steps (default: on CUDA, where no layer is
        compiled; EMBEDDED_FUSED_OPS=0 turns them off); on a CPU only under Triton's interpreter."""
        super().__init__(model, num_slots, max_seq_len, kv_cache_dtype)
        cfg = model.config
        cuda = self.device.type == "cuda"
        self.graphs = cuda if graphs is None else graphs
        attention = attention or os.environ.get(ATTENTION_ENV) or "auto"
        if attention not in ATTENTION_FORMS:
            raise ValueError(f"GraphRunner: attention must be one of {ATTENTION_FORMS} (got {attention!r}; "
                             f"{ATTENTION_ENV})")
        if attention == "split" and not (cuda or interpreted()):
            raise ValueError(f"GraphRunner: attention 'split' is a CUDA kernel; on {self.device} use rows or gqa "
                             "(or run it under TRITON_INTERPRET=1)")
        if attention == "auto":
            attention = "split" if cuda else "rows"  # see `auto` above
        self.attention = attention
        self.counters = None  # the one-pass split's counters (ONE_PASS_ENV)
        if attention == "split" and os.environ.get(ONE_PASS_ENV, "0") == "1":
            self.counters = one_pass_counters(num_slots + 1, self.num_kv_heads, self.device)
        self.group = self.num_heads // self.num_kv_heads
        self.capacity = max_seq_len  # static: the scheduler never asks for more
        self.scratch = num_slots  # padded batch rows write their K/V here
        # fused GEMMs change the summation blocking: on by default only where speed matters (CUDA)
        compiled = None
        if compile:  # layers of plain weights share one compiled pair; others run eagerly
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            compiled = (torch.compile(_pre_tensors, dynamic=True), torch.compile(_post_tensors, dynamic=True))
        self.layers = [_Layer(layer, cuda if fuse is None else fuse, compiled) for layer in self.inner.layers]
        self.compiled = any(layer.compiled is not None for layer in self.layers)
        if fused_ops is None:
            fused_ops = cuda and os.environ.get(FUSED_OPS_ENV, "1") != "0" and not self.compiled
        if fused_ops and not (cuda or interpreted()):
            raise ValueError(f"GraphRunner: fused_ops are Triton kernels; on {self.device} they run only under "
                             "TRITON_INTERPRET=1")
        final = self.inner.norm
        self.fused_ops = bool(fused_ops and all(layer.fusable for layer in self.layers) and hasattr(final, "weight"))
        self.final_norm_eps = _eps(final)
        self._allocate_kv(num_slots + 1, max_seq_len)
        with torch.inference_mode():
            pos = torch.arange(max_seq_len, device=self.device).unsqueeze(0)
            probe = torch.zeros(1, 1, cfg.hidden_size, dtype=self.dtype, device=self.device)
            cos, sin = self.inner.rotary_emb(probe, pos)  # the model's own RoPE (its scaling included)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [max_seq_len, d]
        self.buckets = batch_buckets(num_slots)
        self.prefill_step_tokens = int(os.environ.get(PREFILL_STEP_ENV, "0")) if attention == "split" else 0
        self._graphs: dict[tuple[int, int, int, bool, bool], tuple[Any, dict[str, torch.Tensor]]] = {}
        self._pool: Any = None

    # ---- forward pieces
    def _rows_step(self, ids: torch.Tensor, pos: torch.Tensor, write_rows: torch.Tensor, ctx: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode (T=1) or verify (T>1) step on static inputs: ids, pos, write_rows [B, T], token t
        of a row attending causally to its row's cache; logits [B*T, V] and normed hidden [B*T, H]."""
        b, t = ids.shape
        h = self.inner.embed_tokens(ids.reshape(-1))
        fused = self.fused_ops
        if not fused:  # the fused kernel reads the tables at each token's position itself
            cos, sin = self.cos[pos.reshape(-1)], self.sin[pos.reshape(-1)]
        g, nq, nkv, d = self.group, self.num_heads, self.num_kv_heads, self.head_dim
        form, cuda = self.attention, ids.is_cuda
        mask = None
        if form != "split":  # the kernel masks by pos itself
            mask = (torch.arange(ctx, device=ids.device).view(1, 1, ctx) <= pos.unsqueeze(-1))  # [B, T, ctx]
            # gqa: [B, 1, T, ctx] over the query heads; rows: query rows (token, group head) per KV head
            mask = mask.unsqueeze(1) if form == "gqa" else mask.repeat_interleave(g, 1).unsqueeze(1)
        if fused:  # the residual stream and the next GEMM's normed input (FP8 where it is FP8's) side by side
            first, q8 = self.layers[0], functools.partial(quantized_input, rows=b * t)
            h, x = add_rms_norm(h, None, first.norm1.weight, first.norm_eps, q8(first.qkv_fp8))
        for i, layer in enumerate(self.layers):
            if fused:  # RoPE at each token's position and the K/V write in one launch
                # at one row the bias comes with the RoPE kernel (torch would add it with a launch of its own);
                # from two rows cuBLASLt's epilogue adds it within the GEMM
                bias = layer.qkv_bias if b * t == 1 else None
                gemm = layer.qkv_gemm if bias is not None else layer.qkv
                q = rope_write_kv(project(gemm, x), self.cos, self.sin, self.k[i], self.v[i], write_rows, pos, nq,
                                  nkv, *self._scales(i), bias=bias).view(b * t, nq, d)
            else:
                q, k, v = layer.pre(h, cos, sin, nq, nkv, d)
                if cuda:  # one launch for both caches (and FP8's quantization)
                    write_kv(k.view(b * t, nkv, d), v.view(b * t, nkv, d), self.k[i], self.v[i], write_rows, pos,
                             *self._scales(i))
                else:
                    self._kv_put(i, (write_rows, slice(None), pos), k.view(b, t, nkv, d), v.view(b, t, nkv, d))
            # the split kernel quantizes o_proj's FP8 input itself (the fused path's, as the norms do)
            o_scale = q8(layer.o_fp8) if fused and form == "split" else None
            o = self._decode_attention(i, form, q, write_rows, pos, ctx, mask, b, t, o_scale)
            if not fused:
                h = layer.post(h, o)
                continue
            h, x = add_rms_norm(h, project(layer.o_proj, o), layer.norm2.weight, layer.norm_eps, q8(layer.gate_up_fp8))
            gate_up = project(layer.gate_up, x)
            delta = (layer.down.after_silu(gate_up) if isinstance(layer.down, _Concatenated)
                     else project(layer.down, silu_mul(gate_up, q8(layer.down_fp8))))
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            h, x = add_rms_norm(h, delta, self.inner.norm.weight if nxt is None else nxt.norm1.weight,
                                self.final_norm_eps if nxt is None else nxt.norm_eps,
                                None if nxt is None else q8(nxt.qkv_fp8))
        if fused:  # x is the final norm's output already
            return self.model.lm_head(x).float(), x
        return self._head(h, True)

    def _decode_attention(self, i: int, form: str, q: torch.Tensor, write_rows: torch.Tensor, pos: torch.Tensor,
                          ctx: int, mask: Optional[torch.Tensor], b: int, t: int,
                          out_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Layer i's attention for the step's queries q [B*T, nq, d] over the rows' caches, in `form`:
        the output [B*T, nq*d] (`split` only: e4m3 with `out_scale`, see split_kv_attention)."""
        g, nq, nkv, d = self.group, self.num_heads, self.num_kv_heads, self.head_dim
        if form == "split":  # reads the cache in place (FP8 included); the rows' slots are write_rows
            return split_kv_attention(q.view(b, t, nq, d), self.k[i], self.v[i], write_rows, pos, ctx, self.scale,
                                      *self._scales(i), out_scale=out_scale, counters=self.counters
                                      ).view(b * t, nq * d)
        keys, values = self._kv_read(i, (slice(None, b), slice(None), slice(None, ctx)))
        if form == "gqa":
            o = F.scaled_dot_product_attention(q.view(b, t, nq, d).transpose(1, 2), keys, values, attn_mask=mask,
                                               scale=self.scale, enable_gqa=g > 1)  # [B, nq, T, d]
            return o.transpose(1, 2).reshape(b * t, nq * d)
        # rows: the group query heads of one KV head are `group` query rows of one attention
        qr = q.view(b, t, nkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, nkv, t * g, d)
        o = F.scaled_dot_product_attention(qr, keys, values, attn_mask=mask, scale=self.scale)
        return o.view(b, nkv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b * t, nq * d)

    def _prefill_layers(self, slot: int, start: int, end: int, ids: torch.Tensor, pos: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        h = self.inner.embed_tokens(ids)
        cos, sin = self.cos[pos], self.sin[pos]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.pre(h, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
            self._kv_put(i, (slot, slice(None), slice(start, end)), k.transpose(0, 1), v.transpose(0, 1))
            keys, values = self._kv_read(i, (slot, slice(None), slice(None, end)))  # [nkv, end, d]
            if self.group > 1:
                keys, values = keys.repeat_interleave(self.group, 0), values.repeat_interleave(self.group, 0)
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                               attn_mask=mask, scale=self.scale)  # [1, nq, n, d]
            h = layer.post(h, o[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim))
        return h

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], start: int, hidden: bool = False) -> Any:
        """BaseRunner.prefill; a chunk of at most `prefill_step_tokens` runs as decode-shaped steps
        (PREFILL_STEP_ENV), a longer one eagerly."""
        if not 0 < len(token_ids) <= self.prefill_step_tokens:
            return super().prefill(slot, token_ids, start, hidden)
        self.ensure_capacity(start + len(token_ids))  # before any step writes: a chunk too long writes nothing
        most = 1 << max(0, (STEP_QUERY_ROWS // self.group).bit_length() - 1)  # a power of two, at least 1
        for at in range(0, len(token_ids), most):
            logits, normed = self._prefill_step(slot, token_ids[at:at + most], start + at)
        return (logits, normed) if hidden else logits

    def _prefill_step(self, slot: int, token_ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids at positions [start, start+n) of `slot` as one step of T >= n tokens (a power of two):
        the n write the slot's K/V and attend its keys causally; the T - n padding tokens repeat the last
        position and write the scratch slot (the kernel reads the row's keys from its first token's slot,
        up to its furthest position: the padding changes neither). Logits [V] and normed hidden [H] of
        the last token."""
        n = len(token_ids)
        t = 1 << (n - 1).bit_length()
        end = start + n
        ids = torch.tensor([list(token_ids) + [0] * (t - n)], dtype=torch.long)
        pos = torch.tensor([list(range(start, end)) + [end - 1] * (t - n)], dtype=torch.long)
        rows = torch.tensor([[slot] * n + [self.scratch] * (t - n)], dtype=torch.long)
        logits, normed = self._run_rows(ids, pos, rows, end, prefill=True)
        return logits[n - 1].clone(), normed[n - 1].clone()  # not views of buffers the next replay rewrites

    def _run_rows(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, longest: int,
                  prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`_rows_step` on ids, pos, rows [B, T] (B a batch bucket with graphs) reading keys up to `longest`:
        eagerly, or as a replay of the captured step for its (B, context bucket, T) (`prefill`: the prefill
        steps' own graphs). Logits [B*T, V] and normed hidden [B*T, H]."""
        if not self.graphs:
            dev = self.device
            return self._rows_step(ids.to(dev), pos.to(dev), rows.to(dev), longest)
        b, t = ids.shape
        graph, io = self._graph(b, context_bucket(longest, self.max_seq_len), t, prefill=prefill)
        for name, src in (("ids", ids), ("pos", pos), ("rows", rows)):  # queued, not waited for
            copy_into(io[name], src)
        graph.replay()
        return io["logits"], io["hidden"]

    @torch.inference_mode()
    def decode(self, token_ids: Any, positions: list[int], hidden: bool = False) -> Any:
        """One token for each slot 0..n-1 at its position (`token_ids`: a list, or a tensor on the
        device); logits [n, V] (and hidden [n, H]), on the runner's device."""
        rows = token_ids.view(-1, 1) if isinstance(token_ids, torch.Tensor) else [[t] for t in token_ids]
        out = self.verify(rows, positions, hidden)
        return (out[0][:, 0], out[1][:, 0]) if hidden else out[:, 0]

    @torch.inference_mode()
    def verify(self, token_rows: Any, starts: list[int], hidden: bool = False) -> Any:
        """T tokens for each slot 0..n-1 at positions [start, start+T); logits [n, T, V] (and hidden
        [n, T, H]). With graphs, one captured graph per (batch bucket, context bucket, T)."""
        n, t = len(token_rows), len(token_rows[0])
        longest = max(starts) + t
        self.ensure_capacity(longest)
        # buckets only where graphs need them: masked padding keys change the CPU kernel's summation order
        b = bucket(n, self.buckets) if self.graphs else n
        pad = b - n
        if isinstance(token_rows, torch.Tensor):  # drafts still on the device: no host round trip
            ids = torch.cat([token_rows, token_rows.new_zeros((pad, t))]) if pad else token_rows
        else:
            ids = torch.tensor([list(r) for r in token_rows] + [[0] * t] * pad, dtype=torch.long)
        pos = torch.tensor(list(starts) + [0] * pad, dtype=torch.long).view(b, 1) + torch.arange(t)
        rows = torch.tensor(list(range(n)) + [self.scratch] * pad, dtype=torch.long).view(b, 1).expand(b, t)
        logits, normed = self._run_rows(ids, pos, rows, longest)
        logits = logits.view(b, t, -1)[:n]
        return (logits, normed.view(b, t, -1)[:n]) if hidden else logits

    @torch.inference_mode()
    def draft_verify(self, draft: Draft, context: torch.Tensor, first: torch.Tensor, starts: list[int],
                     draft_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft `draft_len` tokens per row (`draft(context [n, H], first [n]) -> [n, L]`) and verify
        [first, drafts] in the same step; on CUDA the drafter's kernels are captured in the verify
        graph, so a speculative step is one replay. Returns drafts [n, L], logits [n, T, V], hidden
        [n, T, H]."""
        n, t = context.shape[0], draft_len + 1
        if not self.graphs:
            return self.draft_then_verify(draft, context, first, starts)
        longest = max(starts) + t
        self.ensure_capacity(longest)
        b = bucket(n, self.buckets)
        ctx = context_bucket(longest, self.max_seq_len)
        pad = b - n
        pos = torch.tensor(list(starts) + [0] * pad, dtype=torch.long).view(b, 1) + torch.arange(t)
        rows = torch.tensor(list(range(n)) + [self.scratch] * pad, dtype=torch.long).view(b, 1).expand(b, t)
        graph, io = self._graph(b, ctx, t, draft)
        io["context"][:n].copy_(context)
        io["first"][:n].copy_(first)
        if pad:
            io["first"][n:].zero_()
        copy_into(io["pos"], pos)
        copy_into(io["rows"], rows)
        graph.replay()
        return io["drafts"][:n], io["logits"].view(b, t, -1)[:n], io["hidden"].view(b, t, -1)[:n]

    def _graph(self, b: int, ctx: int, t: int, draft: Optional[Callable[..., torch.Tensor]] = None,
               prefill: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
        """The captured step for (batch bucket, context bucket, tokens per row), captured on first use;
        with `draft`, the drafting of the row's tokens after its first one is part of the graph. Prefill
        steps have graphs of their own: the speculative step keeps each row's hidden state as a view of its
        step's output until the next step drafts from it, and a prefill between the two (an admission)
        must not replay that graph."""
        key = (b, ctx, t, draft is not None, prefill)
        if key in self._graphs:
            return self._graphs[key]
        dev = self.device
        io = {"ids": torch.zeros((b, t), dtype=torch.long, device=dev),
              "pos": torch.zeros((b, t), dtype=torch.long, device=dev),
              "rows": torch.full((b, t), self.scratch, dtype=torch.long, device=dev)}
        if draft is not None:
            io["context"] = torch.zeros((b, self.inner.config.hidden_size), dtype=self.dtype, device=dev)
            io["first"] = torch.zeros(b, dtype=torch.long, device=dev)

        def body() -> tuple[torch.Tensor, ...]:
            if draft is None:
                return self._rows_step(io["ids"], io["pos"], io["rows"], ctx)
            drafts = draft(io["context"], io["first"])
            ids = torch.cat([io["first"].view(b, 1), drafts], 1)
            return (*self._rows_step(ids, io["pos"], io["rows"], ctx), drafts)

        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy inits and (with compile) the compiled kernels happen here
                body()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            out = body()
        io["logits"], io["hidden"] = out[0], out[1]
        if draft is not None:
            io["drafts"] = out[2]
        self._graphs[key] = (graph, io)
        return graph, io
