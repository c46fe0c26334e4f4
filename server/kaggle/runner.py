"""Start serving `predict`: Kaggle's own inference server when it is there, else the local gateway.

On Kaggle, the competition ships `kaggle_evaluation` with the data: `serve()` is called when
KAGGLE_IS_COMPETITION_RERUN is set, `run_local_gateway((csv,))` otherwise. Off Kaggle (or without
the module) the local gateway (server/kaggle/gateway.py) runs the same calls.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable, Optional

SERVERS = {"aimo3": ("kaggle_evaluation.aimo_3_inference_server", "AIMO3InferenceServer"),
           "aimo2": ("kaggle_evaluation.aimo_2_inference_server", "AIMO2InferenceServer")}


def kaggle_server(predict: Callable, competition: str) -> Optional[Any]:
    module, name = SERVERS[competition]
    try:
        return getattr(importlib.import_module(module), name)(predict)
    except ImportError:
        return None


def serve(predict: Callable, problems_csv: Optional[str] = None, out: str = "/kaggle/working",
          competition: str = "aimo3") -> Optional[dict]:
    server = kaggle_server(predict, competition)
    if server is not None:
        if os.getenv("KAGGLE_IS_COMPETITION_RERUN"):
            server.serve()
        else:
            server.run_local_gateway((problems_csv,) if problems_csv else ())
        return None
    from server.kaggle.gateway import run

    if not problems_csv:
        raise FileNotFoundError("no kaggle_evaluation module and no problems CSV for the local gateway")
    return run(predict, Path(problems_csv), Path(out))
