"""The `rc` client starts without loading the server or the worker.

`rc ps`, `rc logs` and the rest are short-lived processes, often run in loops and
scripts; loading Starlette, hypercorn, the stores and the whole worker tripled their
start-up (about 0.6 s of CPU against 0.2 s). The package's public names stay importable:
they load on first use.
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = (
    "starlette",
    "hypercorn",
    "rc_worker.worker",
    "rc_worker.controller.store",
    "rc_worker.controller.app",
)


def _loaded_after(statement: str) -> list[str]:
    probe = (
        f"import sys; {statement}; "
        f"print('\\n'.join(m for m in sys.modules if m.startswith({HEAVY!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.split()


def test_the_rc_client_loads_neither_server_nor_worker() -> None:
    assert _loaded_after("import rc_worker.controller.rc_cli") == []


def test_public_names_load_on_first_use() -> None:
    loaded = _loaded_after(
        "import rc_worker, rc_worker.controller; rc_worker.Worker; rc_worker.controller.Store"
    )
    assert "rc_worker.worker" in loaded
    assert "rc_worker.controller.store" in loaded
    from rc_worker import Worker
    from rc_worker.controller import Store, store

    assert Worker.__module__ == "rc_worker.worker"
    assert Store.__module__ == "rc_worker.controller.store"
    assert store.Store is Store
