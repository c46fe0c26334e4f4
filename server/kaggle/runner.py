"""Start serving `predict`: Kaggle's own inference server when it is there, else the local gateway.

- Under KAGGLE_IS_COMPETITION_RERUN (the scored run) only the competition's server will do: an
  import failure there (no `kaggle_evaluation`, no `grpc`) is an error, never a quiet switch to the
  local gateway, which would write a submission nobody reads.
- Otherwise the competition's `run_local_gateway((csv,))` when `kaggle_evaluation` imports (it is
  looked for under /kaggle/input too), else this project's local gateway (server/kaggle/gateway.py).
- The competition's server is given `predict` as a plain function named `predict` (see as_listener).
"""

from __future__ import annotations

import glob
import importlib
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from server.kaggle.competitions import RERUN_ENV, competition
from server.kaggle.gateway import read_frame, run

KAGGLE_INPUT = os.environ.get("AIMO_KAGGLE_INPUT", "/kaggle/input")  # where Kaggle mounts data (tests move it)


class KaggleServerError(RuntimeError):
    """The competition's inference server is needed (the rerun) and cannot be used."""


def add_kaggle_evaluation_path(roots: Optional[Sequence[str]] = None) -> Optional[str]:
    """Put the folder holding `kaggle_evaluation/` (the competition's data, wherever mounted) on sys.path."""
    for root in roots or (os.environ.get("AIMO_KAGGLE_INPUT", KAGGLE_INPUT),):
        for init in sorted(glob.glob(os.path.join(root, "*", "kaggle_evaluation", "__init__.py"))
                           + glob.glob(os.path.join(root, "*", "*", "kaggle_evaluation", "__init__.py"))):
            parent = str(Path(init).parents[1])
            if parent not in sys.path:
                sys.path.append(parent)
            return parent
    return None


def import_server(name: str) -> Any:
    """The competition's InferenceServer class; ImportError (with the reason) when it cannot be had."""
    comp = competition(name)
    add_kaggle_evaluation_path()
    try:
        return getattr(importlib.import_module(comp.server_module), comp.server_class)
    except SystemExit as e:  # kaggle_evaluation exits when its generated gRPC files are missing
        raise ImportError(f"{comp.server_module} exited on import ({e})") from None
    except AttributeError as e:
        raise ImportError(f"{comp.server_module} has no {comp.server_class}: {e}") from None


def as_listener(fn: Callable) -> Callable:
    """`fn` as the competition's server takes it: AIMO-3's accepts only a plain function (a bound method, a
    functools.partial or a callable object is a ValueError) and both key it by its name, which the gateway
    calls as `predict`; anything else is wrapped in such a function."""
    if isinstance(fn, types.FunctionType) and fn.__name__ == "predict":
        return fn

    def predict(*row: Any) -> Any:
        return fn(*row)
    return predict


def serve(predict: Callable, problems_csv: Optional[str] = None, out: str = "/kaggle/working",
          competition: str = "aimo3", started_at: Optional[float] = None, log: Callable[[str], None] = print
          ) -> Optional[dict]:
    """Run `predict` under the competition's server (the rerun, or its local gateway) or ours."""
    rerun = bool(os.getenv(RERUN_ENV))
    try:
        server_cls = import_server(competition)
    except ImportError as e:
        if rerun:
            raise KaggleServerError(f"{RERUN_ENV} is set but the competition's inference server cannot be "
                                    f"imported ({type(e).__name__}: {e}); the scored run needs kaggle_evaluation and "
                                    "grpc, and must not fall back to the local gateway") from e
        server_cls = None
        log(f"[kaggle] no kaggle_evaluation ({e}); running this project's local gateway")
    if server_cls is not None:
        server = server_cls(as_listener(predict))
        if rerun:
            server.serve()
        else:
            if not problems_csv:
                raise FileNotFoundError("the competition's local gateway needs a problems CSV")
            read_frame(Path(problems_csv))  # refused as our gateway refuses it: no null id in the submission
            server.run_local_gateway((str(problems_csv),))
        return None
    if not problems_csv:
        raise FileNotFoundError("no kaggle_evaluation module and no problems CSV for the local gateway")
    return run(predict, Path(problems_csv), Path(out), competition=competition, started_at=started_at)
