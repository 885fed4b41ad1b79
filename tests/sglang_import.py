"""Import SGLang's pure-Python parts (request classes, argument parser) on a CPU machine.

SGLang is installed with `--no-deps` plus the light packages its import chain needs
(constraints.txt, tools/install.sh). Two of its imports are not installable here and, where they
are missing, are replaced for the duration of the import by stand-in modules in sys.modules:

- triton: about 1 GB of GPU compiler, imported at module level by sglang.srt.utils;
- torchvision: the PyPI build is CUDA-only and fails to import on this machine.

Nothing from either is called while the request classes and the argument parser are defined.
Two libraries would mistake a stand-in for the real package, so they are asked first, and
remember, that neither is installed: torch (`has_triton_package`) and transformers
(`is_torchvision_available`). SGLang also decorates kernels with `torch.compile` at import time,
which would pull torch's inductor (and its own triton checks) in; it is an identity decorator
during the import. Afterwards the stand-ins are removed from sys.modules, torch.compile is put
back and the environment variables the import set (cache folders) are undone, so the rest of a
test session sees the real environment. What stays: sglang's modules, and the transformers
compatibility patches its package applies on import (sglang.srt.utils.hf_transformers_patches).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

HEAVY = ("triton", "torchvision")


class _Anything:
    """Any attribute, call, subscript or base class: enough for module-level decorators and aliases."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Anything:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Anything(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a bare decorator
            return args[0]
        return _Anything(f"{self._name}(...)")

    def __getitem__(self, key: Any) -> _Anything:
        return _Anything(f"{self._name}[...]")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Anything(f"{self.__name__}.{attr}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a stand-in for each of `roots` and any submodule of them."""

    def __init__(self, roots: list[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@contextmanager
def stand_ins() -> Iterator[None]:
    import torch
    import torch.utils._triton
    from transformers.utils import import_utils

    # Both cache their answer: asked now, they keep seeing the real environment.
    torch.utils._triton.has_triton_package()
    import_utils.is_torchvision_available()
    missing = [name for name in HEAVY if importlib.util.find_spec(name) is None]  # a GPU machine may have them
    finder, compile_, environ = _StandInFinder(missing), torch.compile, dict(os.environ)
    torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)  # type: ignore[assignment]  # a stand-in: no compiling
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        torch.compile = compile_
        os.environ.clear()  # sglang's import points third-party caches (inductor, CUDA) at its own
        os.environ.update(environ)
        for name in [n for n in sys.modules if n.split(".")[0] in missing]:
            del sys.modules[name]


def import_sglang(*modules: str) -> list[types.ModuleType]:
    """Import these sglang modules (e.g. "sglang.srt.managers.io_struct") with the stand-ins."""
    with stand_ins():
        return [importlib.import_module(m) for m in modules]
