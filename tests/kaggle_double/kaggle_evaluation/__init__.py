"""Test double of Kaggle's `kaggle_evaluation` package (AIMO-2 / AIMO-3), for tests only.

It follows the facts recorded in tests/upstream/kaggle_evaluation.json (repository and commit of
each upstream file read): the calling convention (`predict(*row)`, one single-row polars Series per
CSV column, types as `polars.read_csv` infers them), the relay's serialisation of arguments and
answers, the gateway's validation, its deadlines and its `submission.parquet`, each under the rules
of the competition's own core (AIMO-2's 0.3.0 or AIMO-3's 0.9.0, `cores` in the facts). No gRPC: the server
side is a one-thread pool in this process, and the relay's round trip is done with the same
formats (parquet for Series, Arrow IPC for DataFrames, sint64 for ints). Put `tests/kaggle_double`
on PYTHONPATH to make `import kaggle_evaluation...` find it.
"""

import time

IMPORTED_AT = time.time()  # the startup clock starts when the package is imported (upstream: core.templates)
