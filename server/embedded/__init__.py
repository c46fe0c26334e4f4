"""The embedded backend: serves a portable engine folder with PyTorch on any machine, CPU included."""
