"""The stored schema, its version, and the migrations between versions.

Version 1 is the first schema (kept as a fixture in tests/fixtures/); version 2
adds the webhook cursors and an index on the job order; version 3 moves SQLite's
job output out of the database into files (a step of that backend's own:
``SqliteBackend._migrate_more``). PostgreSQL keeps output in rows, where a standby
sees it, and its stores stay at version 2 (``PostgresBackend.schema_target``), so
that a standby still on the previous release can open them. A fresh database gets
the current version; an older one is migrated at start, one step at a time in
one transaction; a newer one is refused. The SQL is written once with two
placeholders for the types that differ between SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Final

SCHEMA_VERSION: Final = 3

_V1: Final = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE hosts (name TEXT PRIMARY KEY, data TEXT NOT NULL)",
    "CREATE TABLE jobs (job_id TEXT PRIMARY KEY, seq BIGINT NOT NULL, state TEXT NOT NULL,"
    " finished_at {real}, data TEXT NOT NULL)",
    "CREATE TABLE events (seq BIGINT PRIMARY KEY, type TEXT NOT NULL, time {real} NOT NULL,"
    " data TEXT NOT NULL)",
    "CREATE TABLE output (job_id TEXT NOT NULL, off BIGINT NOT NULL, data {blob} NOT NULL,"
    " PRIMARY KEY (job_id, off))",
)

_V2: Final = (
    "CREATE TABLE webhooks (url TEXT PRIMARY KEY, last_seq BIGINT NOT NULL)",
    "CREATE INDEX jobs_by_seq ON jobs (seq)",
    "CREATE INDEX jobs_by_finish ON jobs (finished_at)",
)

MIGRATIONS: Final[dict[int, tuple[str, ...]]] = {1: _V1, 2: _V2, 3: ()}
"""``MIGRATIONS[n]`` takes a database at version ``n - 1`` (0: empty) to version ``n``."""


def statements(
    from_version: int, *, real: str, blob: str, target: int = SCHEMA_VERSION
) -> list[str]:
    """The SQL that brings a database at ``from_version`` to ``target``."""
    out: list[str] = []
    for version in range(from_version + 1, target + 1):
        out += [s.format(real=real, blob=blob) for s in MIGRATIONS[version]]
    return out


def too_new(found: int, where: str, target: int = SCHEMA_VERSION) -> str:
    return (
        f"{where} has schema version {found}, newer than this program's {target}; "
        "run a newer rc, or point it at another store"
    )
