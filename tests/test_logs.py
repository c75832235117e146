"""The worker's log: JSON lines with context fields, UTC text lines, quiet third parties."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
from pathlib import Path

import trio
from workerproc import TOKEN, serve_controller, wait_store, worker_process, write_config

from rc_worker.controller.store import Store, StoreConfig
from rc_worker.logs import log_context, setup_logging, utc_timestamp

RFC3339_MS_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def test_utc_timestamps_are_rfc3339_with_milliseconds() -> None:
    assert utc_timestamp(0.0) == "1970-01-01T00:00:00.000Z"
    assert utc_timestamp(1_700_000_000.5) == "2023-11-14T22:13:20.500Z"


def test_json_lines_carry_the_context_fields(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("info", "json", host="h1", stream=out)
    log = logging.getLogger("rc_worker.test")
    with log_context(device="gpu0"):
        with log_context(job_id="j-1", attempt=2):
            log.info("job %s ran", "j-1")
        log.warning("quarantined", extra={"fault_id": "f-9"})
    log.info("plain")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["job j-1 ran", "quarantined", "plain"]
    first, second, third = lines
    assert first["device"] == "gpu0"
    assert (first["job_id"], first["attempt"]) == ("j-1", 2)
    assert second["fault_id"] == "f-9"
    assert "job_id" not in second
    assert third["host"] == "h1"
    assert "device" not in third
    for line in lines:
        assert RFC3339_MS_UTC.match(line["time"])
        assert line["logger"] == "rc_worker.test"
    assert [line["level"] for line in lines] == ["info", "warning", "info"]


def test_text_lines_carry_a_utc_timestamp_with_its_zone(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("info", "text", host="h1", stream=out)
    with log_context(device="gpu1"):
        logging.getLogger("rc_worker.test").info("hello")
    stamp, level, rest = out.getvalue().strip().split(" ", 2)
    assert RFC3339_MS_UTC.match(stamp)
    assert level == "INFO"
    assert rest == "rc_worker.test: hello [device=gpu1]"


def test_third_party_loggers_stay_at_warning_unless_debug(restore_logging: None) -> None:
    setup_logging("info", "text", stream=io.StringIO())
    for name in ("httpx", "httpcore", "hypercorn"):
        assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING
    setup_logging("debug", "text", stream=io.StringIO())
    assert logging.getLogger("httpcore").getEffectiveLevel() == logging.DEBUG


async def test_a_real_worker_logs_json_lines_with_job_fields_and_no_token(
    tmp_path: Path,
) -> None:
    store = Store(StoreConfig(heartbeat_interval_s=0.5, poll_wait_s=2.0))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url = await serve_controller(nursery, store, {TOKEN: "op-host"})
            config = write_config(tmp_path, url)
            async with worker_process(config, args=("--log-format", "json")) as w:
                await wait_store(store, lambda: any(d.host == "op-host" for d in store.devices()))
                job_id = store.submit(["sh", "-c", "echo hi"])
                await wait_store(store, lambda: store.job(job_id).state == "succeeded")
                w.proc.send_signal(signal.SIGTERM)
                assert await w.wait() == 0
            nursery.cancel_scope.cancel()
    text = w.stderr.decode()
    assert TOKEN not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) > 3
    for line in lines:
        assert {"time", "level", "logger", "message"} <= set(line), line
        assert RFC3339_MS_UTC.match(line["time"])
        assert line["host"] == "op-host"
    [assigned] = [ln for ln in lines if "assigned job" in ln["message"]]
    [finished] = [ln for ln in lines if "succeeded" in ln["message"]]
    for line in (assigned, finished):
        assert line["device"] == "gpu0"
        assert line["job_id"] == job_id
        assert line["attempt"] == 1
    assert not any("job_id" in ln for ln in lines if "registered" in ln["message"])


def test_a_logged_exception_is_one_line_unless_debug(restore_logging: None) -> None:
    log = logging.getLogger("rc_worker.test")
    for fmt in ("text", "json"):
        for level, traceback_wanted in (("info", False), ("debug", True)):
            out = io.StringIO()
            setup_logging(level, fmt, stream=out)
            try:
                raise OSError("disk full")
            except OSError:
                log.exception("device gpu0: internal error")
            text = out.getvalue()
            assert ("Traceback" in text) is traceback_wanted, (fmt, level, text)
            if not traceback_wanted:
                assert text.count("\n") == 1
                assert "OSError: disk full" in text
