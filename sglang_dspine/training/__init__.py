"""The offline side: training data, the objective and trainer, and evaluation (generate)."""
