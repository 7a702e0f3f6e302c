"""The training loop, warm start, evaluation, checkpointing and metrics."""
