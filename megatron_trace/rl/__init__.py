"""RL on top of the trainer and the engine: mismatch metrics and the mismatch experiment."""
