"""The embedded engine: in-flight batching over a slot runner, behind the engine protocol.

On a CPU the runner is `SlotRunner` (the model's own layers, a growing slot cache); on a GPU it is
`GraphRunner` (static KV, fused projections, CUDA graphs per batch bucket) and sampling runs on the
device with one host transfer per step. `device` is `auto` (CUDA when there is one), `cpu` or
`cuda[:N]`; the recipe's serving section sets it (server/embedded/settings.py), and every command
can override it.

The engine wires three parts and owns the thread they run on (as vLLM v1's EngineCore: schedule,
execute, update): the scheduler (scheduler.py: admission, slots, prefix reuse, batch composition), a
runner (base_runner.py), and a step policy (steps.py: plain or speculative decoding). A scheduler
thread owns the model. Each iteration it takes new requests and cancellations from its inbox, ends
expired requests, admits waiting requests into free slots (prefill), runs one decode step for every
running sequence, and streams the new tokens to each request's asyncio queue. Sequences join and
leave at token granularity; a finished or cancelled one gives its slot back before the next step.

All torch work belongs on the engine thread: measured here, a second thread with its own OpenMP pool
(e.g. the main thread having loaded the model) makes every decode step about 2x slower on a 2-core
CPU. `from_dir` therefore loads inside the engine thread.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from aimo_spec.layout import GGUF_FILE
from server.embedded.runner import SlotRunner
from server.embedded.sampler import make_generator
from server.embedded.scheduler import Scheduler
from server.embedded.sequence import EngineStats, Seq
from server.embedded.settings import engine_options, resolve_device
from server.embedded.speculative import DEFAULT_MAX_BATCH, SpecConfig
from server.embedded.steps import PlainStep, SpeculativeStep, prepare_drafter
from server.stream import EngineBase, Outbox, RequestStream


class EmbeddedEngine(EngineBase):
    name = "embedded"
    separates_cache_salts = True  # the scheduler's prefix reuse stays within a salt

    def __init__(self, model: Any = None, tokenizer: Any = None, max_batch_size: int = 16, max_seq_len: int = 4096,
                 max_input_len: Optional[int] = None, prefix_reuse: bool = True, threads: Optional[int] = None,
                 load: Optional[Callable[[], tuple[Any, Any]]] = None, device: str = "auto",
                 runner: str = "auto", compile: bool = False, drafter: Any = None,
                 speculative: Optional[SpecConfig] = None, deterministic: bool = False, kv_cache_dtype: str = "auto",
                 overlap: Optional[bool] = None):
        """Either a loaded (model, tokenizer) or `load`, which the engine thread runs itself.

        `runner`: auto (graph on CUDA, slot on CPU), graph, slot, or llamacpp (a GGUF model loaded by
        llamacpp_runner.LlamaCppModel, on the CPU); `compile`: torch.compile the graph runner's
        elementwise work. `drafter` (a ReDrafter module or its folder) with
        `speculative` turns on speculative decoding. `deterministic`: a request's tokens do not depend
        on what else runs (server/embedded/deterministic.py: the slot runner, one row at a time,
        aligned prefill chunks, no drafting). `kv_cache_dtype`: auto (the model's) or fp8 (base_runner.py).
        `overlap`: launch the next decode step before streaming this one's tokens (steps.py); None: on
        for plain steps of the graph runner on a GPU.
        """
        self.device = resolve_device(device)
        _check_runner(runner, deterministic, self.device, drafter, kv_cache_dtype)
        self.deterministic = deterministic
        self.runner_kind = runner if runner != "auto" else (
            "graph" if self.device.type == "cuda" and not deterministic else "slot")
        if (model is None) == (load is None):
            raise ValueError("EmbeddedEngine: pass either model and tokenizer, or load")
        drafter, speculative = _speculation(drafter, speculative, deterministic)
        self.compile = compile
        self.kv_cache_dtype = kv_cache_dtype
        self.overlap = overlap
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_input_len = max_input_len or max_seq_len - 1
        self.prefix_reuse = prefix_reuse
        self.spec = speculative
        self.spec_max_batch = 0 if speculative is None else (
            speculative.max_batch or DEFAULT_MAX_BATCH.get(self.device.type, 1))
        self._drafter_src = drafter
        self.stats = EngineStats()
        self._inbox: queue.Queue = queue.Queue()
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

    def _run(self, model: Any, tokenizer: Any, load: Optional[Callable[[], tuple[Any, Any]]],
             threads: Optional[int]) -> None:
        try:
            model, tokenizer = _load_here(model, tokenizer, load, threads, self.device, self.runner_kind)
            self.model, self.tokenizer = model, tokenizer
            drafter = None if self.spec is None else prepare_drafter(
                model, self._drafter_src, self.spec, self.spec_max_batch, self.device)
            # drafts are verified up to draft_len positions past the last token a sequence may keep
            capacity = self.max_seq_len + (self.spec.draft_len if self.spec else 0)
            self.runner = _make_runner(self.runner_kind, model, self.max_batch_size, capacity, self.compile,
                                       self.kv_cache_dtype, threads)
            self.step = (PlainStep(self.runner, self.stats, self._emit, self.deterministic, self.overlap)
                         if drafter is None else
                         SpeculativeStep(self.runner, self.stats, self._emit, *drafter, self.spec, self.spec_max_batch))
            self.scheduler = Scheduler(self.runner, self.max_batch_size, self.max_seq_len, self.max_input_len,
                                       self.prefix_reuse, self.deterministic,
                                       getattr(getattr(model, "config", None), "vocab_size", None))
            self.eos_ids = eos_ids(model, tokenizer)
            vocab = getattr(getattr(model, "config", None), "vocab_size", None)
            if vocab and self.device.type == "cuda":  # the sampler's kernels built before the first request
                self.step.warm_up(vocab)
        except BaseException as e:  # reported to the constructor's caller
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop()

    def call_in_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps and return its result (benchmarks use it to
        run other torch code under the same conditions)."""
        done: queue.Queue = queue.Queue()
        self._inbox.put(("call", (fn, done)))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    @classmethod
    def from_dir(cls, engine_dir: str | Path, **overrides: Any) -> "EmbeddedEngine":
        """Serve a folder written by `make engine` (build/embedded/) or a plain HF checkpoint folder;
        `server.embedded.settings.engine_options` says how its settings are resolved. A model folder
        holding a GGUF file (`GGUF_FILE`, with the tokenizer beside it) runs on the llama.cpp runner."""
        model_dir, kw = engine_options(engine_dir, overrides)
        return cls(load=partial(_load_folder, model_dir, kw.get("runner") == "llamacpp"), **kw)

    # ---- the driver (generate, tokenize, detokenize, chat_prompt: EngineBase)
    def _submit(self, stream: RequestStream) -> None:
        gen = make_generator(stream.params.seed)
        with self._life:
            if self._died is None and self._thread.is_alive():
                self._inbox.put(("add", Seq(stream, gen, gen.initial_seed())))
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
            getattr(self.runner, "close", lambda: None)()  # a runner holding native memory (llama.cpp) frees it

    def _thread_died(self, why: str) -> None:
        """Fail every request in flight or still queued; later submissions fail at once (see `alive`)."""
        with self._life:
            self._died = why
            self._fail_all(f"engine thread died: {why}")
            _refuse_queued(self._inbox, f"engine thread died: {why}")

    def _iteration(self) -> bool:
        """One scheduler iteration (messages, expiry, admission, one decode step); False at stop."""
        msgs = _drain(self._inbox, wait=self.scheduler.idle)
        t0 = time.perf_counter()
        for kind, arg in msgs:
            if kind == "stop":
                for s in self.scheduler.in_flight():
                    self._finish(s, "error", error="engine shut down")
                return False
            if kind == "add":
                self.scheduler.add(arg)
                self.stats.requests += 1
            elif kind == "call":
                _answer_call(*arg)
                t0 = time.perf_counter()  # not the engine's own work
            elif kind == "cancel":
                s = self.scheduler.get(arg)
                if s is not None:
                    self._finish(s, "cancelled")
        if self.scheduler.idle:
            return True
        try:
            for s in self.scheduler.expired():
                self._finish(s, "timeout")
            self._admit()
            batch = self.scheduler.batch()
            if batch:
                self.step.decode(batch)
        except Exception as e:  # a failed forward must not take the engine down: fail its requests
            self._fail_all(f"{type(e).__name__}: {e}")
        self.stats.busy_seconds += time.perf_counter() - t0
        return True

    def _admit(self) -> None:
        """Admit waiting requests while slots are free and prefill them, together where the next one
        does not wait on their prompts (`Scheduler.waits_on`): one forward for a problem's samples."""
        admitted: list[Seq] = []
        while True:
            if self.scheduler.waits_on(admitted):
                self.step.prefill_many(admitted)
                admitted = []
            got = self.scheduler.admit_next()
            if got is None:
                if not admitted:
                    return
                self.step.prefill_many(admitted)  # may end requests (a stop at the first token): their slots
                admitted = []  # take the next waiting ones in this iteration
                continue
            seq, refused = got
            if refused:
                self._finish(seq, "error", error=refused)
            else:
                admitted.append(seq)

    def _fail_all(self, error: str) -> None:
        """End every request with an error, forgetting the kept prefixes (`Scheduler.drop_all`)."""
        self.step.discard()
        for seq in self.scheduler.drop_all():
            seq.stream.finish("error", error)

    def _emit(self, s: Seq, tok: int, top: Any) -> bool:
        """Hand one new token to its request; True when that ended the request (end of sequence, a
        stop string, max tokens)."""
        reason = s.accept(tok, top, self.eos_ids)
        if reason is not None:
            self._finish(s, reason)
        return reason is not None

    def _finish(self, seq: Seq, reason: str, error: str = "") -> None:
        if self.scheduler.finish(seq):
            seq.stream.finish(reason, error)  # type: ignore[arg-type]


def _drain(inbox: queue.Queue, wait: bool) -> list[tuple[str, Any]]:
    """Every message in the inbox; with `wait` (nothing to run), first up to half a second for one."""
    msgs = []
    if wait:
        try:
            msgs.append(inbox.get(timeout=0.5))
        except queue.Empty:
            pass
    while True:
        try:
            msgs.append(inbox.get_nowait())
        except queue.Empty:
            return msgs


def _answer_call(fn: Callable[[], Any], done: queue.Queue) -> None:
    """Run a `call_in_engine_thread` function; its result or exception goes back through `done`."""
    try:
        done.put((True, fn()))
    except Exception as e:
        done.put((False, e))


def _refuse_queued(inbox: queue.Queue, error: str) -> None:
    """Fail the requests and calls still in the inbox of an engine thread that died."""
    for kind, arg in _drain(inbox, wait=False):
        if kind == "add":
            arg.stream.finish("error", error)
        elif kind == "call" and isinstance(arg, tuple):
            arg[1].put((False, RuntimeError(error)))


def _load_folder(model_dir: Path, gguf: bool) -> tuple[Any, Any]:
    """(model, tokenizer) of a model folder: its GGUF file through llama.cpp, or its HF checkpoint."""
    from aimo_spec.chat import check_template, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    check_template(tokenizer, str(model_dir))  # before the weights load: a broken template fails in seconds
    try:
        if gguf:
            from server.embedded.llamacpp_runner import LlamaCppModel

            return LlamaCppModel.load(model_dir / GGUF_FILE), tokenizer
        from server.embedded.loader import load_model

        return load_model(model_dir), tokenizer
    except (ImportError, MemoryError):  # setup and memory say what they are
        raise
    except Exception as e:  # noqa: BLE001 - library errors (a shape that does not fit the config) name no file
        raise ValueError(f"{model_dir}: the weights could not be loaded ({type(e).__name__}: {str(e)[:300]})") from e


def _load_here(model: Any, tokenizer: Any, load: Optional[Callable[[], tuple[Any, Any]]], threads: Optional[int],
               device: torch.device, runner: str) -> tuple[Any, Any]:
    """(model on `device`, tokenizer), loaded by the calling thread (the engine's) with its thread count set."""
    if runner == "llamacpp":  # llama.cpp's own threads run the forward; torch's OpenMP pool, spinning after
        torch.set_num_threads(1)  # the sampler's ops, cost it a core (single stream 130 -> 144 tok/s, measured)
    elif threads or not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(threads or max(1, os.cpu_count() or 1))
    if load is not None:
        model, tokenizer = load()
    if device.type != "cpu":
        model = model.to(device)
    return model, tokenizer


def _make_runner(kind: str, model: Any, slots: int, capacity: int, compile: bool, kv_cache_dtype: str,
                 threads: Optional[int]) -> Any:
    if kind == "graph":
        from server.embedded.graph_runner import GraphRunner

        return GraphRunner(model, slots, capacity, compile=compile, kv_cache_dtype=kv_cache_dtype)
    if kind == "llamacpp":
        from server.embedded.llamacpp_runner import LlamaCppRunner

        return LlamaCppRunner(model, slots, capacity, threads=threads)
    return SlotRunner(model, slots, capacity, kv_cache_dtype=kv_cache_dtype)


def _check_runner(runner: str, deterministic: bool, device: torch.device, drafter: Any, kv_cache_dtype: str) -> None:
    if runner not in ("auto", "graph", "slot", "llamacpp"):
        raise ValueError(f"EmbeddedEngine: runner must be auto, graph, slot or llamacpp (got {runner!r})")
    if deterministic and runner in ("graph", "llamacpp"):
        raise ValueError("EmbeddedEngine: deterministic mode runs on the slot runner (runner='slot' or 'auto')")
    if runner == "llamacpp":
        refused = [what for what, on in (("a GPU device", device.type != "cpu"), ("speculative decoding", drafter),
                                           ("an FP8 KV cache", kv_cache_dtype != "auto")) if on]
        if refused:
            raise ValueError(f"EmbeddedEngine: the llama.cpp runner runs on the CPU with its own cache and no "
                             f"drafter; not with {', '.join(refused)}")


def _speculation(drafter: Any, speculative: Optional[SpecConfig], deterministic: bool
                 ) -> tuple[Any, Optional[SpecConfig]]:
    """(drafter, speculative) checked; both None in deterministic mode (said on stderr when that turns it off)."""
    if deterministic and drafter is not None:
        print("[embedded] deterministic mode: speculative decoding off (a verify is another shape)",
              file=sys.stderr, flush=True)
        return None, None
    if (drafter is None) != (speculative is None):
        raise ValueError("EmbeddedEngine: speculative decoding needs both a drafter and a SpecConfig")
    if speculative is not None and speculative.draft_len < 1:
        raise ValueError(f"EmbeddedEngine: draft_len must be >= 1 (got {speculative.draft_len})")
    return drafter, speculative


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Token ids that end a sequence: the model's generation config and config, and the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None)
        ids.update([e] if isinstance(e, int) else (e or []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
