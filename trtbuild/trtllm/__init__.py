"""The TensorRT-LLM 1.2.x engine path: environment probe, preflight checks, checkpoint and build steps.

Everything here that touches TensorRT-LLM runs in *its* environment (`TRTLLM_PYTHON`, e.g. NVIDIA's
release container or a venv with tensorrt-llm 1.2.x), as a subprocess of the pipeline, because that
environment pins transformers 4.57 and numpy<2 while mergekit needs transformers>=5. The modules
import `tensorrt_llm` lazily; the test suite checks the exact commands and calls through a test
double of the module surface (contract tests), since no machine here can install TensorRT-LLM.
"""
