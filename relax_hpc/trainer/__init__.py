"""The trainer role: torchrun ranks that claim sample batches, train, checkpoint and push weights."""
