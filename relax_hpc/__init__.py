"""relax_hpc: asynchronous RL post-training that runs natively on Slurm.

Roles are processes (trainer ranks under torchrun, rollout engines, the rollout driver); RUN_DIR on
the shared filesystem is the contract between them. See docs/DESIGN.md for the map.
"""

__version__ = "0.21.0"
