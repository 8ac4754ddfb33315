"""A facade's method that is one of its parts': one signature, one docstring, one body.

``MetaStore`` (``store/meta.py``), ``TaskStore`` (``store/tasks.py``) and ``Operations``
(``control/operations.py``) keep the methods their callers know, each written once in the
narrow class that owns it: ``get = Delegate("connectors", ConnectorRepository.get)`` makes
``store.get(name)`` the call ``store.connectors.get(name)``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Delegate(Generic[R, P, T]):
    """``method`` of the facade's attribute ``part``, bound to it on every access (so a part
    replaced on the facade is the one called). Its signature and docstring are the method's;
    on the class it is called as an unbound method is (``Facade.name(facade, ...)``)."""

    def __init__(self, part: str, method: Callable[Concatenate[R, P], T]) -> None:
        self.part = part
        self.method = method
        self.__doc__ = method.__doc__
        self.__wrapped__ = method  # inspect.signature(Facade.name): the method's

    @overload
    def __get__(self, facade: None, owner: type[Any]) -> Delegate[R, P, T]: ...

    @overload
    def __get__(self, facade: object, owner: type[Any] | None = None) -> Callable[P, T]: ...

    def __get__(self, facade: object | None, owner: type[Any] | None = None) -> Any:
        if facade is None:
            return self
        return types.MethodType(self.method, getattr(facade, self.part))

    def __call__(self, facade: Any, *args: P.args, **kwargs: P.kwargs) -> T:
        """``Facade.name(facade, ...)``, as an unbound method is called."""
        return self.method(getattr(facade, self.part), *args, **kwargs)

    def __repr__(self) -> str:
        return f"Delegate({self.part!r}, {self.method.__qualname__})"
