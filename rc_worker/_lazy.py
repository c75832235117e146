"""Names a package exports, loaded on first use (PEP 562).

A package's ``__init__`` that imported every public name at once made importing any of
its submodules load them all: the ``rc`` client paid for the whole worker and server on
every command. With these, a name's module is imported when the name is first read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(
    package: str, table: Mapping[str, str], exported: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``table`` maps a name to the module
    that defines it (the name itself when it is a submodule of ``package``)."""
    namespace = importlib.import_module(package).__dict__
    names = frozenset(exported)

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where)
        value = module if where == f"{package}.{name}" else getattr(module, name)
        namespace[name] = value  # once: later lookups are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
