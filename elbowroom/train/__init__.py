"""The trainer: reference models, data, the training loop, checkpoints and metrics."""
