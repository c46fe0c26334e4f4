"""How the embedded engine advances its sequences: a step policy, plain or speculative.

A step policy has two calls: `prefill(seq)` computes an admitted sequence's prompt KV (past the prefix
the scheduler reused) and samples its first token; `decode(batch)` runs one step for the running
batch. Both hand every new token to `emit` (the engine's: it streams the token and ends the request
when it should), and count their work in the engine's `EngineStats`. The engine picks one policy at
construction: `PlainStep` decodes one token per sequence per step; `SpeculativeStep` drafts.

Speculative decoding (`speculative.py` has the acceptance rule): with a ReDrafter head (an engine
folder's `drafter/`), each step drafts L tokens per running sequence and the target verifies all of
them for every sequence in one forward; each sequence keeps its accepted drafts plus one token of the
target's, exactly distributed as without the drafter. Above `max_batch` running sequences (per
device, measured) the step decodes one token per sequence instead; both kinds of step keep the
drafter's input (the target's hidden state of each pending token) current.

Deterministic mode (deterministic.py) is a plain step: aligned prefill chunks, one row at a time.

Overlap (plain steps on a GPU, as vLLM's and SGLang's overlap schedulers do): the host launches step
t+1 from step t's sampled tokens while they are still on the device, and only then reads step t's
tokens (from a pinned copy, behind an event) to stream them, match stop strings and end requests, so
that host work runs while the device computes. A sequence that step t ends has had one token too many
computed for it; that row is dropped. The batch's next step is launched early only while it is the
same batch (same sequences, same slots) and every sequence has room for two more tokens; otherwise
the step in flight is landed first and the next one starts from the host's tokens. Tokens are the
same as without overlap: the draw depends on the logits, the seed and the token's index only.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch

from aimo_spec.protocol import SamplingParams
from server.embedded.deterministic import CHUNK, decode_rows, whole_chunks
from server.embedded.sampler import draw_device, pack_draws, sample, sample_device, unpack_draws
from server.embedded.sequence import EngineStats, Seq
from server.embedded.speculative import SpecConfig, accept_device, accept_host, top_logprobs

PREFILL_CHUNK = 512  # prompt tokens per prefill forward (deterministic mode: CHUNK)

Emit = Callable[[Seq, int, Any], bool]  # (sequence, token, its top logprobs) -> the request ended


@dataclass
class Launched:
    """A decode step queued on the device whose tokens the host has not read yet."""

    seqs: list[Seq]  # the batch, in slot order at launch
    tokens: torch.Tensor  # [n] sampled tokens on the device: the next step's input
    host: torch.Tensor  # `pack_draws`'s output copied to (pinned) host memory once `ready` fires
    ready: Any  # a CUDA event recorded after that copy (None on the CPU: the copy was synchronous)


def same_batch(a: Sequence[Seq], b: Sequence[Seq]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class PlainStep:
    """One token per running sequence per step."""

    hidden = False  # whether forwards also return the normed hidden states (the drafter's input)

    def __init__(self, runner: Any, stats: EngineStats, emit: Emit, deterministic: bool = False,
                 overlap: Optional[bool] = None):
        """`overlap` (see the module's docstring): None turns it on for plain steps of a runner with CUDA
        graphs outside deterministic mode (on the CPU the host and the device are the same cores: nothing
        to win; a runner without graphs builds its inputs with blocking copies, which would wait anyway).
        With overlap every token, the first one included, comes from the device sampler."""
        self.runner, self.stats, self.emit = runner, stats, emit
        self.deterministic = deterministic
        if overlap and (deterministic or self.hidden):
            raise ValueError("overlap runs plain, non-deterministic steps only")
        self.overlap = (runner.device.type == "cuda" and bool(getattr(runner, "graphs", False))
                        and not deterministic and not self.hidden if overlap is None else overlap)
        self._launched: Optional[Launched] = None
        self.launched_ahead = 0  # steps launched from the step before's draws (overlap at work)
        # per-request generators (sampler.sample) on the CPU; else, and always with overlap, sample_device
        self.host_sampler = runner.device.type == "cpu" and not self.overlap
        self._forward = partial(decode_rows, runner) if deterministic else runner.decode

    # a temperature-only row and a truncated one: the draw's two kernels
    WARM_UP = (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5))

    def warm_up(self, vocab: int) -> None:
        """Build the device sampler's kernels for this vocabulary now (engine start), not at the first
        sampled request; one that fails to build gives way to the eager rule here (sampler.py)."""
        logits = torch.zeros(1, vocab, device=self.runner.device)
        for p in self.WARM_UP:
            draw_device(logits, [p], [0], [0])

    def prefill(self, seq: Seq) -> None:
        """Compute the KV of seq's prompt past the `kv_len` positions reused, then sample its first token."""
        t0 = time.perf_counter()
        out = None
        chunk = CHUNK if self.deterministic else PREFILL_CHUNK  # reused is a multiple of CHUNK there
        for start in range(seq.kv_len, len(seq.prompt), chunk):
            out = self.runner.prefill(seq.slot, seq.prompt[start:start + chunk], start, hidden=self.hidden)
        self._prefilled([seq], time.perf_counter() - t0)
        if self.hidden:
            self._sampled([seq], out[0].unsqueeze(0), out[1].unsqueeze(0))
        else:
            self._sampled([seq], out.unsqueeze(0))

    def prefill_many(self, seqs: list[Seq]) -> None:
        """`prefill` of sequences admitted together, in one forward where the runner has one
        (`prefill_rows`: llama.cpp, where every forward is a pass over the weights and the samples of a
        problem each have one prompt token left to compute); else one after another."""
        rows = getattr(self.runner, "prefill_rows", None)
        if len(seqs) < 2 or rows is None or self.deterministic or self.hidden:
            for s in seqs:
                self.prefill(s)
            return
        t0 = time.perf_counter()
        logits = rows([(s.slot, s.prompt[s.kv_len:], s.kv_len) for s in seqs])
        self._prefilled(seqs, time.perf_counter() - t0)
        self._sampled(seqs, logits)

    def _prefilled(self, seqs: list[Seq], seconds: float) -> None:
        """Count a prefill forward of `seqs` (their reused and computed prompt tokens, its time); each
        sequence's KV now covers its whole prompt."""
        self.stats.forward_seconds += seconds
        self.stats.prefill_seconds += seconds
        for s in seqs:
            self.stats.cached_tokens += s.kv_len
            self.stats.prefill_tokens += len(s.prompt) - s.kv_len
            s.kv_len = len(s.prompt)
            s.canonical = whole_chunks(s.kv_len)

    def decode(self, batch: list[Seq]) -> None:
        """One token for every sequence of the batch (slots 0..n-1); with overlap, the tokens of the
        step launched before (this step's own are streamed at the next call)."""
        if self.overlap:
            self._decode_overlapped(batch)
            return
        t0 = time.perf_counter()
        out = self._forward([s.pending for s in batch], [s.kv_len for s in batch], hidden=self.hidden)
        logits, hidden = out if self.hidden else (out, None)
        self.stats.forward_seconds += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.decode_tokens += len(batch)
        self.stats.batch_sizes.append(len(batch))
        for s in batch:
            s.kv_len += 1
        self._sampled(batch, logits, hidden)

    def _decode_overlapped(self, batch: list[Seq]) -> None:
        prev, self._launched = self._launched, None
        if prev is None:
            self._launched = self._launch(batch, None)
            return
        # run ahead only where no sequence can reach its token limit with prev's token (the cache then has room)
        if same_batch(prev.seqs, batch) and all(len(s.generated) + 2 <= s.max_new for s in batch):
            self._launched = self._launch(batch, prev.tokens)
            self.launched_ahead += 1
        self._land(prev)  # when the batch changed, its next step starts from the host's tokens next time

    def discard(self) -> None:
        """Forget the step in flight (after a failed step, whose requests have all been ended)."""
        self._launched = None

    def _launch(self, batch: list[Seq], tokens: Optional[torch.Tensor]) -> Launched:
        """Queue one decode step and its sampling on the device: from `tokens` (the step before's draws,
        still on the device; each row's pending token is not known on the host yet) or from the host's
        pending tokens. Returns without waiting for the device."""
        t0 = time.perf_counter()
        ahead = tokens is not None  # the draw's index counts the token not yet streamed
        ids = tokens if ahead else [s.pending for s in batch]
        logits = self.runner.decode(ids, [s.kv_len for s in batch])
        params = [s.params for s in batch]
        drawn = draw_device(logits, params, [s.seed for s in batch], [len(s.generated) + ahead for s in batch])
        packed = pack_draws(logits, drawn, params)
        ready = None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(packed.device))  # the copy's device, not the current one
        else:
            host = packed
        for s in batch:
            s.kv_len += 1  # the pending token's KV is being written
        self.stats.forward_seconds += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.batch_sizes.append(len(batch))
        return Launched(list(batch), drawn, host, ready)

    def _land(self, launched: Launched) -> None:
        """Wait for a launched step's tokens and hand each to `emit`; rows of requests that ended
        meanwhile (their last token came in the step before, or they were cancelled) are dropped."""
        t0 = time.perf_counter()
        if launched.ready is not None:
            launched.ready.synchronize()
        rows = launched.host.tolist()
        t1 = time.perf_counter()
        self.stats.forward_seconds += t1 - t0  # waiting for the device
        toks, tops = unpack_draws(rows, [s.params for s in launched.seqs])
        self.stats.sample_seconds += time.perf_counter() - t1  # streaming (emit) is bookkeeping, as without overlap
        for s, tok, top in zip(launched.seqs, toks, tops):
            if not s.stream.done:  # a dropped row: steps and batch_sizes count it, decode_tokens does not
                self.stats.decode_tokens += 1
                self.emit(s, tok, top)

    def _sampled(self, seqs: list[Seq], logits: torch.Tensor, hidden: Optional[torch.Tensor] = None) -> None:
        t0 = time.perf_counter()
        if self.host_sampler:
            toks, tops = sample(logits, [s.params for s in seqs], [s.gen for s in seqs])
        else:
            toks, tops = sample_device(logits, [s.params for s in seqs], [s.seed for s in seqs],
                                       [len(s.generated) for s in seqs])
        self.stats.sample_seconds += time.perf_counter() - t0
        for i, (s, tok, top) in enumerate(zip(seqs, toks, tops)):
            if hidden is not None:
                s.hidden = hidden[i]
            self.emit(s, tok, top)


class SpeculativeStep(PlainStep):
    """Draft `spec.draft_len` tokens per sequence and verify them, while at most `max_batch` run."""

    hidden = True

    def __init__(self, runner: Any, stats: EngineStats, emit: Emit, drafter: Any, embed: Any, spec: SpecConfig,
                 max_batch: int):
        super().__init__(runner, stats, emit)
        self.drafter, self.embed, self.spec, self.max_batch = drafter, embed, spec, max_batch

    def warm_up(self, vocab: int) -> None:
        """The draw's kernels and the acceptance's for `spec.draft_len` drafts."""
        super().warm_up(vocab)
        dev, L = self.runner.device, self.spec.draft_len
        logits = torch.zeros(1, L + 1, vocab, device=dev)
        for p in self.WARM_UP:
            accept_device(logits, torch.zeros(1, L, dtype=torch.long, device=dev), [p], [0], [0])

    def decode(self, batch: list[Seq]) -> None:
        if len(batch) <= self.max_batch:
            self._speculate(batch)
        else:
            super().decode(batch)

    def _draft(self, context: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """[n, L] draft tokens after each row's pending token (the best beam with num_beams > 1)."""
        from server.embedded.redrafter import draft_greedy

        spec = self.spec
        if spec.num_beams == 1:
            return draft_greedy(self.drafter, context, first, self.embed, spec.draft_len)
        rows = [self.drafter.beam_search(context[i], int(first[i]), self.embed, spec.num_beams, spec.draft_len)[0][0]
                for i in range(context.shape[0])]
        return torch.stack(rows)

    @torch.inference_mode()
    def _speculate(self, seqs: list[Seq]) -> None:
        """Draft L tokens per sequence, verify all rows in one forward, keep each row's accepted run
        plus the target's next token (speculative.py has the rule)."""
        spec, dev = self.spec, self.runner.device
        n, L = len(seqs), spec.draft_len
        t0 = time.perf_counter()
        first = torch.tensor([s.pending for s in seqs], dtype=torch.long, device=dev)
        context, starts = torch.stack([s.hidden for s in seqs]), [s.kv_len for s in seqs]
        if spec.num_beams == 1:  # drafting and verification in one step (on CUDA one graph replay)
            drafts, logits, hidden = self.runner.draft_verify(self._draft, context, first, starts, L)
        else:  # beam search picks beams on the host: not capturable
            drafts, logits, hidden = self.runner.draft_then_verify(self._draft, context, first, starts)
        t2 = time.perf_counter()
        params = [s.params for s in seqs]
        want = max((p.top_logprobs for p in params), default=0)
        tops = top_logprobs(logits, want)
        if dev.type == "cpu":
            verdicts = accept_host(logits, drafts.tolist(), params, [s.gen for s in seqs])
            draft_rows = drafts.tolist()
        else:  # one transfer: drafts, kept counts, next tokens (and top logprobs)
            keep, nxt = accept_device(logits, drafts, params, [s.seed for s in seqs], [len(s.generated) for s in seqs])
            packed = torch.cat([drafts, keep.view(n, 1), nxt.view(n, 1)], 1).tolist()
            draft_rows = [r[:L] for r in packed]
            verdicts = [(r[L], r[L + 1]) for r in packed]
        if tops is not None:
            tops = (tops[0].tolist(), tops[1].tolist())
        self.stats.forward_seconds += t2 - t0
        self.stats.sample_seconds += time.perf_counter() - t2
        self.stats.steps += 1
        self.stats.spec_steps += 1
        self.stats.spec_rows += n
        self.stats.batch_sizes.append(n)
        self.stats.draft_tokens += n * L
        for i, (s, (k, nxt_tok)) in enumerate(zip(seqs, verdicts)):
            s.kv_len += 1 + k  # the pending token and the kept drafts are in the cache now
            s.hidden = hidden[i, k]
            s.stream.draft_tokens += L
            s.stream.accepted_draft_tokens += k
            self.stats.accepted_draft_tokens += k
            emitted = draft_rows[i][:k] + [nxt_tok]
            self.stats.decode_tokens += len(emitted)
            for j, tok in enumerate(emitted):
                top = None
                if tops is not None and s.params.top_logprobs:
                    m = s.params.top_logprobs
                    top = tuple(zip(tops[0][i][j][:m], tops[1][i][j][:m]))
                if self.emit(s, tok, top):
                    break


def prepare_drafter(model: Any, source: Any, spec: SpecConfig, max_batch: int, device: torch.device
                 ) -> tuple[Any, Any]:
    """(drafter, token embedding) for speculative decoding on `model`: `source` is a ReDrafter module or
    its folder; checked against the model, put on the device, and announced on stderr."""
    from server.embedded.redrafter import ReDrafter, int8_vocab_head
    from server.embedded.redrafter import load_drafter as read_drafter

    drafter = source if isinstance(source, ReDrafter) else read_drafter(source)
    cfg = model.config
    if drafter.config.hidden_size != cfg.hidden_size or drafter.config.vocab_size != cfg.vocab_size:
        raise ValueError(f"drafter {source}: hidden_size/vocab_size {drafter.config.hidden_size}/"
                         f"{drafter.config.vocab_size} do not match the model's {cfg.hidden_size}/{cfg.vocab_size}")
    # float32 on the CPU (bf16 matmuls are emulated without AVX-512 BF16); the model's dtype on a GPU
    dtype = torch.float32 if device.type == "cpu" else next(model.parameters()).dtype
    drafter = drafter.to(device, dtype).eval()
    if device.type == "cpu":
        int8_vocab_head(drafter)
    source_of_limit = "serving.speculative.max_batch" if spec.max_batch else f"the measured default for {device.type}"
    when = (f"on while at most {max_batch} sequences run" if max_batch
            else "off: drafting measured slower than plain decoding here; serving.speculative.max_batch turns it on")
    print(f"[embedded] speculative decoding: ReDrafter, {spec.num_beams} beam(s) x {spec.draft_len} draft tokens, "
          f"{when} ({source_of_limit})", file=sys.stderr, flush=True)
    return drafter, model.get_input_embeddings()
