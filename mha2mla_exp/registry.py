"""Name -> class registries for every pluggable method: RoPE strategies, low-rank inits, calibration statistics
and recovery objectives. One mechanism for all four.

A method is one class with a `name`; it joins its kind's registry when the class is defined (`Registered`),
and each method package imports every module it holds, so adding one touches its own file and its `conf/`
file only. A base class without a `name` (or with `name = ""`) is a base for others, never registered.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import ClassVar


class Registry:
    """The classes of one kind, by `name`."""

    def __init__(self, kind: str, field: str):
        self.kind, self.field = kind, field  # e.g. "RoPE strategy", "rope" (the config field that names one)
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

    def class_of(self, name: str) -> type:
        """The class registered as `name`; ValueError naming the config field and the choices otherwise."""
        cls = self._classes.get(name)
        if cls is None:
            raise ValueError(f"unknown {self.field}={name!r}; expected one of {', '.join(map(repr, self._classes))}")
        return cls

    def find(self, name):
        """A (stateless) instance of the class registered as `name`, or None."""
        cls = self._classes.get(name)
        return None if cls is None else cls()

    def get(self, name):
        """A (stateless) instance of the class registered as `name`; ValueError as `class_of`."""
        return self.class_of(name)()

    def build(self, name: str, *args, **kwargs):
        """An instance of `name` made with arguments (an objective's temperature, a statistic's model shape)."""
        return self.class_of(name)(*args, **kwargs)


class Registered:
    """Base of a registered kind: the kind's base class sets `registry`; a subclass that sets `name` joins it."""

    registry: ClassVar[Registry]
    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            cls.registry.add(cls)


def import_submodules(package_name: str, package_path) -> None:
    """Import every module of a package, so that each registers the classes it defines."""
    for module in pkgutil.iter_modules(package_path):
        importlib.import_module(f"{package_name}.{module.name}")
