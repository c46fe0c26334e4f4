"""`make serve MODEL=mix`: the OpenAI-compatible HTTP server (server/openai/app.py) under uvicorn.

    python -m server.programs.serve --recipe engines/mix.yaml [--backend auto|embedded|trtllm|triton|openai] \
        [--port 8000]
    python -m server.programs.serve --engine engines/mix/build/embedded     # an engine folder or an HF checkpoint

The port opens at once (a taken one is an error naming it, before anything else) and answers 503
while the engine loads; a line `[serve] ready: ...` says when it serves. SIGTERM (or Ctrl-C) drains
(`server.openai.drain`): the port stays open, `/health` and new requests get 503 `draining`, the
running ones finish within --drain-seconds, after which they are cancelled (each still ends properly:
finish_reason "abort", then `[DONE]`); then the engine closes and the process exits 0. A second
signal cancels the running requests at once (they still end properly), a third exits as things are (1).
An engine that fails to load ends the process with status 1.
`--backend openai --url A,B` serves other OpenAI-compatible servers through this one (a fan-out
over replicas, with the openai backend's routing and fail-over).
"""

from __future__ import annotations

import argparse
import errno
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional


def _log(msg: str) -> None:
    print(f"[serve] {msg}", file=sys.stderr, flush=True)


def engine_loader(args: argparse.Namespace) -> tuple[Callable[[], Any], str]:
    """How to open the engine the arguments name (run later, in the loading thread), and its model name.
    The serving settings are the recipe's (`--recipe`) or the defaults (`--engine`), under the command's
    environment and flags (`serving_settings`)."""
    from server import backends
    from server.embedded.settings import serving_settings

    overrides = {k: v for k, v in (("max_batch_size", args.max_batch_size), ("max_seq_len", args.max_seq_len),
                                   ("threads", args.threads)) if v}
    deterministic = True if args.deterministic else None
    if args.engine:
        folder = Path(args.engine)
        name = args.model_name or (folder.parent.parent.name if folder.parent.name == "build" else folder.name)
        serving = serving_settings(deterministic=deterministic)
        if (folder / "engine.json").is_file():
            return (lambda: backends.open_engine(folder, serving, **overrides)), name
        if (folder / "config.json").is_file():
            return (lambda: backends.driver("embedded").from_dir(folder, serving=serving, **overrides)), name
        raise FileNotFoundError(f"{folder}: neither an engine folder (engine.json) nor an HF checkpoint (config.json)")
    from aimo_spec.recipe import load_recipe

    recipe = load_recipe(args.recipe, check_paths=False)  # serving needs the built engine, not the sources
    serving = serving_settings(recipe, deterministic=deterministic)
    return ((lambda: backends.open_for_recipe(recipe, args.backend, args.triton_url, args.url, serving)),
            args.model_name or recipe.name)


def main(argv: Optional[list[str]] = None) -> int:
    from server.backends import SERVING_BACKENDS

    ap = argparse.ArgumentParser(prog="python -m server.programs.serve", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--recipe", help="serve this recipe's built engine (engines/<model>.yaml)")
    src.add_argument("--engine", help="serve this engine folder (engine.json) or HF checkpoint (config.json)")
    ap.add_argument("--backend", default="auto", choices=SERVING_BACKENDS,
                    help="which engine serves the recipe (with --recipe; --engine is always embedded)")
    ap.add_argument("--triton-url", default="localhost:8001", help="with --backend triton: the server's gRPC address")
    ap.add_argument("--url", default="", help="with --backend openai: the servers, comma-separated")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model-name", default=None, help="the name clients use (default: the recipe's, or the folder's)")
    ap.add_argument("--drain-seconds", type=float, default=30.0,
                    help="on SIGTERM, how long running requests may finish")
    ap.add_argument("--max-batch-size", type=int, default=None, help="override the engine's limit (embedded)")
    ap.add_argument("--max-seq-len", type=int, default=None, help="override the engine's limit (embedded)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the embedded engine")
    ap.add_argument("--access-log", action="store_true", help="log every HTTP request")
    ap.add_argument("--deterministic", action="store_true",
                    help="embedded engine: the same greedy tokens for a request alone and in any batch "
                         "(slower; docs/serving.md#deterministic-mode)")
    ap.add_argument("--max-request-bytes", type=int, default=None,
                    help="refuse bodies over this size with 413 "
                         "(default 8 MiB: a 128k-token prompt as JSON ids is ~1 MB)")
    args = ap.parse_args(argv)
    if args.engine and args.backend not in ("auto", "embedded"):
        ap.error(f"--engine serves its folder with the embedded engine; --backend {args.backend} needs "
                 f"--recipe (make serve MODEL=<model> BACKEND={args.backend})")
    if args.backend == "openai" and not args.url:
        ap.error("--backend openai: give the server URL(s): --url http://host:8000/v1[,http://host2:8000/v1] "
                 "(make serve BACKEND=openai URL=...)")
    if args.deterministic and args.backend not in ("auto", "embedded"):
        print(f"serve: --deterministic is the embedded engine's mode (not --backend {args.backend})", file=sys.stderr)
        return 2
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        print(f"serve: --max-request-bytes must be >= 1 (got {args.max_request_bytes})", file=sys.stderr)
        return 2
    if args.drain_seconds < 0:
        print(f"serve: --drain-seconds must be >= 0 (got {args.drain_seconds:g})", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from server.openai.app import create_app
        from server.openai.drain import CUT_GRACE_SECONDS, DrainingServer, listen
    except ImportError as e:
        print(f"serve: {e}; install the pinned environment (`make setup`)", file=sys.stderr)
        return 2
    try:  # before anything says "listening", and before the engine loads
        sock = listen(args.host, args.port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            print(f"serve: port {args.port} on {args.host} is taken (another server listens there): pick another "
                  f"with --port <n> (make serve PORT=<n>)", file=sys.stderr)
        else:
            print(f"serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    with sock:  # closed on every way out, an engine folder that cannot be served included
        try:
            load, name = engine_loader(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"serve: {e}", file=sys.stderr)
            return 2

        failed: list[BaseException] = []
        server: Any = None

        def on_failure(e: BaseException) -> None:
            failed.append(e)
            _log(f"the engine failed to load: {type(e).__name__}: {e}")
            if server is not None:
                server.should_exit = True

        from server.openai.app import MAX_REQUEST_BYTES

        app = create_app(load, name, on_failure, max_request_bytes=args.max_request_bytes or MAX_REQUEST_BYTES)
        state = app.state.serving

        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=args.access_log,
                                timeout_graceful_shutdown=int(CUT_GRACE_SECONDS), lifespan="on")
        server = DrainingServer(config, state, args.drain_seconds, log=_log)
        t0 = time.monotonic()
        _log(f"listening on http://{args.host}:{args.port}/v1 (model {name!r}); loading the engine")

        import threading

        def announce() -> None:
            while state.api is None and not state.error and not state.draining:
                time.sleep(0.1)
            if state.api is not None:
                api = state.api
                _log(f"ready: model {name!r} on http://{args.host}:{args.port}/v1, backend "
                     f"{getattr(api.engine, 'name', '?')}, loaded in {time.monotonic() - t0:.1f}s"
                     + (f", max_input_len {api.parser.max_input_len}" if api.parser.max_input_len else ""))
        threading.Thread(target=announce, daemon=True).start()
        server.run(sockets=[sock])
        if failed:
            return 1
        _log("stopped")
        return 0


if __name__ == "__main__":
    sys.exit(main())
