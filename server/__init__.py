"""The runtime: engine protocol and backends (embedded, trtllm, triton), and the solver above them."""
