"""RL objectives as pure tensor functions, independent of trainer backends.

Conventions shared by every module (docs/algorithms.md has the formulas and their papers):

- per-token tensors are [n, T] (n samples, T target positions) and are aligned with the trainer's
  targets: position t scores token t + 1 of the sample; `mask` is 1.0 on the completion tokens
  the loss trains and 0.0 elsewhere (prompt, padding);
- per-sample tensors are [n]; `group_ids` label the prompt group of each sample (any integers);
- a loss function returns a per-token loss ("lower is better") and leaves the reduction to
  `aggregation.aggregate`, which divides by counts of the whole global batch;
- statistics that span ranks (batch whitening, M2PO's second moment) go through a `Comm`, so
  the same function computes the same value on one process or on many.
"""
