"""Isolated python execution for the TIR harness (network-less, resource-limited, warm pool)."""
