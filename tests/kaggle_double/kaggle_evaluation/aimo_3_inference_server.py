"""Test double: AIMO-3's inference server (see the package docstring)."""

from kaggle_evaluation._double import InferenceServer


class AIMO3InferenceServer(InferenceServer):
    competition = "aimo3"
