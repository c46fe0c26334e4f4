"""Programs of the runtime (not library): each is `python -m server.programs.<name>`; nothing in the
library imports them. The benchmarks are the other programs place, `server.bench`.

- `solve`: solve a problems file with a built engine (`make solve`).
- `evaluate`: k samples per problem for several variants, side by side (`make eval`).
- `replay`: replay competition runs from an evaluation's samples (`make eval`, after evaluate).
- `serve`: the OpenAI-compatible HTTP server (`make serve`).
- `triton_embedded`: the embedded engine behind a real Triton server (`make triton`).
- `triton_deploy`: the tensorrtllm_backend repository for a TensorRT-LLM engine, and its launch
  (`make triton BACKEND=trtllm`).
- `trtllm_launch`: start a trtllm process, under mpirun when tp > 1 (`make solve|serve BACKEND=trtllm`).
- `kaggle_package`: the Kaggle dataset folder and its notebook (`make kaggle`).
- `kaggle_execute`: run that notebook headlessly against the folder, as Kaggle would (`make kaggle`).
- `kaggle_gateway`: the local stand-in for Kaggle's gateway, over an engine.
"""
