"""`predict(*row)` for the AIMO inference servers (kaggle_evaluation), wired to the solver.

The gateway calls `predict` one problem at a time with one single-row polars Series per CSV column
(id, problem, and e.g. answer, ignored) and wants a DataFrame(id, answer) back, the id exactly as
given. The server must answer the gateway quickly at start, so the engine loads lazily inside the
first call (with a heartbeat in the log while it loads).

Failures are loud where a zero submission would hide them, quiet where an answer is still right:
- the engine folder is checked when the predictor is made (a broken folder raises at once);
- an engine that cannot be loaded at all in the first call raises (the notebook fails, the
  gateway reports it), and so does a sandbox that cannot start;
- once loaded, an engine found dead (its thread gone, not just a flag) or failing every sample is
  restarted, and the problem continues from fresh samples in the time it has left;
- a problem that lost its tools (the sandbox lost its code calls) is retried by the solver in the
  time it has left; the log says so and `tools_lost` keeps which problems and why;
- a problem that cannot be asked (null or empty text, a prompt over `max_input_len`) is answered
  with `default_answer` and a log line that says why, without touching the engine;
- answers are integers in [0, answer_range) (AIMO-2: 1000, AIMO-3: 100000), never wider than Int64.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from aimo_spec.jsonfile import read_json
from aimo_spec.recipe import ANSWER_RANGES, ServingSpec, parse_section
from server.embedded.settings import serving_settings
from server.kaggle.rows import answer_frame, read_rows
from server.problems import tools_note

HEARTBEAT_SECONDS = 30.0
MIN_RETRY_SECONDS = 5.0  # a restart is worth it only with this much of the problem's time left
SERVING_FILE = "serving.json"  # in the Kaggle dataset, beside engine/: the recipe's serving section (make kaggle)


class EngineStartError(RuntimeError):
    """The engine (or the sandbox it needs) could not be started: no answer would be worth anything."""


def _log(msg: str) -> None:
    print(f"[predict] {msg}", file=sys.stderr, flush=True)


def read_serving(path: str | Path) -> ServingSpec:
    """A serving section as `make kaggle` writes it (SERVING_FILE: the recipe's `serving`), validated
    like the recipe; errors name the file."""
    data = read_json(path, f"no serving settings (`make kaggle` writes {SERVING_FILE} beside engine/)",
                     "rebuild the dataset with `make kaggle`")
    return parse_section(data, ServingSpec, "serving", str(path))


class Predictor:
    """Holds the engine, sandbox, solver and the run's time budget across calls."""

    def __init__(self, engine_dir: str | Path, problems: int = 50, answer_range: Optional[int] = None,
                 samples: Optional[int] = None, log: Callable[[str], None] = _log,
                 engine_factory: Optional[Callable[[], Any]] = None, url: str = "", competition: str = "aimo3",
                 started_at: Optional[float] = None, serving: ServingSpec | str | Path | None = None):
        """`serving`: the serving settings (a `ServingSpec`, or the dataset's SERVING_FILE; None: the
        defaults), under this process's environment (`serving_settings`). `url`: solve through
        OpenAI-compatible server(s) there (comma-separated replicas; the engine folder still gives the
        tokenizer) instead of opening the engine here. `answer_range`: answers modulo this (default: the
        competition's). `started_at`: the notebook's start (time.time()), to report the time to the
        first call and the first answer."""
        from server.backends import read_engine_file
        from server.engine_check import EngineFolderError, check_engine_folder

        self.engine_dir, self.url = Path(engine_dir), url
        try:  # a folder the factory does not open still gives the limits and the tokenizer: check what is read
            self.spec = check_engine_folder(self.engine_dir) if engine_factory is None and not url \
                else read_engine_file(self.engine_dir)
        except (FileNotFoundError, ValueError) as e:
            raise EngineFolderError(f"{e} (the Kaggle dataset's engine/ is a copy of build/embedded/ or "
                                    "build/trtllm/ from `make engine`)") from None
        self.serving: ServingSpec = serving_settings(
            read_serving(serving) if isinstance(serving, (str, Path)) else serving)
        self.max_input_len = int((self.spec.get("limits") or {}).get("max_input_len") or 0)
        self.problems, self.samples, self.log = problems, samples, log
        if competition not in ANSWER_RANGES:
            raise ValueError(f"competition must be one of {', '.join(ANSWER_RANGES)} (got {competition!r})")
        self.answer_range = answer_range or ANSWER_RANGES[competition]
        if self.answer_range < 2:
            raise ValueError(f"answer_range must be >= 2 (got {self.answer_range})")
        self.engine_factory = engine_factory or self._open_engine
        self.engine: Any = None
        self.sandbox: Any = None
        self.budget: Any = None
        self.restarts = 0
        self.tools_lost: dict[str, str] = {}  # problem id -> what happened (server.problems.tools_note)
        self.calls = 0
        self.started_at = started_at if started_at is not None else time.time()
        self.timings: dict[str, float] = {}

    # ---- lazy start
    def _open_engine(self) -> Any:
        from server.backends import driver, open_engine

        if self.url:
            return driver("openai")(self.url, str(self.engine_dir / self.spec.get("model_dir", "model")))
        return open_engine(self.engine_dir, self.serving, check_folder=False)  # checked when this was made

    def _load(self) -> None:
        done = threading.Event()
        t0 = time.monotonic()

        def heartbeat() -> None:  # keep the log (and the notebook's output) alive during a slow load
            while not done.wait(HEARTBEAT_SECONDS):
                self.log(f"still loading the engine ({time.monotonic() - t0:.0f}s)")
        threading.Thread(target=heartbeat, daemon=True).start()
        try:
            self.engine = self.engine_factory()
        except Exception as e:  # noqa: BLE001 - said once, clearly, by the caller's error
            raise EngineStartError(f"the engine in {self.engine_dir} could not be loaded: "
                                   f"{type(e).__name__}: {e}") from e
        finally:
            done.set()
        self.log(f"engine {self.spec.get('backend')} loaded in {time.monotonic() - t0:.1f}s")

    def _ensure(self) -> None:
        if self.budget is None:
            from server.budget import TimeBudget

            self.budget = TimeBudget(self.serving.budget, self.problems)
        if self.sandbox is None:
            from server.assembly import sandbox_for

            try:
                self.sandbox = sandbox_for(self.serving.tool)
            except Exception as e:  # noqa: BLE001 - not an engine problem: say which part failed
                raise EngineStartError(f"the python sandbox pool could not start: {type(e).__name__}: {e}") from e
        if self.engine is None or not self._alive():
            if self.engine is not None:
                self.restarts += 1
                self.log(f"engine found dead: restarting it (restart {self.restarts})")
                self._close_engine()
            self._load()

    def _alive(self) -> bool:
        """Liveness, not a flag: an engine that reports `alive` (its thread runs) is asked that."""
        alive = getattr(self.engine, "alive", None)
        return bool(getattr(self.engine, "ready", True) if alive is None else alive)

    def _close_engine(self) -> None:
        try:
            asyncio.run(self.engine.close())
        except Exception as e:  # noqa: BLE001 - a dead engine may not close cleanly
            self.log(f"closing the old engine: {type(e).__name__}: {e}")
        self.engine = None

    def _solver(self) -> Any:
        from server.assembly import build_solver

        return build_solver(self.serving, self.engine, self.sandbox, self.samples)

    def _unaskable(self, text: Optional[str]) -> Optional[str]:
        """Why the problem cannot be given to the engine (None: it can)."""
        if text is None:
            return "the problem text is null or empty"
        if not self.max_input_len or not hasattr(self.engine, "chat_ids"):
            return None
        try:
            n = len(self.engine.chat_ids(text, self.serving.system_prompt))
        except Exception as e:  # noqa: BLE001 - cannot count here: the engine itself will say
            self.log(f"could not count the prompt's tokens ({type(e).__name__}: {e}); asking the engine")
            return None
        if n > self.max_input_len:
            return f"its prompt is {n} tokens, over the engine's max_input_len {self.max_input_len}"
        return None

    # ---- one problem
    def solve(self, pid: str, text: Optional[str]) -> int:
        """The answer for one problem within its share of the run's time. Raises EngineStartError only
        when no engine can be had (the first load, or a restart, failed)."""
        default = self.serving.solver.default_answer
        self._ensure()
        why = self._unaskable(text)
        if why:
            self.log(f"{pid}: not asked: {why}; answering {default}")
            return self.clamp(default)
        allowance = self.budget.allowance()
        deadline_budget = self.budget.start()
        deadline = time.monotonic() + (deadline_budget - self.budget.clock())
        answer, attempt = default, 0
        try:
            if allowance <= 0:  # the run's time is spent: samples started now would only overrun it
                self.log(f"{pid}: no time left in the run; answering {default}")
                return self.clamp(default)
            while True:
                attempt += 1
                try:
                    result = asyncio.run(self._solver().solve(f"{pid}#{attempt}" if attempt > 1 else pid, text,
                                                              deadline))
                    answer = result.answer
                    engine_failed = bool(result.traces) and all(t.finish == "error" for t in result.traces)
                    self.log(f"{pid}: answer {answer} (votes {dict(result.votes)}, {result.finished} finished, "
                             f"stop {result.stop_rule}, {result.seconds:.1f}s of {allowance:.0f}s)"
                             + (f"; every sample failed: {result.traces[0].error}" if engine_failed else "")
                             + (f"; LOST ITS TOOLS: {tools_note(result)}" if result.tool_failure else ""))
                    if result.tool_failure:
                        self.tools_lost[pid] = tools_note(result)
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
        """An integer in [0, answer_range): anything else becomes default_answer (also reduced)."""
        try:
            value = int(answer)
        except (TypeError, ValueError, OverflowError):
            value = int(self.serving.solver.default_answer)
        return value % self.answer_range

    def predict(self, *args: Any) -> Any:
        """The competition's calling convention: `predict(*row)`, one single-row polars Series per CSV
        column (id, problem, ...; the rest ignored), or one DataFrame with id and problem. Returns
        DataFrame(id, answer), the ids exactly as given."""
        self.calls += 1
        if "first_call" not in self.timings:
            self.timings["first_call"] = round(time.time() - self.started_at, 2)
            self.log(f"first predict call {self.timings['first_call']:.1f}s after the notebook started")
        rows = read_rows(args)
        if not len(rows):
            self.log("predict was given no rows; returning an empty DataFrame(id, answer)")
        answers = []
        for pid_value, text in zip(rows.ids.to_list(), rows.texts):
            pid, t0 = str(pid_value), time.monotonic()
            answers.append(self.solve(pid, text))
            self.log(f"{pid}: returned {answers[-1]} after {time.monotonic() - t0:.1f}s "
                     f"({self.budget.time_left() if self.budget else 0:.0f}s left in the run)")
        if answers and "first_answer" not in self.timings:
            self.timings["first_answer"] = round(time.time() - self.started_at, 2)
        return answer_frame(rows, answers)

    def close(self) -> None:
        if self.engine is not None:
            self._close_engine()
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
