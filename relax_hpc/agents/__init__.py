"""Agents as they are written: an agent that speaks OpenAI's Chat Completions API trains unchanged.

The `agent` environment (relax_hpc.agents.env) gives each episode a base URL and a key on a
gateway that the rollout driver serves on its own event loop (relax_hpc.agents.gateway). The
gateway renders each request's conversation with the model's chat template, samples through the
episode's Context (the driver's engines: routing by session, re-issue, per-token versions), parses
tool calls out of the sampled text (relax_hpc.agents.toolcalls) and keeps the episode's tokens
exactly as sampled (relax_hpc.agents.transcript): a later request that repeats earlier messages
reuses their token ids, and only new messages are rendered. docs/agents.md is the user's page.
"""
