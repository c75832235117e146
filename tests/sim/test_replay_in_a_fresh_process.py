"""A seeded simulation replays byte for byte in a plain Python process too.

Under pytest, hypothesis is imported, and its Trio plugin makes Trio's
scheduler deterministic. A replay line pasted into a plain ``python`` has no
hypothesis: ``simulate(seed=...)`` must make the scheduler deterministic
itself, or tasks ready at one instant run in an order that depends on memory
addresses, and the run is not the one that failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Kills a worker as soon as it has taken a job's second write out of the pipe: whether
# the kill lands before or after the worker spools that write depends on the order of
# tasks ready at one instant, so each seed's outcome shows the scheduler's order.
CHILD = textwrap.dedent(
    """
    import sys
    import trio
    from rc_worker.testing.fleet import simulate
    from rc_worker.testing.sim import Script, Sleep, Write

    async def scenario(fleet):
        fleet.program("job", Script((Write(b"a"), Sleep(10), Write(b"b"), Sleep(10))))
        job = fleet.submit(["job"], grace_s=0.0)
        host = fleet.nodes["h0"].host
        await fleet.wait_until(lambda: bool(host.spawned(job)), interval=0.5)
        proc = host.spawned(job)[0]
        await trio.sleep_until(proc.started_at + 10)
        for _ in range(50):
            if len(proc.stdout.read) == 2:
                break
            await trio.lowlevel.checkpoint()
        await fleet.crash("h0")
        fleet.restart("h0")
        await fleet.settle()
        await fleet.drain()
        events = [(e.seq, e.type) for e in fleet.events()]
        return proc.stdout.lost_in_reader, fleet.store.output(job), events

    if sys.argv[2] == "with-hypothesis":
        import hypothesis  # its Trio plugin: the scheduler pytest runs examples with
    else:
        assert "hypothesis" not in sys.modules, "this must run without hypothesis"
    # What a process did before (here: objects it keeps) moves every later object's
    # address; the run must not depend on it.
    kept = [[object() for _ in range(int(sys.argv[1]))]]
    for seed in range(8):
        print(seed, simulate(scenario, hosts=1, devices=("gpu0",), seed=seed))
        kept.append([bytearray(int(sys.argv[1]) % 997) for _ in range(seed * 37)])
    """
)


def run_child(hash_seed: str, junk: int, mode: str = "plain") -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(junk), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_seeded_run_is_the_same_in_every_fresh_process_with_or_without_hypothesis() -> None:
    # As a failing example ran (under pytest, hypothesis loaded) ...
    first = run_child("1", 0, "with-hypothesis")
    assert first.count("\n") == 8
    # ... and as its pasted replay line runs (plain python), whatever came before.
    for hash_seed, junk in (("2", 1000), ("3", 33333), ("4", 77)):
        assert run_child(hash_seed, junk) == first
