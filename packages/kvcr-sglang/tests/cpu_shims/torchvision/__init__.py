"""CPU-test shim for `torchvision` (never installed for users; the lean `.venv-sglang` puts
this folder on sys.path through a .pth file).

SGLang 0.5.23 and transformers import torchvision at module import time for vision models;
PyPI's torchvision needs CUDA torch 2.14. Text-only storage tests never call it: every
`torchvision.*` submodule is synthesized, and every attribute is a stub that raises if used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+kvcr-cpu-shim"


class _Stub:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a CPU-test shim (torchvision is not installed)")

    def __getattr__(self, attr: str) -> _Stub:
        return _Stub(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _ShimModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _ShimModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Finder())
__getattr__ = _ShimModule.__getattr__.__get__(sys.modules[__name__])  # type: ignore[attr-defined]
