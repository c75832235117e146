"""Usage sheets: read from sheet_dir, sent at register and again when a file changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from rc_worker.sheets import SHEET_CAP, SheetReader
from rc_worker.testing import local_system, make_config


def test_reader_reads_host_and_device_sheets_and_skips_bad_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "host.d").mkdir()
    (tmp_path / "host.md").write_text("# the host\n")
    (tmp_path / "host.d" / "gpu0.md").write_text("# gpu0\n")
    (tmp_path / "host.d" / "gpu1.md").write_bytes(b"x" * (SHEET_CAP + 1))
    (tmp_path / "host.d" / "gpu2.md").mkdir()
    reader = SheetReader(str(tmp_path), ["gpu0", "gpu1", "gpu2", "gpu3"])
    assert reader.read() == {"host": "# the host\n", "devices": {"gpu0": "# gpu0\n"}}
    assert "larger than" in caplog.text
    assert "gpu2.md" in caplog.text
    assert not reader.changed()
    (tmp_path / "host.md").write_text("# changed\n")
    assert reader.changed()
    assert not reader.changed()


def test_missing_sheet_dir_is_no_sheets(tmp_path: Path) -> None:
    assert SheetReader(str(tmp_path / "absent"), ["gpu0"]).read() == {"host": None, "devices": {}}


async def test_sheets_reach_the_controller_and_are_resent_on_change(tmp_path: Path) -> None:
    sheets = tmp_path / "sheets"
    (sheets / "host.d").mkdir(parents=True)
    (sheets / "host.md").write_text("# rack 12\n")
    (sheets / "host.d" / "gpu0.md").write_text("# the fast one\n")
    with trio.fail_after(30):
        async with local_system(make_config(tmp_path)) as system:
            sheet = system.store.sheet("test-host", "gpu0")
            assert sheet.host_sheet == "# rack 12\n"
            assert sheet.device_sheet == "# the fast one\n"
            (sheets / "host.d" / "gpu0.md").write_text("# now slower\n")
            system.worker.reprobe()  # what SIGHUP does
            await system.wait_until(
                lambda: system.store.sheet("test-host", "gpu0").device_sheet == "# now slower\n"
            )
