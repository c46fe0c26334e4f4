"""The OpenAI HTTP API, both ways.

- `server.openai.engine`: the `openai` backend, a driver that runs engine requests on any
  OpenAI-compatible server (trtllm-serve, vLLM, SGLang, `make serve`), one or several replicas.
- `server.openai.app`: an OpenAI-compatible HTTP server (Starlette + uvicorn) in front of any engine
  backend; `server.programs.serve` (`make serve`) runs it.

Nothing heavy is imported here: httpx2 loads with the driver, starlette and uvicorn with the server.
"""
