"""RL objectives as pure tensor functions, independent of trainer backends.

Each module states its formula and where it departs from its paper. Backends call them with
per-token tensors shaped [num_samples, num_tokens] and a loss mask; nothing here knows about
processes, files or models.
"""
