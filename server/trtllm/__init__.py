"""The trtllm backend: TensorRT-LLM 1.2.x's C++ executor behind the engine protocol (GPU hosts)."""
