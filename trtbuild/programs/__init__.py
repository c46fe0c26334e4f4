"""Programs of the build pipeline (not library): `python -m trtbuild.programs.<name>`.

- `gpu_smoke`: on a GPU host, build tiny bf16/FP8 engines with TensorRT-LLM and check them (`make gpu-smoke`).
- `drafter_speed`: how fast the ReDrafter head trains on this machine (CPU or GPU).
- `trtllm_convert`: HF checkpoint -> TensorRT-LLM checkpoint, in TensorRT-LLM's env (the build stage runs it).
"""
