"""The README's quickstart and library snippet work as pasted.

The quickstart's shell blocks are run as written, with three changes a test
needs: the controller listens on a free port instead of 8080 (``RC_URL`` says
so to ``rc``), the state directory and the config live in a temporary copy
of ``examples/``, and the example's ``status_listen`` is moved to port 0.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import trio
from workerproc import free_port

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BIN = str(Path(sys.executable).parent)


def _blocks(after: str, lang: str) -> list[str]:
    section = README[README.index(after) :]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def _without_venv(script: str) -> str:
    # The test's interpreter is already the venv's; PATH points at its bin.
    return "\n".join(line for line in script.splitlines() if ".venv/bin/activate" not in line)


async def _stop_group(proc: trio.Process) -> None:
    """Stop the script and what it started in the background: SIGQUIT first (a
    worker then stops its jobs and exits), SIGKILL if anything is left."""
    for sig, wait in ((signal.SIGQUIT, 10.0), (signal.SIGKILL, 0.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        await trio.sleep(wait)


async def test_the_quickstart_works_as_pasted(tmp_path: Path) -> None:
    serve_block, worker_block = _blocks("## Quickstart", "sh")[:2]
    [serve_line] = [ln for ln in serve_block.splitlines() if ln.startswith("rc serve")]
    port = free_port()
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    script = _without_venv(worker_block)
    script = script.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    script = script.replace("/tmp/rc-demo-state", str(tmp_path / "state"))
    script = script.replace("/tmp/rc-worker.log", str(tmp_path / "worker.log"))
    script = script.replace(
        "examples/worker.yaml >",
        "examples/worker.yaml | sed 's|^status_listen: .*|status_listen: 127.0.0.1:0|' >",
    )
    assert script.count("rc run -- echo hello") == 1
    script += '\nkill -TERM "$!"\nwait "$!"\necho "worker exit $?"\n'
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    env["RC_URL"] = f"http://127.0.0.1:{port}"
    serve = await trio.lowlevel.open_process(
        [*serve_line.split(), "--listen", f"127.0.0.1:{port}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with trio.fail_after(90):
            done = await trio.run_process(
                ["sh", "-c", script],
                cwd=tmp_path,
                env=env,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                # Its own process group, stopped whole if the guard fires: the
                # script starts rc-worker in the background.
                start_new_session=True,
                deliver_cancel=_stop_group,
            )
    finally:
        serve.send_signal(signal.SIGTERM)
        with trio.move_on_after(10):
            await serve.wait()
        if serve.returncode is None:
            serve.kill()
            await serve.wait()
    out = done.stdout.decode()
    log = (tmp_path / "worker.log").read_text()
    assert done.returncode == 0, (out, done.stderr.decode(), log)
    lines = out.splitlines()
    assert lines[0] == "hello"
    assert any(re.search(r"/gpu0\s+free\b", ln) for ln in lines), out
    assert any(re.search(r"/gpu1\s+free\b", ln) for ln in lines), out
    assert lines[-1] == "worker exit 0"
    assert "Traceback" not in log


async def test_the_library_snippet_works_as_pasted(tmp_path: Path) -> None:
    [snippet] = _blocks("Programs that embed the worker", "python")[:1]
    (tmp_path / "test_snippet.py").write_text(snippet)
    # An empty configuration of its own: not this project's trio_mode.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    with trio.fail_after(90):
        done = await trio.run_process(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_snippet.py"],
            cwd=tmp_path,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = done.stdout.decode()
    assert done.returncode == 0, out
    assert "1 passed" in out
