"""Rollout: the engine protocol (SGLang's native HTTP API), the built-in torch engine, its client,
and the driver that turns prompts into published sample batches."""
