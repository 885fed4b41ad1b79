"""Options that name Python objects (rollout.env.name, reward.name): a built-in by name, or
`module:attribute` on the Python path, imported when resolved."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


class BadReference(ValueError):
    """A name that designates no object; the message says why (callers add the option's name)."""


def resolve_reference(name: str, builtins: Mapping[str, Any], what: str = "attribute") -> Any:
    """The built-in `name`, or the object `module:<what>` designates (imported); with what
    "function", the object must be callable."""
    if name in builtins:
        return builtins[name]
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise BadReference(f"a built-in ({', '.join(builtins)}) or module:{what}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BadReference(f"cannot import {module_name} ({e})") from None
    target = getattr(module, attribute, None)
    if target is None or (what == "function" and not callable(target)):
        raise BadReference(f"{module_name} has no {what} {attribute!r}")
    return target
