"""`predict(id_, problem)` for the AIMO inference servers (kaggle_evaluation), wired to the solver.

The gateway calls `predict` one problem at a time with two single-row polars Series and wants a
DataFrame with `id` and an integer `answer` back. The server must answer the gateway quickly at
start, so the engine loads lazily inside the first call (with a heartbeat in the log while it
loads). Whatever happens (a solver error, the deadline, an engine that died) `predict` returns a
valid integer and logs why; an engine found dead is rebuilt and the current problem continues from
fresh samples in the time it has left.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from trtbuild.core.recipe import ServingSpec, parse_section

HEARTBEAT_SECONDS = 30.0
MIN_RETRY_SECONDS = 5.0  # a restart is worth it only with this much of the problem's time left


def _log(msg: str) -> None:
    print(f"[predict] {msg}", file=sys.stderr, flush=True)


class Predictor:
    """Holds the engine, sandbox, solver and the run's time budget across calls."""

    def __init__(self, engine_dir: str | Path, problems: int = 50, answer_range: Optional[int] = None,
                 samples: Optional[int] = None, log: Callable[[str], None] = _log,
                 engine_factory: Optional[Callable[[], Any]] = None, url: str = ""):
        """`url`: solve through OpenAI-compatible server(s) there (comma-separated replicas; the engine
        folder still gives the serving section and the tokenizer) instead of opening the engine here."""
        self.engine_dir, self.url = Path(engine_dir), url
        spec_file = self.engine_dir / "engine.json"
        if not spec_file.is_file():
            raise FileNotFoundError(f"{spec_file}: no engine folder (copy build/embedded/ of `make engine`)")
        self.spec = json.loads(spec_file.read_text())
        self.serving: ServingSpec = parse_section(self.spec["serving"], ServingSpec, "serving", str(spec_file))
        self.problems, self.samples, self.log = problems, samples, log
        modulus = self.serving.solver.modulus
        self.answer_range = answer_range or modulus  # answers are reported in [0, range) when set
        self.engine_factory = engine_factory or self._open_engine
        self.engine: Any = None
        self.sandbox: Any = None
        self.budget: Any = None
        self.restarts = 0
        self.calls = 0

    # ---- lazy start
    def _open_engine(self) -> Any:
        from server.backends import driver, open_engine

        if self.url:
            return driver("openai")(self.url, str(self.engine_dir / self.spec.get("model_dir", "model")))
        return open_engine(self.engine_dir)

    def _load(self) -> None:
        done = threading.Event()
        t0 = time.monotonic()

        def heartbeat() -> None:  # keep the log (and the notebook's output) alive during a slow load
            while not done.wait(HEARTBEAT_SECONDS):
                self.log(f"still loading the engine ({time.monotonic() - t0:.0f}s)")
        threading.Thread(target=heartbeat, daemon=True).start()
        try:
            self.engine = self.engine_factory()
        finally:
            done.set()
        self.log(f"engine {self.spec.get('backend')} loaded in {time.monotonic() - t0:.1f}s")

    def _ensure(self) -> None:
        if self.budget is None:
            from server.budget import TimeBudget

            self.budget = TimeBudget(self.serving.budget, self.problems)
        if self.sandbox is None:
            from server.assembly import sandbox_for

            self.sandbox = sandbox_for(self.serving.tool)
        if self.engine is None or not self._alive():
            if self.engine is not None:
                self.restarts += 1
                self.log(f"engine found dead: restarting it (restart {self.restarts})")
                self._close_engine()
            self._load()

    def _alive(self) -> bool:
        ready = getattr(self.engine, "ready", True)
        return bool(ready)

    def _close_engine(self) -> None:
        try:
            asyncio.run(self.engine.close())
        except Exception as e:  # noqa: BLE001 - a dead engine may not close cleanly
            self.log(f"closing the old engine: {type(e).__name__}: {e}")
        self.engine = None

    def _solver(self) -> Any:
        from server.assembly import build_solver

        return build_solver(self.serving, self.engine, self.sandbox, self.samples)

    # ---- one problem
    def solve(self, pid: str, text: str) -> int:
        """The answer for one problem within its share of the run's time; never raises."""
        default = self.serving.solver.default_answer
        try:
            self._ensure()
        except Exception as e:  # noqa: BLE001 - no engine at all: answer anyway
            self.log(f"{pid}: no engine ({type(e).__name__}: {e}); answering {default}")
            return default
        allowance = self.budget.allowance()
        deadline_budget = self.budget.start()
        deadline = time.monotonic() + (deadline_budget - self.budget.clock())
        answer, attempt = default, 0
        try:
            while True:
                attempt += 1
                try:
                    result = asyncio.run(self._solver().solve(f"{pid}#{attempt}" if attempt > 1 else pid, text, deadline))
                    answer = result.answer
                    engine_failed = result.traces and all(t.finish == "error" for t in result.traces)
                    self.log(f"{pid}: answer {answer} (votes {dict(result.votes)}, {result.finished} finished, "
                             f"stop {result.stop_rule}, {result.seconds:.1f}s of {allowance:.0f}s)")
                except Exception as e:  # noqa: BLE001 - the solver itself failed
                    engine_failed = True
                    self.log(f"{pid}: solver failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
                if not engine_failed or self._alive() and attempt > 1:
                    break
                if deadline - time.monotonic() < MIN_RETRY_SECONDS:
                    self.log(f"{pid}: the engine failed and too little time is left to retry; answering {answer}")
                    break
                self.restarts += 1
                self.log(f"{pid}: engine failure; restarting it and continuing from fresh samples "
                         f"({deadline - time.monotonic():.0f}s left)")
                self._close_engine()
                self._load()
        finally:
            self.budget.finish()
        return self.clamp(answer)

    def clamp(self, answer: Any) -> int:
        try:
            value = int(answer)
        except (TypeError, ValueError):
            return self.serving.solver.default_answer
        return value % self.answer_range if self.answer_range else value

    def predict(self, id_: Any, problem: Any) -> Any:
        """The competition's signature: single-row polars Series in, DataFrame(id, answer) out."""
        import polars as pl

        self.calls += 1
        pid = str(id_.item(0)) if hasattr(id_, "item") else str(id_)
        text = str(problem.item(0)) if hasattr(problem, "item") else str(problem)
        t0 = time.monotonic()
        answer = self.solve(pid, text)
        self.log(f"{pid}: returned {answer} after {time.monotonic() - t0:.1f}s "
                 f"({self.budget.time_left() if self.budget else 0:.0f}s left in the run)")
        return pl.DataFrame({"id": [pid], "answer": [int(answer)]})

    def close(self) -> None:
        if self.engine is not None:
            self._close_engine()
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
