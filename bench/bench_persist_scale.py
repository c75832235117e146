"""A controller with a large store: RSS and restart time of a real ``rc serve``.

The issue's targets: with 100,000 finished jobs and 10 GiB of stored output, the
controller's RSS stays under 200 MiB and a restart takes under 5 s.

The store is written directly (SQL, not through the controller, so filling takes
seconds, not hours): ``--jobs`` finished job records (the document of a real finished
job, with its id and order changed), two events per job (``job_submitted``,
``job_finished``), a few queued jobs, and ``--output`` bytes of output spread evenly
over the jobs (``zeroblob``: real bytes on disk, zeros). Then, in one run:

- ``rc serve --memory`` started and idle: the baseline RSS;
- ``rc serve --state-dir`` on the big store: time from spawn to "listening" (the
  restart), its RSS then, and its RSS and peak (VmHWM) after a client walks every job
  page by page (``GET /v1/jobs?limit=1000``) and reads 100 jobs' output.

    python bench/bench_persist_scale.py [--jobs N] [--output BYTES] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rc_worker.controller.messages import DeviceDecl, FinishRequest, RegisterRequest, StartRequest
from rc_worker.controller.persist.codec import job_doc
from rc_worker.controller.persist.opening import open_backend
from rc_worker.controller.persist.sqlite import DB_NAME
from rc_worker.controller.store import Store

RC = str(Path(sys.executable).parent / "rc")
USER = "bench-user"


def template_doc() -> dict[str, object]:
    """The stored document of one real finished job."""
    store = Store(instance="bench")
    reply = store.register("box1", RegisterRequest("b", (DeviceDecl("gpu0"),)), now=0.0)
    job_id = store.submit(["python", "train.py", "--epochs", "10"], submitted_by="alice")
    [a] = store.poll("box1", reply.session, ["gpu0"], now=0.0)
    store.start(job_id, StartRequest(reply.session, a.attempt, "gpu0"), now=0.0)
    store.finish(
        job_id,
        FinishRequest(reply.session, a.attempt, "gpu0", "succeeded", 0, output_bytes=1),
        now=0.0,
    )
    job = store.known_job(job_id)
    assert job is not None
    return job_doc(job)


def rows(jobs: int, output: int) -> Iterator[tuple[list[Any], list[Any], list[Any]]]:
    """The store's rows, 10,000 jobs at a time: (jobs, events, (job_id, output length))."""
    doc = template_doc()
    each = output // jobs
    now = time.time()
    batch: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
    for n in range(1, jobs + 1):
        job_id = f"j-{n}-bench"
        doc.update(job_id=job_id, seq=n, finished_at=now - jobs + n, output_bytes=each)
        batch[0].append((job_id, n, "succeeded", now - jobs + n, json.dumps(doc)))
        for k, type_ in enumerate(("job_submitted", "job_finished")):
            data = json.dumps({"job_id": job_id, "by": "alice"})
            batch[1].append((2 * n - 1 + k, type_, now - jobs + n, data))
        batch[2].append((job_id, each))
        if len(batch[0]) == 10_000:
            yield batch
            batch = ([], [], [])
    for n in range(jobs + 1, jobs + 11):  # a few queued jobs, as a live controller has
        job_id = f"j-{n}-bench"
        doc.update(job_id=job_id, seq=n, state="queued", finished_at=None, attempts=[])
        batch[0].append((job_id, n, "queued", None, json.dumps(doc)))
    yield batch


def meta(jobs: int) -> list[tuple[str, str]]:
    counters = json.dumps({"j": jobs + 10})
    return [("instance", "bench"), ("counters", counters), ("event_seq", str(2 * jobs))]


def fill_sqlite(state_dir: Path, jobs: int, output: int) -> None:
    open_backend(state_dir=state_dir).close()  # the schema, as rc serve makes it
    conn = sqlite3.connect(state_dir / DB_NAME, isolation_level=None)
    # Filling only, written once (no WAL copy of 10 GiB); rc serve itself uses WAL, FULL.
    conn.execute("PRAGMA journal_mode=OFF")
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("BEGIN")
    for job_rows, events, out in rows(jobs, output):
        conn.executemany(
            "INSERT INTO jobs (job_id, seq, state, finished_at, data) VALUES (?, ?, ?, ?, ?)",
            job_rows,
        )
        conn.executemany("INSERT INTO events (seq, type, time, data) VALUES (?, ?, ?, ?)", events)
        conn.executemany("INSERT INTO output (job_id, off, data) VALUES (?, 0, zeroblob(?))", out)
    conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", meta(jobs))
    conn.execute("COMMIT")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()


def fill_postgres(url: str, jobs: int, output: int) -> None:
    import psycopg

    open_backend(db=url).close()  # the schema, as rc serve makes it
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        for job_rows, events, out in rows(jobs, output):
            cur.executemany(
                "INSERT INTO jobs (job_id, seq, state, finished_at, data)"
                " VALUES (%s, %s, %s, %s, %s)",
                job_rows,
            )
            cur.executemany(
                "INSERT INTO events (seq, type, time, data) VALUES (%s, %s, %s, %s)", events
            )
            cur.executemany(
                "INSERT INTO output (job_id, off, data) VALUES (%s, 0, %s)",
                [(job_id, bytes(n)) for job_id, n in out],
            )
        cur.executemany(
            "INSERT INTO meta (key, value) VALUES (%s, %s)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            meta(jobs),
        )


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def serve(args: list[str]) -> tuple[subprocess.Popen[bytes], str, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [
            RC,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--user-token",
            f"{USER}=ops:admin",
            "--worker-token",
            "bench-worker",
            *args,
        ],
        stderr=subprocess.PIPE,
        env={**os.environ, "RC_STATE_DIR": ""},
    )
    assert proc.stderr is not None
    said = b""
    while b"listening on " not in said or not said.endswith(b"\n"):
        chunk = os.read(proc.stderr.fileno(), 4096)
        if not chunk:
            proc.kill()
            raise SystemExit(f"rc serve ended before listening: {said!r}")
        said += chunk
    took = time.perf_counter() - t0
    url = said.split(b"listening on ", 1)[1].split()[0].decode().rstrip(",")
    return proc, url, took


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def walk(url: str, jobs: int) -> tuple[int, int, float]:
    """Every job, page by page, and 100 jobs' output; (jobs seen, output bytes read, s)."""
    seen = read = 0
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {USER}"}, timeout=120) as c:
        after = None
        while True:
            params: dict[str, int] = {"limit": 1000}
            if after is not None:
                params["after"] = after
            body = c.get("/v1/jobs", params=params).json()
            seen += len(body["jobs"])
            after = body["next"]
            if after is None:
                break
        for n in range(1, jobs + 1, max(1, jobs // 100)):
            read += len(c.get(f"/v1/jobs/j-{n}-bench/output").content)
    return seen, read, time.perf_counter() - t0


def measure(name: str, store_args: list[str], jobs: int, restarts: int) -> None:
    for i in range(restarts):
        proc, url, took = serve(store_args)
        try:
            rss = status_kib(proc.pid, "VmRSS") / 1024
            line = f"{name}, start {i + 1}: {took:.2f} s to listening, RSS {rss:.1f} MiB"
            if i == restarts - 1:
                seen, read, walked = walk(url, jobs)
                after = status_kib(proc.pid, "VmRSS") / 1024
                peak = status_kib(proc.pid, "VmHWM") / 1024
                line += (
                    f"; after walking {seen} jobs in pages of 1000 and reading "
                    f"{read / 2**20:.0f} MiB of output ({walked:.1f} s): "
                    f"RSS {after:.1f} MiB, peak {peak:.1f} MiB"
                )
            print(line, flush=True)
        finally:
            stop(proc)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--output", type=int, default=10 * 2**30, help="bytes in all")
    parser.add_argument("--dir", type=Path, default=None, help="where the store goes")
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--no-sqlite", action="store_true")
    parser.add_argument(
        "--postgres-output",
        type=int,
        default=None,
        help="also PostgreSQL (a temporary server), with this many bytes of output in all",
    )
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rc-bench-scale-", dir=args.dir))
    server = None
    try:
        proc, _, took = serve(["--memory"])
        try:
            time.sleep(1)
            mem_rss = status_kib(proc.pid, "VmRSS") / 1024
        finally:
            stop(proc)
        print(f"rc serve --memory, idle: start {took:.2f} s, RSS {mem_rss:.1f} MiB", flush=True)
        if not args.no_sqlite:
            state = base / "state"
            t0 = time.perf_counter()
            fill_sqlite(state, args.jobs, args.output)
            size = sum(f.stat().st_size for f in state.iterdir())
            filled = time.perf_counter() - t0
            print(
                f"sqlite store: {args.jobs} finished jobs, {args.output / 2**30:.2f} GiB of "
                f"output, {size / 2**30:.2f} GiB on disk (filled in {filled:.0f} s)",
                flush=True,
            )
            measure("sqlite", ["--state-dir", str(state)], args.jobs, args.restarts)
            shutil.rmtree(state)
        if args.postgres_output is not None:
            from tests.controller import pgserver

            server = pgserver.PgServer()
            server.init()
            url = server.new_database()
            t0 = time.perf_counter()
            fill_postgres(url, args.jobs, args.postgres_output)
            print(
                f"postgres store: {args.jobs} finished jobs, "
                f"{args.postgres_output / 2**30:.2f} GiB of output "
                f"(filled in {time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            measure("postgres", ["--db", url], args.jobs, args.restarts)
    finally:
        if server is not None:
            server.destroy()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
