"""Name -> class registries for the pluggable steps of a conversion (RoPE strategies, low-rank inits).

A method is one class in one file of its package; it registers itself when its class is defined (the
package imports every module it holds), so adding one touches that file and its `conf/` file only.
"""

from __future__ import annotations

import importlib
import pkgutil


class Registry:
    """The classes of one kind, by `name`; `get` returns a (stateless) instance."""

    def __init__(self, kind: str, field: str):
        self.kind, self.field = kind, field  # e.g. "RoPE strategy", "rope" (the MLASpec field it fills)
        self._classes: dict[str, type] = {}

    def add(self, cls: type) -> type:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__qualname__} must set a non-empty `name` to be a {self.kind}")
        known = self._classes.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"{self.kind} {name!r} is defined twice: {known.__module__} and {cls.__module__}")
        self._classes[name] = cls
        return cls

    def names(self) -> tuple[str, ...]:
        return tuple(self._classes)

    def __contains__(self, name) -> bool:
        return name in self._classes

    def __iter__(self):
        return iter(self._classes)

    def find(self, name):
        """The instance registered as `name`, or None."""
        cls = self._classes.get(name)
        return None if cls is None else cls()

    def get(self, name):
        """The instance registered as `name`; ValueError naming the field and the choices otherwise."""
        found = self.find(name)
        if found is None:
            raise ValueError(f"unknown {self.field}={name!r}; expected one of {', '.join(map(repr, self._classes))}")
        return found


def import_submodules(package_name: str, package_path) -> None:
    """Import every module of a package, so that each registers the classes it defines."""
    for module in pkgutil.iter_modules(package_path):
        importlib.import_module(f"{package_name}.{module.name}")
