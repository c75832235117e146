"""The probe pass with real subprocesses: a fake nvidia-smi on a private PATH, drop-ins in tmp.

Every Prober here gets its own ``environ`` (a dict the test owns), so no
test touches ``os.environ``; the PATH in it holds only the fake nvidia-smi
(when a test wants one) and links to the few tools the scripts use.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import attrs
import pytest
import trio

from rc_worker.core.config import Config, DeviceConfig
from rc_worker.core.gpu_query import NVIDIA_SMI_ARGS
from rc_worker.core.labels import labels_payload
from rc_worker.host import LinuxHost
from rc_worker.probe import ProbePass, Prober, SourceOutcome

HELPERS = Path(__file__).parent / "probe_helpers"
EXAMPLES = Path(__file__).parent.parent / "examples" / "probe.d"
FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"
GPUS8 = tuple(f"gpu{n}" for n in range(8))
TOOLS = ("cat", "sleep", "yes", "echo", "printf", "kill", "tr")


class FakeHost(LinuxHost):
    """The real host, with facts a test can set or break."""

    def __init__(self) -> None:
        self.disk = 72_000_000_000
        self.mem_error: Exception | None = None

    def disk_free_bytes(self, path: str) -> int:
        return self.disk

    def mem_total_bytes(self) -> int:
        if self.mem_error is not None:
            raise self.mem_error
        return 64 * 2**30


@attrs.define
class Env:
    """A test's private world: tools, an optional fake nvidia-smi, a probe.d."""

    root: Path
    environ: dict[str, str]
    probe_dir: Path
    smi_dir: Path

    def install_smi(self, fixture: str | None = None, rc: int = 0, **env: str) -> None:
        target = self.smi_dir / "nvidia-smi"
        shutil.copy(HELPERS / "fake_nvidia_smi.sh", target)
        target.chmod(0o755)
        self.environ["PATH"] = f"{self.smi_dir}:{self.root / 'tools'}"
        if fixture is not None:
            self.environ["FAKE_SMI_OUTPUT"] = str(FIXTURES / fixture)
        self.environ["FAKE_SMI_RC"] = str(rc)
        self.environ.update(env)

    def remove_smi(self) -> None:
        self.environ["PATH"] = str(self.root / "tools")

    def dropin(self, name: str, body: str, mode: int = 0o755) -> Path:
        path = self.probe_dir / name
        path.write_text("#!/bin/sh\n" + body + "\n")
        path.chmod(mode)
        return path

    def config(
        self,
        devices: tuple[str, ...] = ("gpu0", "gpu1"),
        labels: Mapping[str, Mapping[str, str]] | None = None,
        **changes: object,
    ) -> Config:
        labels = labels or {}
        config = Config(
            devices=tuple(DeviceConfig(name=d, labels=dict(labels.get(d, {}))) for d in devices),
            host="node-a",
            probe_dir=str(self.probe_dir),
            probe_timeout=0.5,
            probe_pass_budget=20.0,
            state_dir=str(self.root / "state"),
        )
        return attrs.evolve(config, **changes)


@pytest.fixture
def env(tmp_path: Path) -> Env:
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            (tools / tool).symlink_to(found)
    # Not whatever "python3" is on PATH (a pyenv shim needs bash and more).
    (tools / "python3").symlink_to(os.path.realpath(sys.executable))
    smi_dir = tmp_path / "smi"
    smi_dir.mkdir()
    probe_dir = tmp_path / "probe.d"
    probe_dir.mkdir()
    environ = {"PATH": str(tools), "HOME": str(tmp_path), "RC_TOKEN": "secret"}
    return Env(root=tmp_path, environ=environ, probe_dir=probe_dir, smi_dir=smi_dir)


def outcome(probe_pass: ProbePass, name: str) -> SourceOutcome:
    (found,) = [s for s in probe_pass.sources if s.name == name]
    return found


async def one_pass(env: Env, config: Config, host: FakeHost | None = None) -> ProbePass:
    with trio.fail_after(30):
        return await Prober(config, host=host, environ=env.environ).gather()


# --------------------------------------------------------------------------
# built-ins


async def test_builtin_host_facts(env: Env) -> None:
    host = FakeHost()
    probe_pass = await one_pass(env, env.config(), host)
    result = probe_pass.result
    assert result.host["disk_free_bytes"] == "72000000000"
    assert result.host["mem_total_bytes"] == str(64 * 2**30)
    assert result.host["cpu_count"] == str(os.cpu_count())
    assert set(result.host) == {
        "hostname",
        "kernel",
        "cpu_count",
        "mem_total_bytes",
        "disk_free_bytes",
    }
    assert outcome(probe_pass, "builtin") == SourceOutcome(
        "builtin", True, "", outcome(probe_pass, "builtin").seconds
    )
    # No nvidia-smi, no drop-ins: every device confirmed, with nothing to say.
    assert labels_payload(result)["devices"] == {"gpu0": {}, "gpu1": {}}
    assert probe_pass.nvidia_smi is None


async def test_a_builtin_that_raises_is_left_out_and_unconfirms_nothing(env: Env) -> None:
    host = FakeHost()
    host.mem_error = OSError("MemTotal missing from /proc/meminfo")
    probe_pass = await one_pass(env, env.config(), host)
    assert "mem_total_bytes" not in probe_pass.result.host
    assert "disk_free_bytes" in probe_pass.result.host
    assert not probe_pass.result.unconfirmed
    builtin = outcome(probe_pass, "builtin")
    assert not builtin.ok
    assert builtin.why == "mem_total_bytes: MemTotal missing from /proc/meminfo"


# --------------------------------------------------------------------------
# nvidia-smi


async def test_healthy_one_gpu(env: Env) -> None:
    log = env.root / "smi.log"
    env.install_smi("01_healthy_1gpu.noheader.csv", FAKE_SMI_LOG=str(log))
    probe_pass = await one_pass(env, env.config(devices=("gpu0",)))
    payload = labels_payload(probe_pass.result)
    assert payload["devices"]["gpu0"]["product"] == "NVIDIA H100 80GB HBM3"
    assert payload["devices"]["gpu0"]["memory_total_bytes"] == str(81559 * 2**20)
    assert outcome(probe_pass, "nvidia-smi").ok
    assert probe_pass.nvidia_smi == str(env.smi_dir / "nvidia-smi")
    assert log.read_text().split(" ", 1)[1].strip() == " ".join(NVIDIA_SMI_ARGS)


async def test_healthy_eight_gpus_and_undeclared_rows(env: Env) -> None:
    env.install_smi("02_healthy_8gpu_h100.noheader.csv")
    probe_pass = await one_pass(env, env.config(devices=(*GPUS8[:6], "nic0")))
    devices = labels_payload(probe_pass.result)["devices"]
    assert set(devices) == {*GPUS8[:6], "nic0"}
    assert devices["gpu5"]["pci_bus_id"] == "00000000:AB:00.0"
    assert devices["nic0"] == {}


@pytest.mark.parametrize("stem", ["03_driver_not_loaded", "03b_driver_library_mismatch"])
async def test_driver_failure_unconfirms_every_gpu_but_not_other_devices(
    env: Env, stem: str
) -> None:
    rc = int((FIXTURES / f"{stem}.rc").read_text())
    env.install_smi(f"{stem}.txt", rc)
    probe_pass = await one_pass(env, env.config(devices=("gpu0", "gpu1", "nic0")))
    assert probe_pass.result.unconfirmed == {"gpu0", "gpu1"}
    assert labels_payload(probe_pass.result)["devices"] == {"nic0": {}}
    smi = outcome(probe_pass, "nvidia-smi")
    assert not smi.ok
    assert smi.why.startswith(f"exit status {rc}: ")
    assert "host" in labels_payload(probe_pass.result)


@pytest.mark.parametrize("on_stderr", ["", "1"])
async def test_lost_gpu_on_either_stream(env: Env, on_stderr: str) -> None:
    env.install_smi("04_gpu_lost_8gpu.txt", 15, FAKE_SMI_STDERR=on_stderr)
    probe_pass = await one_pass(env, env.config(devices=GPUS8))
    assert probe_pass.result.unconfirmed == {"gpu3"}
    assert set(labels_payload(probe_pass.result)["devices"]) == set(GPUS8) - {"gpu3"}
    assert "gpu3 not confirmed" in outcome(probe_pass, "nvidia-smi").why


async def test_error_cells_and_mig(env: Env) -> None:
    env.install_smi("05_err_values_8gpu.noheader.csv")
    probe_pass = await one_pass(env, env.config(devices=GPUS8))
    assert not probe_pass.result.unconfirmed
    assert "mig_mode" not in probe_pass.result.device["gpu3"]
    env.install_smi("06_mig_enabled_1gpu.noheader.csv")
    probe_pass = await one_pass(env, env.config(devices=("gpu0",)))
    assert probe_pass.result.device["gpu0"]["mig_mode"] == "Enabled"


async def test_hung_nvidia_smi_is_killed_at_the_timeout(env: Env) -> None:
    log = env.root / "smi.log"
    env.install_smi("02_healthy_8gpu_h100.noheader.csv", FAKE_SMI_SLEEP="30", FAKE_SMI_LOG=str(log))
    probe_pass = await one_pass(env, env.config(devices=GPUS8))
    assert probe_pass.result.unconfirmed == set(GPUS8)
    assert outcome(probe_pass, "nvidia-smi").why == "timed out after 0.5s"
    pgid = int(log.read_text().split()[0])
    # The stub and its sleep are gone (a zombie an init never reaps is not alive).
    assert not [p for p in LinuxHost().processes() if p.pgid == pgid and p.alive]


async def test_nvidia_smi_seen_at_first_pass_then_gone(env: Env) -> None:
    env.install_smi("02_healthy_8gpu_h100.noheader.csv")
    prober = Prober(env.config(devices=("gpu0", "gpu1", "nic0")), environ=env.environ)
    with trio.fail_after(30):
        first = await prober.gather()
        env.remove_smi()
        second = await prober.gather()
    assert not first.result.unconfirmed
    assert second.result.unconfirmed == {"gpu0", "gpu1"}
    assert outcome(second, "nvidia-smi").why == "not found on PATH (it was at startup)"
    assert labels_payload(second.result)["devices"] == {"nic0": {}}


async def test_nvidia_smi_never_seen_at_startup_unconfirms_nothing_when_gone(env: Env) -> None:
    prober = Prober(env.config(), environ=env.environ)
    with trio.fail_after(30):
        first = await prober.gather()
        env.install_smi("02_healthy_8gpu_h100.noheader.csv")
        second = await prober.gather()
        env.remove_smi()
        third = await prober.gather()
    assert not first.result.unconfirmed
    assert second.result.device["gpu1"]["product"] == "NVIDIA H100 80GB HBM3"
    # Not there at startup: its absence later is not a failure, so the
    # labels it gave are cleared rather than frozen.
    assert not third.result.unconfirmed
    assert labels_payload(third.result)["devices"] == {"gpu0": {}, "gpu1": {}}
    assert [s.name for s in third.sources] == ["builtin"]


async def test_nvidia_smi_is_not_run_without_declared_gpus(env: Env) -> None:
    log = env.root / "smi.log"
    env.install_smi("02_healthy_8gpu_h100.noheader.csv", FAKE_SMI_LOG=str(log))
    probe_pass = await one_pass(env, env.config(devices=("nic0",)))
    assert not log.exists()
    assert [s.name for s in probe_pass.sources] == ["builtin"]


# --------------------------------------------------------------------------
# drop-ins


async def test_dropins_run_in_name_order_and_override(env: Env) -> None:
    env.dropin("20-b", """printf '{"rack": "b", "kernel": "custom"}'""")
    env.dropin("10-a", """printf '{"rack": "a", "gpu0.x": "a", "gpu1.y": 2, "gpu1.z": true}'""")
    env.dropin(".hidden", "exit 1")
    env.dropin("30-off", "exit 1", mode=0o644)
    (env.probe_dir / "40-dir").mkdir()
    config = env.config(labels={"gpu0": {"x": "declared"}})
    probe_pass = await one_pass(env, config)
    assert [s.name for s in probe_pass.sources] == ["builtin", "probe.d/10-a", "probe.d/20-b"]
    assert all(s.ok for s in probe_pass.sources)
    payload = labels_payload(probe_pass.result)
    assert payload["host"]["rack"] == "b"
    assert payload["host"]["kernel"] == "custom"
    assert payload["devices"] == {"gpu0": {"x": "declared"}, "gpu1": {"y": "2", "z": "true"}}


async def test_dropin_environment(env: Env) -> None:
    env.dropin(
        "10-env",
        """printf '{"h": "%s", "d": "%s", "t": "%s", "cwd": "%s"}' """
        """ "$RC_HOST" "$RC_DEVICES" "${RC_TOKEN-unset}" "$PWD" """,
    )
    probe_pass = await one_pass(env, env.config())
    assert probe_pass.result.host["h"] == "node-a"
    assert probe_pass.result.host["d"] == "gpu0,gpu1"
    assert probe_pass.result.host["t"] == "unset"
    assert probe_pass.result.host["cwd"] == str(env.probe_dir)


FAILING = {
    "exit": ("echo boom >&2; exit 3", "exit status 3: boom"),
    "signal": ("kill -9 $$", "killed by signal 9"),
    "timeout": ("sleep 30", "timed out after 0.5s"),
    "cap": ("""yes '"aaaaaaaaaaaaaaaaaaaaaaaaaaaa"'""", "output over the 65536-byte cap"),
    "not-json": ("echo nope", "not JSON: "),
    "not-object": ("echo '[1]'", "not a JSON object: got an array"),
    "nested": ("""echo '{"a": {"b": 1}}'""", "key 'a' holds an object"),
    "null": ("""echo '{"a": null}'""", "key 'a' holds null"),
    "bad-key": ("""echo '{"a b": 1}'""", "invalid key: "),
    "undeclared": ("""echo '{"gpu9.x": 1}'""", "names undeclared device gpu9"),
    "nul": (
        """printf '%s' '{"gpu0.uuid": "GPU-\\u0000bad"}'""",
        "key 'gpu0.uuid' holds a NUL byte",
    ),
}


@pytest.mark.parametrize("how", sorted(FAILING))
async def test_a_dropin_that_named_gpu0_then_breaks_leaves_only_gpu0_unconfirmed(
    env: Env, how: str
) -> None:
    broken = env.root / "broken"
    body, why = FAILING[how]
    env.dropin(
        "10-ecc",
        f'if [ -e "{broken}" ]; then {body}; exit 0; fi\n'
        """printf '{"gpu0.ecc": "on", "rack": "r1"}'""",
    )
    env.dropin("20-fine", """printf '{"gpu1.fine": "yes"}'""")
    host = FakeHost()
    prober = Prober(env.config(), host=host, environ=env.environ)
    with trio.fail_after(30):
        first = await prober.gather()
        broken.touch()
        host.disk = 3_000_000_000
        second = await prober.gather()
    assert labels_payload(first.result)["devices"] == {
        "gpu0": {"ecc": "on"},
        "gpu1": {"fine": "yes"},
    }
    failed = outcome(second, "probe.d/10-ecc")
    assert not failed.ok
    assert failed.why.startswith(why)
    assert second.result.unconfirmed == {"gpu0"}
    payload = labels_payload(second.result)
    # The seed's disk_free_bytes story: host facts keep updating.
    assert payload["host"]["disk_free_bytes"] == "3000000000"
    assert "rack" not in payload["host"]
    assert payload["devices"] == {"gpu1": {"fine": "yes"}}


async def test_a_dropin_uuid_with_a_nul_byte_keeps_the_previous_one_and_says_why(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A uuid becomes a job's CUDA_VISIBLE_DEVICES, which cannot carry a NUL. Before, such
    a value was taken as the device's uuid, and every job on it then failed at spawn
    (ending ``error`` and quarantining the device). Now the probe fails this pass: the
    device keeps the uuid it had, and one line names the probe, the key and the problem."""
    bad = env.root / "bad"
    env.dropin(
        "10-uuid",
        f"""if [ -e "{bad}" ]; then printf '%s' '{{"gpu0.uuid": "GPU-\\u0000bad"}}'; """
        """else printf '{"gpu0.uuid": "GPU-good"}'; fi""",
    )
    prober = Prober(env.config(), host=FakeHost(), environ=env.environ)
    with trio.fail_after(30):
        first = await prober.gather()
        bad.touch()
        caplog.set_level(logging.WARNING, logger="rc_worker.probe")
        second = await prober.gather()
    assert first.result.device["gpu0"] == {"uuid": "GPU-good"}
    assert not outcome(second, "probe.d/10-uuid").ok
    assert second.result.unconfirmed == {"gpu0"}  # so the controller keeps GPU-good
    assert "gpu0" not in labels_payload(second.result)["devices"]
    assert all("\0" not in v for facts in second.result.device.values() for v in facts.values())
    lines = [r.getMessage() for r in caplog.records if "10-uuid" in r.getMessage()]
    assert lines == [
        "probe probe.d/10-uuid failed: key 'gpu0.uuid' holds a NUL byte; "
        "a label value must be text without NUL bytes"
    ]


async def test_a_dropin_that_fails_from_the_start_unconfirms_nothing(env: Env) -> None:
    env.dropin("10-broken", "exit 1")
    probe_pass = await one_pass(env, env.config())
    assert not outcome(probe_pass, "probe.d/10-broken").ok
    assert not probe_pass.result.unconfirmed


async def test_stat_failure_and_disabling(env: Env) -> None:
    script = env.dropin("10-ecc", """printf '{"gpu0.ecc": "on"}'""")
    prober = Prober(env.config(), environ=env.environ)
    with trio.fail_after(30):
        await prober.gather()
        script.unlink()
        script.symlink_to(env.root / "nowhere")
        dangling = await prober.gather()
        script.unlink()
        env.dropin("10-ecc", "exit 1", mode=0o644)
        disabled = await prober.gather()
    assert outcome(dangling, "probe.d/10-ecc").why.startswith("could not stat: ")
    assert dangling.result.unconfirmed == {"gpu0"}
    # Switched off by its operator is not failing: gpu0's labels clear.
    assert not disabled.result.unconfirmed
    assert labels_payload(disabled.result)["devices"]["gpu0"] == {}


async def test_unlistable_probe_dir_fails_the_dropins_that_worked(env: Env) -> None:
    env.dropin("10-ecc", """printf '{"gpu0.ecc": "on"}'""")
    link = env.root / "probe-link"
    link.symlink_to(env.probe_dir)
    prober = Prober(env.config(probe_dir=str(link)), environ=env.environ)
    with trio.fail_after(30):
        await prober.gather()
        link.unlink()
        link.symlink_to(env.root / "tools" / "cat")  # now a file: listing it fails
        second = await prober.gather()
    assert outcome(second, "probe.d/10-ecc").why.startswith("could not list ")
    assert second.result.unconfirmed == {"gpu0"}


async def test_a_dropin_that_cannot_be_executed(env: Env) -> None:
    path = env.probe_dir / "10-garbage"
    path.write_bytes(b"\x00\x01\x02 not a program")
    path.chmod(0o755)
    probe_pass = await one_pass(env, env.config())
    assert outcome(probe_pass, "probe.d/10-garbage").why.startswith("could not run: ")


async def test_missing_probe_dir_is_fine(env: Env) -> None:
    config = env.config(probe_dir=str(env.root / "absent"))
    probe_pass = await one_pass(env, config)
    assert [s.name for s in probe_pass.sources] == ["builtin"]


async def test_pass_budget_skips_what_it_cannot_start(env: Env) -> None:
    slow = env.root / "slow"
    env.dropin("10-slow", f'[ -e "{slow}" ] && sleep 30; echo "{{}}"')
    env.dropin("20-gpu0", """printf '{"gpu0.x": "1"}'""")
    env.dropin("30-last", "echo '{}'")
    prober = Prober(env.config(probe_timeout=0.4, probe_pass_budget=0.4), environ=env.environ)
    with trio.fail_after(30):
        first = await prober.gather()
        slow.touch()
        second = await prober.gather()
    assert all(s.ok for s in first.sources)
    whys = [outcome(second, f"probe.d/{n}").why for n in ("10-slow", "20-gpu0", "30-last")]
    assert whys[0].startswith(("timed out", "stopped when the pass budget"))
    assert whys[1:] == ["skipped for budget", "skipped for budget"]
    assert second.result.unconfirmed == {"gpu0"}


async def test_the_example_dropins(env: Env) -> None:
    for example in sorted(EXAMPLES.iterdir()):
        shutil.copy(example, env.probe_dir / example.name)
        (env.probe_dir / example.name).chmod(0o755)
    env.environ["RC_RACK_FILE"] = str(env.root / "rack")
    (env.root / "rack").write_text("  r12\n")
    probe_pass = await one_pass(env, env.config())
    assert [s.name for s in probe_pass.sources] == ["builtin", "probe.d/10-rack", "probe.d/20-cuda"]
    assert all(s.ok for s in probe_pass.sources), probe_pass.sources
    assert probe_pass.result.host["rack"] == "r12"
    (env.root / "rack").write_text("r 12\n")
    refused = await one_pass(env, env.config())
    assert "a rack name may use letters" in outcome(refused, "probe.d/10-rack").why


async def test_a_failing_host_scoped_source_loses_its_labels_not_freezes_them(env: Env) -> None:
    """What examples/probe.d/20-cuda's comment promises: on failure its host labels vanish."""
    flag = env.root / "broken"
    env.dropin(
        "20-cuda",
        f"""if [ -e {flag} ]; then echo driver wedged >&2; exit 1; fi
printf '{{"cuda_driver_version": "12.4"}}'""",
    )
    config = env.config()
    with trio.fail_after(30):
        prober = Prober(config, environ=env.environ)
        first = await prober.gather()
        flag.touch()
        second = await prober.gather()
    assert labels_payload(first.result)["host"]["cuda_driver_version"] == "12.4"
    payload = labels_payload(second.result)
    assert "cuda_driver_version" not in payload["host"]
    assert not outcome(second, "probe.d/20-cuda").ok
    # Nothing device-scoped depended on it: no device is unconfirmed by it.
    assert second.result.unconfirmed == set()
