"""The OpenAI HTTP API, both ways.

- `server.openai.engine`: the `openai` backend, a driver that runs engine requests on any
  OpenAI-compatible server (trtllm-serve, vLLM, SGLang, `make serve`), one or several replicas;
  with `replicas`, `routing`, `probe`, `remote_completion` and `connections` beside it.
- `server.openai.app`: an OpenAI-compatible HTTP server (Starlette + uvicorn) in front of any engine
  backend, run by `server.programs.serve` (`make serve`); with `api_error`, `body`, `job`, `parsing`,
  `api`, `responses`, `sse` and `state` beside it.

Nothing heavy is imported here: httpx2 loads with the driver, starlette and uvicorn with the server.
"""
