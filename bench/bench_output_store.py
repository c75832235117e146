"""Benchmark: what storing job output in SQLite costs, against appending it to a file.

The controller commits output (``synchronous=FULL``, WAL) every few MiB of a streamed
body. This writes SIZE bytes, in pieces of ROW bytes, one commit per COMMIT bytes:

- the way the SQLite backend stores it now (``SqliteBackend.write``: the bytes into
  ``output/<job>``, fsynced, then the job's length committed in the database);
- as rows of ``output(job_id, off, data)`` in the database, as it did before schema
  version 3 (and as PostgreSQL still does), with the page sizes given;

and, in the same run, the baseline: the same bytes appended to a file with an fsync per
COMMIT bytes. Prints each as GiB/s (wall) and CPU seconds per GiB, with the ratio to the
baseline and the machine's load.

    python bench/bench_output_store.py [--bytes SIZE] [--row ROW] [--commit COMMIT]
                                       [--page-sizes 4096,65536]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

GIB = float(1 << 30)


def sqlite_rows(where: Path, size: int, row: int, commit: int, page: int) -> tuple[float, float]:
    db = where / f"rows-{page}.db"
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute(f"PRAGMA page_size={page}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(
            "CREATE TABLE output (job_id TEXT NOT NULL, off BIGINT NOT NULL,"
            " data BLOB NOT NULL, PRIMARY KEY (job_id, off))"
        )
        blob = os.urandom(row)
        t0, c0 = time.perf_counter(), time.process_time()
        off = 0
        while off < size:
            rows = []
            end = min(size, off + commit)
            while off < end:
                rows.append(("j-1", off, blob))
                off += row
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO output VALUES (?, ?, ?)", rows)
            conn.execute("COMMIT")
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        conn.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)


def shipped_backend(where: Path, size: int, row: int, commit: int) -> tuple[float, float]:
    from rc_worker.controller.persist.codec import Batch
    from rc_worker.controller.persist.opening import open_backend

    backend = open_backend(state_dir=where / "state")
    try:
        blob = os.urandom(row)
        t0, c0 = time.perf_counter(), time.process_time()
        off, generation = 0, 0
        while off < size:
            pieces = []
            end = min(size, off + commit)
            while off < end:
                pieces.append(("j-1", off, blob))
                off += row
            generation += 1
            backend.write([Batch(generation=generation, output=tuple(pieces))])
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        backend.close()


def file_appends(where: Path, size: int, row: int, commit: int) -> tuple[float, float]:
    path = where / "appends"
    blob = os.urandom(row)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        off = 0
        while off < size:
            end = min(size, off + commit)
            while off < end:
                os.write(fd, blob)
                off += row
            os.fsync(fd)
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        os.close(fd)
        path.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=256 << 20)
    parser.add_argument("--row", type=int, default=1 << 20)
    parser.add_argument("--commit", type=int, default=4 << 20)
    parser.add_argument("--page-sizes", default="4096,65536")
    args = parser.parse_args()
    print(
        f"load average {os.getloadavg()[0]:.2f}; {args.bytes / GIB:.2f} GiB, rows of"
        f" {args.row >> 10} KiB, a commit every {args.commit >> 20} MiB"
    )
    with tempfile.TemporaryDirectory(prefix="rc-bench-output-") as name:
        where = Path(name)
        base_wall, base_cpu = file_appends(where, args.bytes, args.row, args.commit)
        gib = args.bytes / GIB
        print(
            f"baseline, file appends + fsync: {gib / base_wall:.2f} GiB/s,"
            f" {base_cpu / gib:.2f} s CPU/GiB"
        )
        wall, cpu = shipped_backend(where, args.bytes, args.row, args.commit)
        print(
            f"SqliteBackend as shipped (files + lengths): {gib / wall:.2f} GiB/s"
            f" ({base_wall / wall:.2f}x the baseline), {cpu / gib:.2f} s CPU/GiB"
        )
        for page in (int(p) for p in args.page_sizes.split(",")):
            wall, cpu = sqlite_rows(where, args.bytes, args.row, args.commit, page)
            print(
                f"SQLite rows, page_size {page}: {gib / wall:.2f} GiB/s"
                f" ({base_wall / wall:.2f}x the baseline), {cpu / gib:.2f} s CPU/GiB"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
