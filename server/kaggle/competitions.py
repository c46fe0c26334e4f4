"""What differs between the AIMO competitions' inference APIs, in one table (from their
`kaggle_evaluation` packages; tests/upstream/kaggle_evaluation.json records where each fact was read)."""

from __future__ import annotations

from dataclasses import dataclass

from aimo_spec.recipe import ANSWER_RANGES, ANSWER_TIMEOUTS

STARTUP_LIMIT_SECONDS = 15 * 60  # the server must be up this long after the notebook starts
RERUN_ENV = "KAGGLE_IS_COMPETITION_RERUN"


@dataclass(frozen=True)
class Competition:
    name: str
    server_module: str
    server_class: str
    answer_timeout_seconds: float  # per answer, after the first call (which has no deadline)
    answer_range: int  # answers are reported modulo this

    @property
    def module_file(self) -> str:
        return self.server_module.split(".")[-1]


COMPETITIONS = {
    "aimo3": Competition("aimo3", "kaggle_evaluation.aimo_3_inference_server", "AIMO3InferenceServer",
                         ANSWER_TIMEOUTS["aimo3"], ANSWER_RANGES["aimo3"]),
    "aimo2": Competition("aimo2", "kaggle_evaluation.aimo_2_inference_server", "AIMO2InferenceServer",
                         ANSWER_TIMEOUTS["aimo2"], ANSWER_RANGES["aimo2"]),
}


def competition(name: str) -> Competition:
    if name not in COMPETITIONS:
        raise ValueError(f"unknown competition {name!r} (known: {', '.join(COMPETITIONS)})")
    return COMPETITIONS[name]
