"""The rollout driver role: prompts -> engines -> rewards -> published sample batches."""
