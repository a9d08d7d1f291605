"""A stub `torchvision`, installed by scripts/setup_dynamo.sh into .venv-dynamo only.

PyPI's torchvision does not load on CPU torch, yet dynamo.vllm imports transformers' vision
processors at start-up. Every torchvision module imports and every name in it resolves (so
module-level imports and tables succeed); calling anything raises ImportError. Text models
never call it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

__version__ = "0.0.0+kvcr.stub"
_WHY = "torchvision is a stub in .venv-dynamo (kvcr scripts/setup_dynamo.sh): no vision models"


class _Unusable:
    """Any torchvision name: resolvable, never usable."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Unusable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise ImportError(f"{self._name}: {_WHY}")

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Unusable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every `torchvision.*` submodule as a stub module."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())


def __getattr__(name: str) -> _Unusable:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unusable(f"torchvision.{name}")
