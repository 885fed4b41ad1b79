"""Prompt datasets and the deterministic order in which the rollout driver consumes them."""
