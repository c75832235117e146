"""``rc_worker.core`` stays pure: no module in it reaches an I/O or concurrency library.

The walker reads each module's source with ``ast`` (so nothing is imported, and
an import inside a function or under ``TYPE_CHECKING`` counts as much as one at
the top), and follows every import of another ``rc_worker`` module to its
source, so an impure module reached through a pure-looking one is caught with
the chain that leads to it. The package's own ``rc_worker/__init__.py`` (the
public re-exports, which Python runs before any submodule) is not followed:
what is checked is what the core's code asks for, not what the package root
offers its users.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rc_worker

# What the core must never reach: I/O, clocks, processes, threads and event
# loops, the user database, randomness and ids (the shell injects those), and
# dynamic imports, which would hide the rest from this walk.
FORBIDDEN = frozenset(
    {
        "trio",
        "httpx",
        "os",
        "subprocess",
        "socket",
        "time",
        "threading",
        "asyncio",
        "multiprocessing",
        "concurrent",
        "shutil",
        "tempfile",
        "glob",
        "signal",
        "select",
        "selectors",
        "fcntl",
        "pwd",
        "grp",
        "resource",
        "mmap",
        "ctypes",
        "sqlite3",
        "ssl",
        "http",
        "urllib.request",
        "logging",
        "random",
        "secrets",
        "uuid",
        "importlib",
        "hypercorn",
        "h11",
        "anyio",
        "psycopg",
    }
)
# pathlib's pure classes only compute with strings; its concrete Path does I/O.
ALLOWED_NAMES = {"pathlib": frozenset({"PurePath", "PurePosixPath", "PureWindowsPath"})}

SOURCE_ROOT = Path(rc_worker.__file__).parent.parent


def _forbidden(module: str) -> str | None:
    """The forbidden entry ``module`` falls under (``os.path`` under ``os``), or None."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        if ".".join(parts[:i]) in FORBIDDEN:
            return ".".join(parts[:i])
    return None


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _imports(root: Path, module: str, file: Path) -> list[tuple[str, frozenset[str]]]:
    """Every module ``file`` imports, absolute, with the names taken from it (empty for
    ``import x``)."""
    tree = ast.parse(file.read_text(), filename=str(file))
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, frozenset[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, frozenset()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            names = frozenset(alias.name for alias in node.names)
            found.append((target, names))
            # ``from pkg import sub`` may name a submodule: follow it as one.
            found.extend((f"{target}.{name}", frozenset()) for name in names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
        ):
            found.append(("importlib", frozenset()))
    return found


def impurities(root: Path, package: str, core: str) -> list[str]:
    """One line per forbidden import reachable from a module of ``core``, naming the chain.

    ``root`` is the directory that holds ``package``; imports of ``package``'s
    own modules are followed (except the package root's ``__init__``), others
    are checked against ``FORBIDDEN``.
    """
    core_dir = root.joinpath(*core.split("."))
    start = sorted(
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for p in core_dir.rglob("*.py")
    )
    problems: list[str] = []
    seen: set[str] = set()
    stack = [(module, (module,)) for module in reversed(start)]
    while stack:
        module, chain = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        file = _module_file(root, module)
        if file is None:
            continue
        for target, names in _imports(root, module, file):
            bad = _forbidden(target)
            allowed = ALLOWED_NAMES.get(target)
            if allowed is not None and not names <= allowed:
                bad = f"{target} ({', '.join(sorted(names - allowed))})"
            if bad is not None:
                problems.append(f"{' -> '.join(chain)} imports {bad}")
            elif target.startswith(f"{package}.") and _module_file(root, target) is not None:
                stack.append((target, (*chain, target)))
    return problems


def test_the_core_imports_nothing_that_does_io() -> None:
    assert impurities(SOURCE_ROOT, "rc_worker", "rc_worker.core") == []


def test_the_core_holds_the_decision_modules() -> None:
    # The walk above must have something to walk: an emptied or renamed core
    # would pass it vacuously.
    core = SOURCE_ROOT / "rc_worker" / "core"
    for name in ("lease", "labels", "selectors", "retry", "durations", "names", "config"):
        assert (core / f"{name}.py").is_file(), name


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path.joinpath(*name.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


CLEAN = {
    "pkg/__init__.py": "import os\n",  # the package root is not followed
    "pkg/core/__init__.py": '"""Pure."""\n',
    "pkg/core/a.py": "import re\nfrom pathlib import PurePosixPath\nfrom . import b\n",
    "pkg/core/b.py": "from pkg.core.a import x\nimport attrs\n",
}


def test_a_clean_fake_core_passes(tmp_path: Path) -> None:
    assert impurities(_package(tmp_path, CLEAN), "pkg", "pkg.core") == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import trio\n", "pkg.core.bad imports trio"),
        ("import os.path\n", "pkg.core.bad imports os"),
        ("from time import monotonic\n", "pkg.core.bad imports time"),
        ("def f():\n    import subprocess\n", "pkg.core.bad imports subprocess"),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import httpx\n",
            "pkg.core.bad imports httpx",
        ),
        ("from pathlib import Path\n", "pkg.core.bad imports pathlib (Path)"),
        ("from pkg import shell\n", "pkg.core.bad -> pkg.shell imports socket"),
        ("from ..shell import helper\n", "pkg.core.bad -> pkg.shell imports socket"),
        ("from . import worse\n", "pkg.core.bad -> pkg.core.worse -> pkg.shell imports socket"),
        ("__import__('re')\n", "pkg.core.bad imports importlib"),
    ],
)
def test_the_walker_names_an_impure_module_and_its_chain(
    tmp_path: Path, source: str, expected: str
) -> None:
    files = {
        **CLEAN,
        "pkg/shell.py": "import socket\n\ndef helper() -> None: ...\n",
        "pkg/core/worse.py": "from pkg.shell import helper\n",
        "pkg/core/bad.py": source,
    }
    problems = impurities(_package(tmp_path, files), "pkg", "pkg.core")
    assert expected in problems
    # The clean modules are never blamed for what the bad one does.
    assert not any(p.startswith(("pkg.core.a ", "pkg.core.b ")) for p in problems)
