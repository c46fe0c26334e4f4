"""Benchmarks of the runtime (programs, not library): each is `python -m server.bench.<name>` and
writes JSON under bench/; `server.bench.report` turns them into bench/summary.md (`make bench`)."""
