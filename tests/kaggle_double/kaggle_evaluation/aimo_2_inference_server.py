"""Test double: AIMO-2's inference server (see the package docstring)."""

from kaggle_evaluation._double import InferenceServer


class AIMO2InferenceServer(InferenceServer):
    competition = "aimo2"
