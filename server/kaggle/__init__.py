"""The Kaggle AIMO runner: `predict` for the competition's inference server, a local gateway that
behaves like Kaggle's, and `make kaggle`: an offline dataset folder plus the notebook that runs it."""
