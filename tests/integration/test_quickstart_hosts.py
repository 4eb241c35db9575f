"""README's "On several machines" commands, run as written on three network-namespace hosts.

Each host is a network namespace of its own on one bridge (tests/netns.py), and for the nodes also a UTS
namespace (its own host name) and a mount namespace in which the README's checkpoint path is a directory of
the test's: one directory for both nodes (a shared filesystem), or one per node (a local path on separate
machines). The README's addresses are replaced by the hosts' and ``--steps 20`` shortens the run (a
documented shrink); nothing else changes. Asserted: with shared storage the job trains at world size 2 and
both nodes write to one checkpoint; with a directory per node every node is refused before its first step,
with one line naming the URL and both nodes. Skipped, with the reason, where namespaces are refused.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.netns import Topology, environ_without_proxies, namespaces_refused

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SECTION = "### On several machines"
#: The README's hosts → the namespaces standing in for them.
HOSTS = {"10.0.0.1": "etcd", "10.0.0.11": "host-a", "10.0.0.12": "host-b"}
SHRINK = ["--steps", "20"]


def readme_commands() -> dict[str, str]:
    """README host → the command the section runs there (from its ``# on HOST:`` comments)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index(SECTION) :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block under {SECTION!r} in README.md"
    out: dict[str, str] = {}
    host = None
    for line in block.group(1).splitlines():
        m = re.match(r"^# on ([\d.]+):", line)
        if m:
            host = m.group(1)
        elif line.strip() and host is not None:
            out[host] = line.strip()
    assert set(out) == set(HOSTS), out
    return out


@pytest.fixture(scope="module")
def hosts_ok() -> None:
    why = namespaces_refused()
    if why is None and shutil.which("unshare") is None:
        why = "the unshare command (util-linux) is not installed"
    if why is None:
        probe = subprocess.run(
            ["unshare", "--mount", "--uts", "--propagation", "private", "mount", "-t", "tmpfs", "t", "/mnt"],
            capture_output=True,
            text=True,
        )
        why = f"mount and UTS namespaces are refused: {probe.stderr.strip()}" if probe.returncode else None
    if why:
        pytest.skip(f"the quickstart across hosts needs namespaces: {why}")


def argv_on(net: Topology, readme_host: str, command: str, checkpoints: Path | None) -> list[str]:
    """``command`` run on the namespace standing in for ``readme_host``; a node also gets its own host name
    and the README's checkpoint path mounted from ``checkpoints``."""
    for address, name in HOSTS.items():
        command = re.sub(rf"\b{re.escape(address)}\b", net.addr[name], command)
    argv = shlex.split(command)
    assert argv[0] == "elastic-train", argv
    argv[0] = str(VENV_BIN / "elastic-train")
    host = HOSTS[readme_host]
    if checkpoints is None:
        return [*net.run_in(host), *argv]
    path = argv[argv.index("--checkpoint") + 1]
    setup = (
        f"hostname {host} && mount -t tmpfs quickstart /mnt && mkdir -p {shlex.quote(path)} && "
        f'mount --bind {shlex.quote(str(checkpoints))} {shlex.quote(path)} && exec "$@"'
    )
    assert path.startswith("/mnt/"), path
    return [
        *net.run_in(host), "unshare", "--mount", "--uts", "--propagation", "private",
        "sh", "-c", setup, "sh", *argv, *SHRINK,
    ]  # fmt: skip


def run_hosts(net: Topology, reaper, tmp_path: Path, dirs: dict[str, Path]) -> dict[str, tuple[int, str]]:
    """Start the README's etcd and both nodes; every node's exit status and output."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    commands = readme_commands()
    env = dict(environ_without_proxies(), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    etcd_log = tmp_path / "etcd.log"
    reaper.popen(
        argv_on(net, "10.0.0.1", commands["10.0.0.1"], None),
        env=env, stdout=open(etcd_log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while "serving on" not in etcd_log.read_text(errors="replace"):
        assert time.monotonic() < deadline, etcd_log.read_text(errors="replace")
        time.sleep(0.1)
    nodes = {}
    for readme_host, name in HOSTS.items():
        if name == "etcd":
            continue
        log = tmp_path / f"{name}.log"
        nodes[name] = (
            reaper.popen(
                argv_on(net, readme_host, commands[readme_host], dirs[name]),
                env=env, cwd=str(ROOT), stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            ),
            log,
        )  # fmt: skip
    out = {}
    for name, (proc, log) in nodes.items():
        code = proc.wait(timeout=180)
        out[name] = (code, log.read_text(errors="replace"))
    return out


def test_the_quickstart_trains_across_hosts_and_refuses_storage_they_do_not_share(
    hosts_ok, reaper, tmp_path: Path
) -> None:
    etcd_text = readme_commands()["10.0.0.1"]
    assert "--host 0.0.0.0" in etcd_text
    shared = tmp_path / "shared"
    shared.mkdir()
    with Topology(list(dict.fromkeys(HOSTS.values()))) as net:
        try:
            ran = run_hosts(net, reaper, tmp_path / "shared-run", {"host-a": shared, "host-b": shared})
            reaper.reap()
            for name, (code, text) in ran.items():
                assert code == 0, f"{name} exited {code}:\n{text[-3000:]}"
            manifests = sorted((shared / "job-42").glob("step-00000020*/manifest.json"))
            assert manifests, sorted(p.name for p in (shared / "job-42").iterdir())
            assert json.loads(manifests[-1].read_text())["world_size"] == 2

            (tmp_path / "a").mkdir()
            (tmp_path / "b").mkdir()
            ran = run_hosts(
                net, reaper, tmp_path / "local-run", {"host-a": tmp_path / "a", "host-b": tmp_path / "b"}
            )
        finally:
            reaper.reap()
    etcd_advice = (tmp_path / "shared-run" / "etcd.log").read_text()
    assert "without authentication or TLS" in etcd_advice
    for name, (code, text) in ran.items():
        assert code == 2, f"{name} exited {code}:\n{text[-3000:]}"
        line = next(ln for ln in text.splitlines() if ln.startswith("elastic-train: error: "))
        assert "checkpoint.url /mnt/shared/checkpoints is not shared between the nodes" in line, line
        assert "host-a cannot read host-b's" in line and "host-b cannot read host-a's" in line, line
    for d in ("a", "b"):
        assert not list((tmp_path / d).glob("*/step-*")), "a step was checkpointed before the refusal"
