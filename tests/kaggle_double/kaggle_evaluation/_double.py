"""The double's gateway, relay and inference server, derived from tests/upstream/kaggle_evaluation.json.

It plays the core of the competition it serves (`FACTS["cores"]`): AIMO-2's package 0.3.0 or AIMO-3's
0.9.0. They differ in what listeners they take (any callable / plain functions only), the ports the
server may bind (50051 / 50051 then 60053-60062), the ids (compared with the gateway's / overwritten
by them), and the error a late answer gets (SERVER_CONNECTION_FAILED / GRPC_DEADLINE_EXCEEDED).

Environment knobs (test-only): KAGGLE_DOUBLE_SEED (shuffle seed, default random like upstream),
KAGGLE_DOUBLE_TEST_CSV (the problems `serve()` runs under KAGGLE_IS_COMPETITION_RERUN, standing in
for the gateway's own container), KAGGLE_DOUBLE_TIMEOUT (replaces the per-answer deadline).
Every run writes `double_report.json` (calls, timings, warnings) next to `submission.parquet`.
"""

from __future__ import annotations

import concurrent.futures
import enum
import io
import json
import os
import socket
import time
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import kaggle_evaluation

FACTS_FILE = Path(__file__).resolve().parents[2] / "upstream" / "kaggle_evaluation.json"
FACTS: dict[str, Any] = json.loads(FACTS_FILE.read_text())
STARTUP_LIMIT = float(FACTS["timeouts"]["startup_limit_seconds"])
SINT64 = (-(2 ** 63), 2 ** 63 - 1)


class ErrorType(enum.Enum):
    """The upstream allow-list of error kinds, by name, in the recorded order (AIMO-3's core added the last)."""

    UNSPECIFIED = 0
    SERVER_NEVER_STARTED = 1
    SERVER_CONNECTION_FAILED = 2
    SERVER_RAISED_EXCEPTION = 3
    SERVER_MISSING_ENDPOINT = 4
    GATEWAY_RAISED_EXCEPTION = 5
    INVALID_SUBMISSION = 6
    GRPC_DEADLINE_EXCEEDED = 7


NAMES = [e.name for e in ErrorType]
assert NAMES == FACTS["cores"]["aimo3"]["error_types"] and NAMES[:7] == FACTS["cores"]["aimo2"]["error_types"]


class GatewayRuntimeError(Exception):
    def __init__(self, kind: ErrorType, details: Optional[str] = None):
        super().__init__(f"{kind.name}: {details}")
        self.kind, self.details = kind, details


# ------------------------------------------------------------------ relay: the formats on the wire
def encode(value: Any) -> tuple[str, Any]:
    """What the relay accepts, turned into bytes or primitives as it sends them."""
    import polars as pl
    import pyarrow as pa

    if value is None or isinstance(value, (str, bool, float)):
        return "primitive", value
    if isinstance(value, int):
        if not SINT64[0] <= value <= SINT64[1]:
            raise ValueError(f"Value out of range: {value}")  # protobuf sint64
        return "primitive", value
    if isinstance(value, pl.Series):
        buf = io.BytesIO()
        pl.DataFrame(value).write_parquet(buf, compression="lz4", statistics=False)
        return "polars_series", buf.getvalue()
    if isinstance(value, pl.DataFrame):
        banned = {pl.Enum, pl.Object, pl.Unknown} & {d.base_type() for d in value.dtypes}
        if banned:
            raise TypeError(f"Unsupported Polars data type(s): {banned}")
        table = value.to_arrow()
        buf = io.BytesIO()
        with pa.ipc.new_stream(buf, table.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as w:
            w.write_table(table)
        return "polars_dataframe", buf.getvalue()
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [encode(v) for v in value]
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover
        pd = None
    if pd is not None and isinstance(value, pd.DataFrame):
        buf = io.BytesIO()
        value.to_parquet(buf, index=False, compression="lz4")
        return "pandas_dataframe", buf.getvalue()
    raise TypeError(f"Type {type(value)} not supported for KaggleEvaluation.")


def decode(kind: str, data: Any) -> Any:
    import polars as pl
    import pyarrow as pa

    if kind == "primitive":
        return data
    if kind == "polars_series":
        return pl.Series(pl.read_parquet(io.BytesIO(data)))
    if kind == "polars_dataframe":
        with pa.ipc.open_stream(data) as reader:
            return pl.from_arrow(reader.read_all())
    if kind in ("list", "tuple"):
        items = [decode(*d) for d in data]
        return items if kind == "list" else tuple(items)
    if kind == "pandas_dataframe":
        import pandas as pd

        return pd.read_parquet(io.BytesIO(data))
    raise TypeError(f"unknown payload {kind}")


def port_is_free(port: int) -> bool:
    """Upstream's probe (AIMO-3): a test bind on localhost, released at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("localhost", port))
        except OSError:
            return False
    return True


def server_port(competition: str) -> int:
    """The port the competition's server would bind: AIMO-2 always its one port; AIMO-3 the first free one of
    its list, or a ValueError naming them all (the double binds nothing: no gRPC here)."""
    ports = FACTS["cores"][competition]["ports"]
    if len(ports) == 1:
        return ports[0]
    for port in ports:
        if port_is_free(port):
            return port
    raise ValueError(f"None of the expected ports {ports} are available.")


class Relay:
    """Client and server halves in one process: the server runs listeners on one thread."""

    def __init__(self, listeners: tuple[Callable, ...], competition: str):
        if not listeners:
            raise ValueError("Must pass at least one endpoint listener, e.g. `predict`")
        functions_only = FACTS["cores"][competition]["listeners"]["rule"] == "function"
        for f in listeners:
            if not (isinstance(f, types.FunctionType) if functions_only else callable(f)):
                raise ValueError(f"Endpoint listeners passed to `serve` must be functions, got {type(f)}")
            if f.__name__ == "<lambda>":  # AIMO-2: a functools.partial has no __name__ (AttributeError)
                raise ValueError("Functions passed as endpoint listeners must be named")
        self.listeners = {f.__name__: f for f in listeners}
        self.competition = competition
        self.port = server_port(competition)
        self.pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.deadline: float = float(FACTS["timeouts"]["default_deadline_seconds"])
        self.connected = False

    def start(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=FACTS["calling_convention"]["server_threads"])

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    def _handle(self, name: str, wire_args: list[tuple[str, Any]]) -> tuple[str, Any]:
        if name not in self.listeners:
            raise NotImplementedError(f"No listener for {name} was registered.")
        return encode(self.listeners[name](*[decode(*a) for a in wire_args]))

    def send(self, name: str, *args: Any) -> Any:
        if self.pool is None:
            raise GatewayRuntimeError(ErrorType.SERVER_NEVER_STARTED)
        future = self.pool.submit(self._handle, name, [encode(a) for a in args])
        timeout = self.deadline if self.connected else None  # the first call has no deadline once connected
        self.connected = True
        try:
            return decode(*future.result(timeout=timeout))
        except concurrent.futures.TimeoutError:
            kind = ErrorType[FACTS["cores"][self.competition]["deadline_error"]]
            details = f"Deadline Exceeded after {timeout:.0f}s" if kind is ErrorType.SERVER_CONNECTION_FAILED else None
            raise GatewayRuntimeError(kind, details) from None
        except NotImplementedError as e:
            raise GatewayRuntimeError(ErrorType.SERVER_MISSING_ENDPOINT, str(e)) from None
        except Exception as e:  # what the user's predict (or the serialisation of its answer) raised
            raise GatewayRuntimeError(ErrorType.SERVER_RAISED_EXCEPTION, f"{type(e).__name__}: {e}") from None


# ------------------------------------------------------------------ gateway
class Gateway:
    def __init__(self, competition: str, relay: Relay, data_paths: Optional[tuple[str, ...]] = None):
        self.competition, self.relay = competition, relay
        self.test_path = data_paths[0] if data_paths else FACTS["rerun"]["default_test_path"][competition]
        timeout = os.environ.get("KAGGLE_DOUBLE_TIMEOUT")
        relay.deadline = (float(timeout) if timeout
                          else float(FACTS["timeouts"]["response_timeout_seconds"][competition]))
        self.rules = FACTS["cores"][competition]
        self.report: dict[str, Any] = {"competition": competition, "core": self.rules["package_version"],
                                       "port": relay.port, "calls": [], "deadline_seconds": relay.deadline}

    def batches(self):
        import polars as pl

        test = pl.read_csv(self.test_path)
        seed = os.environ.get("KAGGLE_DOUBLE_SEED")
        seed = int(seed) if seed else int.from_bytes(os.urandom(4), "big")
        test = test.sample(fraction=1.0, shuffle=True, with_replacement=False, seed=seed)
        for row in test.iter_slices(n_rows=1):
            yield row, row.select("id")

    def validate(self, prediction: Any, expected: Any) -> None:
        import polars as pl

        if prediction is None:
            raise GatewayRuntimeError(ErrorType.INVALID_SUBMISSION, "No prediction received")
        if self.rules["id_rule"] == "overwrite":
            return self.validate_rows_only(prediction, expected)
        if len(prediction) != len(expected):
            raise GatewayRuntimeError(ErrorType.INVALID_SUBMISSION,
                                      f"Invalid predictions: expected {len(expected)} rows "
                                      f"but received {len(prediction)}")
        col = expected.columns[0]
        if col not in prediction.columns:
            raise GatewayRuntimeError(ErrorType.INVALID_SUBMISSION, f"Prediction missing column {col}")
        if not pl.Series(prediction[col]).equals(pl.Series(expected[col])):
            raise GatewayRuntimeError(ErrorType.INVALID_SUBMISSION,
                                      f"Invalid values for {col} in batch of predictions.")

    @staticmethod
    def validate_rows_only(prediction: Any, expected: Any) -> None:
        """AIMO-3: a primitive counts as one row, else a DataFrame/Series of the batch's row count; no id check."""
        import numpy as np
        import pandas as pd
        import polars as pl

        if isinstance(prediction, (int, float, str, bool, np.int_)):
            rows = 1
        elif isinstance(prediction, (pl.DataFrame, pl.Series, pd.DataFrame, pd.Series)):
            rows = len(prediction)
        else:
            raise GatewayRuntimeError(ErrorType.INVALID_SUBMISSION,
                                      f"Invalid prediction data type, received: {type(prediction)}")
        if rows != len(expected):
            raise GatewayRuntimeError(ErrorType.INVALID_SUBMISSION,
                                      f"Invalid predictions: expected {len(expected)} rows but received {rows}")

    def write_submission(self, predictions: list, row_ids: list) -> None:
        import polars as pl

        frames = [p.to_frame() if isinstance(p, pl.Series) and p.name else p for p in predictions]
        if not all(isinstance(p, pl.DataFrame) for p in frames):  # AIMO-3 lets primitives this far
            raise GatewayRuntimeError(ErrorType.GATEWAY_RAISED_EXCEPTION, "scalar or unnamed predictions need a "
                                      "target column name, which the gateway does not set")
        try:
            submission = pl.concat(frames, how="vertical_relaxed")
        except (pl.exceptions.SchemaError, pl.exceptions.ComputeError) as e:
            raise GatewayRuntimeError(ErrorType.INVALID_SUBMISSION, f"Inconsistent predictions: {e}") from None
        if self.rules["id_rule"] == "overwrite":  # the gateway's own ids replace (or add) the id column, first
            ids = pl.concat(row_ids)
            submission = submission.with_columns(ids).select(
                ids.columns + [c for c in submission.columns if c not in ids.columns])
        submission.write_parquet("submission.parquet")

    def run(self, rerun: bool) -> None:
        error: Optional[GatewayRuntimeError] = None
        try:
            predictions, row_ids = [], []
            for batch, expected in self.batches():
                t = time.time()
                self.report["calls"].append({"started_after_import": round(t - kaggle_evaluation.IMPORTED_AT, 2),
                                             "args": [s.name for s in batch], "dtypes": [str(s.dtype) for s in batch]})
                prediction = self.relay.send("predict", *batch)
                self.report["calls"][-1]["seconds"] = round(time.time() - t, 2)
                self.validate(prediction, expected)
                predictions.append(prediction)
                row_ids.append(expected)
            self.write_submission(predictions, row_ids)
        except GatewayRuntimeError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - upstream maps any other failure to GATEWAY_RAISED_EXCEPTION
            error = GatewayRuntimeError(ErrorType.GATEWAY_RAISED_EXCEPTION, f"{type(e).__name__}: {e}")
        self.report["error"] = None if error is None else {"type": error.kind.name, "details": error.details}
        Path("double_report.json").write_text(json.dumps(self.report, indent=1))
        if rerun:
            result = {"Succeeded": error is None}
            if error is not None:
                result.update(ErrorType=error.kind.value, ErrorName=error.kind.name,
                              ErrorDetails=str(error.details or "")[:8000] or None)
            Path("result.json").write_text(json.dumps(result))
        elif error is not None:
            raise error


class InferenceServer:
    """`AIMO?InferenceServer(predict)`: `serve()` under the rerun variable, `run_local_gateway` off it."""

    competition = "aimo3"

    def __init__(self, *listeners: Callable):
        self.relay = Relay(listeners, self.competition)
        self.startup_warning = False

    def _warn_late_start(self) -> None:
        elapsed = time.time() - kaggle_evaluation.IMPORTED_AT
        if elapsed > STARTUP_LIMIT:
            warnings.warn(f"{int(elapsed)} seconds elapsed before server startup (limit {int(STARTUP_LIMIT)})",
                          RuntimeWarning)
            self.startup_warning = True

    def serve(self) -> None:
        """Under the rerun variable the gateway would connect from its own container; the double runs
        it here, on KAGGLE_DOUBLE_TEST_CSV, and writes result.json as the rerun does."""
        self.relay.start()
        try:
            if os.getenv(FACTS["rerun"]["env"]) is not None:
                csv = os.environ.get("KAGGLE_DOUBLE_TEST_CSV")
                Gateway(self.competition, self.relay, (csv,) if csv else None).run(rerun=True)
        finally:
            self.relay.stop()

    def run_local_gateway(self, data_paths: Optional[tuple[str, ...]] = None) -> None:
        self._warn_late_start()
        self.relay.start()
        try:
            gateway = Gateway(self.competition, self.relay, data_paths)
            gateway.report["startup_warning"] = self.startup_warning
            gateway.run(rerun=False)
        finally:
            self.relay.stop()
