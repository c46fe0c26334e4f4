"""Triton Inference Server: the tensorrtllm_backend model repository for TensorRT-LLM engines, the
embedded engine behind a real Triton server (PyTriton), and the `triton` engine backend (tritonclient)."""
