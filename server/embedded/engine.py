"""The embedded engine: in-flight batching over a slot runner, behind the engine protocol.

On a CPU the runner is `SlotRunner` (the model's own layers, a growing slot cache); on a GPU it is
`GraphRunner` (static KV, fused projections, CUDA graphs per batch bucket) and sampling runs on the
device with one host transfer per step. `device` is `auto` (CUDA when there is one), `cpu` or
`cuda[:N]`; engine folders carry it in their serving section, and every command can override it.

A scheduler thread owns the model. Each iteration it takes new requests and cancellations from
its inbox, admits waiting requests into free slots (prefill), runs one decode step for every running
sequence, and streams the new tokens to each request's asyncio queue. Sequences join and leave at
token granularity; a finished or cancelled one gives its slot back before the next step.

Speculative decoding (`speculative.py`): with a ReDrafter head (an engine folder's `drafter/`), each
step drafts L tokens per running sequence and the target verifies all of them for every sequence in
one forward; each sequence keeps its accepted drafts plus one token of the target's, exactly
distributed as without the drafter. Above `max_batch` running sequences (per device, measured) the
step decodes one token per sequence instead; both kinds of step keep the drafter's input current.

Prefix reuse: a slot keeps its KV after its request ends. A new request starts from the longest
common token prefix found in any slot: a finished one is taken over (the next turn of a TIR sample
continues from its own history without re-reading it), a running one is copied (samples of one
problem share the prompt's prefill). `Final.cached_tokens` says how many prompt tokens were reused.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import server.embedded.deterministic as deterministic
from server.embedded.runner import SlotRunner, draft_then_verify
from server.embedded.sampler import make_generator, sample, sample_device
from server.embedded.settings import engine_options, resolve_device
from server.embedded.speculative import DEFAULT_MAX_BATCH, SpecConfig, accept_device, accept_host, top_logprobs
from aimo_spec.protocol import Request, SamplingParams
from server.stream import EngineBase, Outbox, RequestStream


@dataclass
class _Seq:
    """A request in the scheduler: its stream plus where its KV lives."""

    stream: RequestStream
    gen: torch.Generator
    seed: int  # the device sampler's noise key (the CPU sampler uses `gen`)
    slot: int = -1
    kv_len: int = 0  # tokens whose KV is in the slot
    pending: Optional[int] = None  # sampled, not yet in the cache
    max_new: int = 0
    canonical: int = 0  # deterministic mode: leading positions whose KV came from whole aligned prefill chunks
    hidden: Optional[torch.Tensor] = None  # the target's normed hidden state that produced `pending` (drafting)

    @property
    def req(self) -> Request:
        return self.stream.request

    @property
    def params(self) -> SamplingParams:
        return self.stream.params

    @property
    def prompt(self) -> list[int]:
        return self.stream.prompt

    @property
    def generated(self) -> list[int]:
        return self.stream.generated

    @property
    def tokens(self) -> list[int]:
        return self.stream.prompt + self.stream.generated


@dataclass
class EngineStats:
    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    busy_seconds: float = 0.0  # scheduler iterations with work, all included
    requests: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    spec_steps: int = 0  # steps that drafted (speculative decoding)
    spec_rows: int = 0  # sequences in those steps, summed
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def tokens_per_spec_step(self) -> float:
        """Tokens a sequence gains per drafting step: 1 + accepted drafts (what the drafter buys)."""
        return 1.0 + self.accepted_draft_tokens / self.spec_rows if self.spec_rows else 0.0

    def speculative(self) -> Optional[dict[str, Any]]:
        """What speculative decoding did (None when it never drafted): for solve/eval/bench reports."""
        if not self.spec_steps:
            return None
        return {"drafting_steps": self.spec_steps, "steps": self.steps, "draft_tokens": self.draft_tokens,
                "accepted_draft_tokens": self.accepted_draft_tokens,
                "acceptance": round(self.accepted_draft_tokens / self.draft_tokens, 4),
                "tokens_per_step": round(self.tokens_per_spec_step, 4),
                "forward_seconds": round(self.forward_seconds, 3)}

    @property
    def bookkeeping_seconds(self) -> float:
        return max(0.0, self.busy_seconds - self.forward_seconds - self.sample_seconds)


class EmbeddedEngine(EngineBase):
    name = "embedded"

    def __init__(self, model: Any = None, tokenizer: Any = None, max_batch_size: int = 16, max_seq_len: int = 4096,
                 max_input_len: Optional[int] = None, prefix_reuse: bool = True, threads: Optional[int] = None,
                 load: Optional[Callable[[], tuple[Any, Any]]] = None, device: str = "auto",
                 runner: str = "auto", compile: bool = False, drafter: Any = None,
                 speculative: Optional[SpecConfig] = None, deterministic: bool = False):
        """Either a loaded (model, tokenizer) or `load`, which the engine thread runs itself.

        All torch work belongs on the engine thread: measured here, a second thread with its own
        OpenMP pool (e.g. the main thread having loaded the model) makes every decode step about
        2x slower on a 2-core CPU. `from_dir` therefore loads inside the engine thread.
        `runner`: auto (graph on CUDA, slot on CPU), graph or slot; `compile`: torch.compile the
        graph runner's elementwise work. `drafter` (a ReDrafter module or its folder) with
        `speculative` turns on speculative decoding. `deterministic`: a request's tokens do not depend
        on what else runs (server/embedded/deterministic.py: the slot runner, one row at a time,
        aligned prefill chunks, no drafting).
        """
        if runner not in ("auto", "graph", "slot"):
            raise ValueError(f"EmbeddedEngine: runner must be auto, graph or slot (got {runner!r})")
        if deterministic and runner == "graph":
            raise ValueError("EmbeddedEngine: deterministic mode runs on the slot runner (runner='slot' or 'auto')")
        self.device = resolve_device(device)
        self.deterministic = deterministic
        self.runner_kind = runner if runner != "auto" else (
            "graph" if self.device.type == "cuda" and not deterministic else "slot")
        if deterministic and drafter is not None:
            print("[embedded] deterministic mode: speculative decoding off (a verify is another shape)",
                  file=sys.stderr, flush=True)
            drafter, speculative = None, None
        self.compile = compile
        if (model is None) == (load is None):
            raise ValueError("EmbeddedEngine: pass either model and tokenizer, or load")
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_input_len = max_input_len or max_seq_len - 1
        self.prefix_reuse = prefix_reuse
        if (drafter is None) != (speculative is None):
            raise ValueError("EmbeddedEngine: speculative decoding needs both a drafter and a SpecConfig")
        if speculative is not None and speculative.draft_len < 1:
            raise ValueError(f"EmbeddedEngine: draft_len must be >= 1 (got {speculative.draft_len})")
        self.spec = speculative
        self.spec_max_batch = 0 if speculative is None else (
            speculative.max_batch or DEFAULT_MAX_BATCH.get(self.device.type, 1))
        self._drafter_src = drafter
        self.stats = EngineStats()
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: list[_Seq] = []
        self._active: list[_Seq] = []  # active[i].slot == i
        self._parked: dict[int, tuple[list[int], float]] = {}  # slot -> (tokens with KV, last use)
        self._by_id: dict[str, _Seq] = {}
        self._outbox = Outbox()  # one wake-up of the caller's loop per scheduler iteration
        self._closed = False
        self._ready = threading.Event()
        self._load_error: Optional[BaseException] = None
        self._died: Optional[str] = None  # why the scheduler thread ended, when it ended other than by shutdown
        self._life = threading.Lock()  # orders a submission against the thread's death
        self._thread = threading.Thread(target=self._run, args=(model, tokenizer, load, threads),
                                        name="embedded-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    @property
    def alive(self) -> bool:
        """The scheduler thread is running (liveness, not a flag: a thread that died says so here)."""
        return self._thread.is_alive() and self._died is None and self._load_error is None and not self._closed

    @property
    def ready(self) -> bool:
        """Loaded and serving (false before, after shutdown, and once the engine thread died)."""
        return self._ready.is_set() and self.alive

    def _run(self, model: Any, tokenizer: Any, load: Optional[Callable[[], tuple[Any, Any]]], threads: Optional[int]) -> None:
        try:
            if threads or not os.environ.get("OMP_NUM_THREADS"):
                torch.set_num_threads(threads or max(1, os.cpu_count() or 1))
            if load is not None:
                model, tokenizer = load()
            if self.device.type != "cpu":
                model = model.to(self.device)
            self.model, self.tokenizer = model, tokenizer
            if self.spec is not None:
                self._load_drafter(model)
            # drafts are verified up to draft_len positions past the last token a sequence may keep
            capacity = self.max_seq_len + (self.spec.draft_len if self.spec else 0)
            if self.runner_kind == "graph":
                from server.embedded.graph_runner import GraphRunner

                self.runner = GraphRunner(model, self.max_batch_size, capacity, compile=self.compile)
            else:
                self.runner = SlotRunner(model, self.max_batch_size, capacity)
            self.eos_ids = self._eos_ids(model, tokenizer)
        except BaseException as e:  # reported to the constructor's caller
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop()

    def _load_drafter(self, model: Any) -> None:
        from server.embedded.redrafter import ReDrafter, load_drafter

        d = self._drafter_src
        drafter = d if isinstance(d, ReDrafter) else load_drafter(d)
        cfg = model.config
        if drafter.config.hidden_size != cfg.hidden_size or drafter.config.vocab_size != cfg.vocab_size:
            raise ValueError(f"drafter {d}: hidden_size/vocab_size {drafter.config.hidden_size}/{drafter.config.vocab_size} "
                             f"do not match the model's {cfg.hidden_size}/{cfg.vocab_size}")
        # float32 on the CPU (bf16 matmuls are emulated without AVX-512 BF16); the model's dtype on a GPU
        dtype = torch.float32 if self.device.type == "cpu" else next(model.parameters()).dtype
        self.drafter = drafter.to(self.device, dtype).eval()
        if self.device.type == "cpu":
            from server.embedded.redrafter import int8_vocab_head

            int8_vocab_head(self.drafter)
        self.embed = model.get_input_embeddings()
        spec = self.spec
        source = "serving.speculative.max_batch" if spec.max_batch else f"the measured default for {self.device.type}"
        when = (f"on while at most {self.spec_max_batch} sequences run" if self.spec_max_batch
                else "off: drafting measured slower than plain decoding here; serving.speculative.max_batch turns it on")
        print(f"[embedded] speculative decoding: ReDrafter, {spec.num_beams} beam(s) x {spec.draft_len} draft tokens, "
              f"{when} ({source})", file=sys.stderr, flush=True)

    def call_in_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps and return its result (benchmarks use it to
        run other torch code under the same conditions)."""
        done: queue.Queue = queue.Queue()
        self._inbox.put(("call", (fn, done)))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    # ---- construction
    @classmethod
    def from_dir(cls, engine_dir: str | Path, **overrides: Any) -> "EmbeddedEngine":
        """Serve a folder written by `make engine` (build/embedded/) or a plain HF checkpoint folder;
        `server.embedded.settings.engine_options` says how its settings are resolved."""
        from server.embedded.loader import load_model
        from aimo_spec.chat import load_tokenizer

        model_dir, kw = engine_options(engine_dir, overrides)
        return cls(load=lambda: (load_model(model_dir), load_tokenizer(model_dir)), **kw)

    @staticmethod
    def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
        ids: set[int] = set()
        for src in (getattr(model, "generation_config", None), model.config):
            e = getattr(src, "eos_token_id", None)
            ids.update([e] if isinstance(e, int) else (e or []))
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- the driver (generate, tokenize, detokenize, chat_prompt: EngineBase)
    def _submit(self, stream: RequestStream) -> None:
        gen = make_generator(stream.params.seed)
        with self._life:
            if self._died is None and self._thread.is_alive():
                self._inbox.put(("add", _Seq(stream, gen, gen.initial_seed())))
                return
        stream.finish("error", f"engine thread is not running ({self._died or 'stopped'})")
        self._outbox.flush()

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    # ---- the scheduler thread
    def _loop(self) -> None:
        try:
            while self._iteration():
                self._outbox.flush()  # the step's events reach their callers with one wake-up
        except BaseException as e:  # the thread is going: no request may wait on it forever
            self._thread_died(f"{type(e).__name__}: {e}")
            raise
        finally:
            self._outbox.flush()

    def _thread_died(self, why: str) -> None:
        """Fail every request in flight or still queued; later submissions fail at once (see `alive`)."""
        with self._life:
            self._died = why
            self._fail_all(f"engine thread died: {why}")
            while True:
                try:
                    kind, arg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    arg.stream.finish("error", f"engine thread died: {why}")
                elif kind == "call" and isinstance(arg, tuple):
                    arg[1].put((False, RuntimeError(f"engine thread died: {why}")))

    def _iteration(self) -> bool:
        """One scheduler iteration (messages, expiry, admission, one decode step); False at stop."""
        block = not self._active and not self._waiting
        try:
            msgs = [self._inbox.get(timeout=0.5 if block else None)] if block else []
        except queue.Empty:
            msgs = []
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        t0 = time.perf_counter()
        for kind, arg in msgs:
            if kind == "stop":
                for s in self._active + self._waiting:
                    self._finish(s, "error", error="engine shut down")
                return False
            if kind == "add":
                self._by_id[arg.req.request_id] = arg
                self._waiting.append(arg)
                self.stats.requests += 1
            elif kind == "call":
                fn, done = arg
                try:
                    done.put((True, fn()))
                except Exception as e:
                    done.put((False, e))
                t0 = time.perf_counter()  # not the engine's own work
            elif kind == "cancel":
                s = self._by_id.get(arg)
                if s is not None:
                    self._finish(s, "cancelled")
        if not self._active and not self._waiting:
            return True
        try:
            self._expire()
            self._admit()
            self._decode()
        except Exception as e:  # a failed forward must not take the engine down: fail its requests
            self._fail_all(f"{type(e).__name__}: {e}")
        self.stats.busy_seconds += time.perf_counter() - t0
        return True

    def _fail_all(self, error: str) -> None:
        """End every request with an error without touching the cache (its state is unknown after a
        failed step) and forget the kept prefixes, so the next requests start clean."""
        for seq in self._active + self._waiting:
            if self._by_id.pop(seq.req.request_id, None) is not None:
                seq.stream.finish("error", error)
        self._active, self._waiting = [], []
        self._parked.clear()

    def _expire(self) -> None:
        now = time.monotonic()
        for s in self._active + self._waiting:
            if s.req.deadline is not None and now >= s.req.deadline:
                self._finish(s, "timeout")

    # slots: active sequences occupy 0..len(active)-1; the rest are parked (KV kept for reuse)
    def _slot_tokens(self, slot: int) -> list[int]:
        """The tokens whose KV a new request may reuse from `slot` (deterministic mode: canonical KV only)."""
        if slot < len(self._active):
            s = self._active[slot]
            return s.tokens[:s.canonical if self.deterministic else s.kv_len]
        return self._parked.get(slot, ([], 0.0))[0]

    def _move_parked(self, src: int, dst: int) -> None:
        """Exchange two parked (or free) slots, data and bookkeeping."""
        if src == dst:
            return
        a, b = self._parked.pop(src, None), self._parked.pop(dst, None)
        self.runner.swap(src, dst, max(len(a[0]) if a else 0, len(b[0]) if b else 0))
        if a:
            self._parked[dst] = a
        if b:
            self._parked[src] = b

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.max_batch_size:
            seq = self._waiting.pop(0)
            n = len(seq.prompt)
            if n == 0 or n > self.max_input_len:
                self._finish(seq, "error", error=f"prompt of {n} tokens: must be 1..{self.max_input_len} (max_input_len)")
                continue
            seq.max_new = min(seq.params.max_tokens, self.max_seq_len - n)
            if seq.max_new < 1:
                self._finish(seq, "error", error=f"prompt of {n} tokens leaves no room below max_seq_len {self.max_seq_len}")
                continue
            slot = len(self._active)
            best, best_len = -1, 0
            if self.prefix_reuse:
                for s in range(self.max_batch_size):
                    toks = self._slot_tokens(s)
                    m = min(len(toks), n - 1)  # keep one token to compute: its logits start the reply
                    i = 0
                    while i < m and toks[i] == seq.prompt[i]:
                        i += 1
                    if self.deterministic:
                        i = deterministic.whole_chunks(i)
                    if i > best_len or (i == best_len and i > 0 and s >= slot and best < slot):
                        best, best_len = s, i
            if best >= slot:  # a parked slot: take it over
                self._move_parked(best, slot)
                self._parked.pop(slot, None)
            else:
                victim = min(range(slot, self.max_batch_size), key=lambda s: self._parked.get(s, ([], -1.0))[1])
                self._move_parked(victim, slot)
                self._parked.pop(slot, None)
                if best >= 0:
                    self.runner.copy(best, slot, best_len)
            seq.slot, seq.kv_len = slot, best_len
            seq.stream.cached_tokens, seq.stream.scheduled = best_len, time.monotonic()
            self._active.append(seq)
            self.stats.cached_tokens += best_len
            t0 = time.perf_counter()
            out = None
            chunk = deterministic.CHUNK if self.deterministic else 512  # best_len is a multiple of CHUNK there
            for start in range(best_len, n, chunk):
                out = self.runner.prefill(slot, seq.prompt[start:start + chunk], start, hidden=self.spec is not None)
            self.stats.forward_seconds += time.perf_counter() - t0
            self.stats.prefill_tokens += n - best_len
            seq.kv_len = n
            seq.canonical = deterministic.whole_chunks(n)
            if self.spec is not None:
                self._sampled([seq], out[0].unsqueeze(0), out[1].unsqueeze(0))
            else:
                self._sampled([seq], out.unsqueeze(0))

    def _decode(self) -> None:
        live = [s for s in self._active if s.pending is not None]
        if not live:
            return
        assert all(s.slot == i for i, s in enumerate(self._active))
        if self.spec is not None and len(self._active) <= self.spec_max_batch:
            self._decode_speculative()
            return
        t0 = time.perf_counter()
        decode = partial(deterministic.decode_rows, self.runner) if self.deterministic else self.runner.decode
        out = decode([s.pending for s in self._active], [s.kv_len for s in self._active], hidden=self.spec is not None)
        logits, hidden = out if self.spec is not None else (out, None)
        self.stats.forward_seconds += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.decode_tokens += len(self._active)
        self.stats.batch_sizes.append(len(self._active))
        for s in self._active:
            s.kv_len += 1
        self._sampled(list(self._active), logits, hidden)

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
    def _decode_speculative(self) -> None:
        """Draft L tokens per sequence, verify all rows in one forward, keep each row's accepted run
        plus the target's next token (speculative.py has the rule)."""
        seqs, spec, dev = list(self._active), self.spec, self.runner.device
        n, L = len(seqs), spec.draft_len
        t0 = time.perf_counter()
        first = torch.tensor([s.pending for s in seqs], dtype=torch.long, device=dev)
        context, starts = torch.stack([s.hidden for s in seqs]), [s.kv_len for s in seqs]
        if spec.num_beams == 1:  # drafting and verification in one step (on CUDA one graph replay)
            drafts, logits, hidden = self.runner.draft_verify(self._draft, context, first, starts, L)
        else:  # beam search picks beams on the host: not capturable
            drafts, logits, hidden = draft_then_verify(self.runner, self._draft, context, first, starts)
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
                if self._emit(s, tok, top):
                    break

    def _sampled(self, seqs: list[_Seq], logits: torch.Tensor, hidden: Optional[torch.Tensor] = None) -> None:
        t0 = time.perf_counter()
        if logits.device.type == "cpu":
            toks, tops = sample(logits, [s.params for s in seqs], [s.gen for s in seqs])
        else:
            toks, tops = sample_device(logits, [s.params for s in seqs], [s.seed for s in seqs],
                                       [len(s.generated) for s in seqs])
        self.stats.sample_seconds += time.perf_counter() - t0
        for i, (s, tok, top) in enumerate(zip(seqs, toks, tops)):
            if hidden is not None:
                s.hidden = hidden[i]
            self._emit(s, tok, top)

    def _emit(self, s: _Seq, tok: int, top: Any) -> bool:
        """Hand one new token to its request; True when that ended the request (end of sequence, a
        stop string, max tokens)."""
        s.pending = tok
        eos = (tok in self.eos_ids and not s.params.ignore_eos) or tok in s.params.stop_token_ids
        matched = s.stream.push((tok,), (top,) if top is not None else None, text=not eos)
        reason = "stop" if eos or matched is not None else "length" if len(s.generated) >= s.max_new else None
        if reason is None:
            return False
        s.kv_len = min(s.kv_len, len(s.tokens))  # a run cut short: accepted drafts past the end are not kept
        self._finish(s, reason)
        return True

    def _finish(self, seq: _Seq, reason: str, error: str = "") -> None:
        if self._by_id.pop(seq.req.request_id, None) is None:
            return  # already final
        if seq in self._waiting:
            self._waiting.remove(seq)
        if seq.slot >= 0 and seq.slot < len(self._active) and self._active[seq.slot] is seq:
            i, last = seq.slot, len(self._active) - 1
            if i != last:
                other = self._active[last]
                self.runner.swap(i, last, max(seq.kv_len, other.kv_len))
                self._active[i], other.slot = other, i
            self._active.pop()
            kept = seq.canonical if self.deterministic else seq.kv_len
            self._parked[last] = (seq.tokens[:kept], time.monotonic())
        seq.stream.finish(reason, error)  # type: ignore[arg-type]
