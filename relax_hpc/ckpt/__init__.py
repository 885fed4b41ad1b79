"""DCP checkpoints of the trainer: ckpt/step-N/ directories and the atomic ckpt/latest link."""
