"""A name -> class registry for the pluggable parts of tiering (storage backends, transports)."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T", bound=type)


class ClassRegistry(Generic[T]):
    """Classes registered by name; re-registering the same class (a module reload) is allowed.

    Args:
        base: every registered class must subclass it.
        kind: what the names denote, for error messages ("storage backend").
        error: the exception type raised for bad registrations and unknown names.
    """

    def __init__(self, base: type, kind: str, error: type[Exception]):
        self.base, self.kind, self.error = base, kind, error
        self._classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: make ``cls`` available under ``name`` and set ``cls.name``."""
        def deco(cls: T) -> T:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise self.error(f"{cls!r} is not a {self.base.__name__} subclass")
            prev = self._classes.get(name)
            if prev is not None and (prev.__module__, prev.__qualname__) != (
                    cls.__module__, cls.__qualname__):
                raise self.error(f"{self.kind} {name!r} is already {prev.__qualname__}")
            cls.name = name
            self._classes[name] = cls
            return cls
        return deco

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> T:
        cls = self._classes.get(name)
        if cls is None:
            raise self.error(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return cls
