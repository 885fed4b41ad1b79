"""The typed job config: one YAML file plus `key=value` overrides, validated before anything runs.

`schema.py` declares every option (with its docstring, default and bounds); `load.py` reads YAML,
applies overrides and turns validation errors into messages that name the key, the bad value and
what is allowed.
"""

from relax_hpc.config.load import ConfigError, load_config
from relax_hpc.config.schema import JobConfig

__all__ = ["ConfigError", "JobConfig", "load_config"]
