"""relax_hpc: asynchronous RL post-training that runs natively on Slurm.

Roles are processes (trainer ranks under torchrun, rollout engines, the rollout driver); RUN_DIR on
the shared filesystem is the contract between them. See docs/DESIGN.md for the map.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("relax_hpc")  # pyproject.toml's, the one place it is written
except PackageNotFoundError:  # imported from a source tree that pip never installed (PYTHONPATH)
    __version__ = "unknown"
