"""A real PostgreSQL server for the tests: initdb and pg_ctl on a Unix socket in a temp dir.

Started once per test session (by the ``pg_server`` fixture in conftest.py),
always stopped at the end, never reused from an earlier run. Each test gets a
database of its own. As root, the server runs as the ``postgres`` user through
``runuser``. Nothing listens on TCP.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

BIN = Path(os.environ.get("RC_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
_names = itertools.count(1)


def available() -> bool:
    return (BIN / "initdb").is_file() and (BIN / "pg_ctl").is_file()


class PgServer:
    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="rc-pg-"))
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self._as: list[str] = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *argv: str) -> None:
        subprocess.run(
            [*self._as, *argv], check=True, capture_output=True, timeout=120, cwd=self.base
        )

    def init(self) -> None:
        self._run(
            str(BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync"
        )
        self.start()

    def start(self) -> None:
        opts = f"-k {self.base} -c listen_addresses='' -F"
        self._run(
            str(BIN / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-o",
            opts,
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self) -> None:
        try:
            self._run(str(BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            # pg_ctl could not stop it: end the postmaster this test started (its pid
            # is the first line of postmaster.pid), so it never outlives its data.
            self._kill_postmaster()

    def _kill_postmaster(self) -> None:
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return  # never started, or already gone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        for _ in range(100):  # bounded: up to 10 s for it to go
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

    def url(self, db: str) -> str:
        return f"postgresql:///{db}?host={self.base}&user=postgres"

    def new_database(self) -> str:
        """A fresh, empty database; returns its libpq URI."""
        name = f"rc_test_{os.getpid()}_{next(_names)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.split("/")[3].split("?")[0]
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def running_server() -> Iterator[PgServer]:
    server = PgServer()
    try:
        server.init()
        yield server
    finally:
        server.destroy()
