"""Agents written against the official SDKs only, as a user's own agent is: each file imports its
SDK and the standard library, nothing of relax_hpc (tests/unit/test_agents.py checks)."""
