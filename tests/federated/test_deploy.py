"""A real Flower deployment on 127.0.0.1: a SuperLink with TLS and SuperNode authentication,
two registered SuperNodes running rankwise's ClientApp, ``flwr run`` of rankwise's ServerApp
for 2 rounds, and a SuperNode without credentials that must be refused.

Bounded: every wait has a timeout and every process started here (and its children) is
terminated by pid at the end.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rankwise.federated.deploy import make_node_keys, make_tls, write_app, write_connection

from fed_helpers import toy_config, write_toy_data

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def adopted_helpers(parents: set[int]) -> list[int]:
    """Pids of Flower helpers started with ``--parent-pid P`` (P in ``parents``); they detach
    from their parent (ppid 1), so :func:`descendants` does not see them."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            for i, arg in enumerate(argv[:-1]):
                if arg == b"--parent-pid" and argv[i + 1].isdigit() and int(argv[i + 1]) in parents:
                    out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (not gone, not a zombie waiting to be reaped)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> list[int]:
    """Pids of every process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Processes:
    """Starts processes with logs in a folder; stops them and their children by pid."""

    def __init__(self, folder: Path, env: dict) -> None:
        self.folder, self.env, self.procs = folder, env, {}

    def start(self, name: str, args: list) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")
        p = subprocess.Popen([str(a) for a in args], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def wait_for(self, name: str, text: str, timeout: float) -> bool:
        end = time.time() + timeout
        while time.time() < end:
            if text in self.log(name):
                return True
            if self.procs[name].poll() is not None:
                return text in self.log(name)
            time.sleep(0.2)
        return False

    def stop_all(self) -> None:
        pids, reaped = [], {p.pid for p in self.procs.values() if p.returncode is not None}
        for p in self.procs.values():
            if p.returncode is None:  # not reaped yet: its pid is still its own (a reaped one may be reused)
                pids += descendants(p.pid) + [p.pid]
        pids += adopted_helpers(set(pids) | reaped)
        pids += [d for h in adopted_helpers(set(pids)) for d in descendants(h)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.time() + 3   # up to 3 s to exit on SIGTERM (a zombie counts as gone), then SIGKILL
        while time.time() < end and any(map(alive, pids)):
            time.sleep(0.1)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


@pytest.mark.integration
@pytest.mark.slow
def test_tls_deployment_two_rounds_and_unknown_node_refused(tmp_path):
    port = free_port()
    tls = make_tls(tmp_path / "tls")
    keys = {n: make_node_keys(tmp_path / "keys", n) for n in ("node0", "node1")}
    stranger_key = make_node_keys(tmp_path / "keys", "stranger")  # never registered
    home = tmp_path / "flwr-home"
    write_connection(home, "local-tls", f"127.0.0.1:{port}", tls["ca"])
    cfg = tmp_path / "run.yaml"
    raw = toy_config(write_toy_data(tmp_path / "toy.jsonl"), strategy="rolora", min_clients=2,
                     round_timeout=240)
    import yaml
    cfg.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    app = write_app(tmp_path / "app", cfg, out)
    env = dict(os.environ, FLWR_HOME=str(home), PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    procs = Processes(tmp_path, env)
    try:
        procs.start("superlink", [BIN / "flower-superlink", "--ssl-ca-certfile", tls["ca"],
                                  "--ssl-certfile", tls["cert"], "--ssl-keyfile", tls["key"],
                                  "--enable-supernode-auth", "--host", "127.0.0.1", "--port", port,
                                  "--disable-runtime-dependency-installation",
                                  "--database", tmp_path / "state.db"])
        assert procs.wait_for("superlink", "Uvicorn running on https://127.0.0.1", 120), procs.log("superlink")
        for name in keys:   # both at once: two CLI start-ups side by side, not one after the other
            procs.start(f"register-{name}", [BIN / "flwr", "supernode", "register", keys[name]["public"], "local-tls"])
        for name in keys:
            assert procs.procs[f"register-{name}"].wait(120) == 0, procs.log(f"register-{name}")
        common = ["--superlink", f"127.0.0.1:{port}", "--root-certificates", tls["ca"]]
        for i, name in enumerate(keys):
            procs.start(name, [BIN / "flower-supernode", *common, "--auth-supernode-private-key",
                               keys[name]["private"], "--port", free_port(),
                               "--node-config", f"partition-id={i} num-partitions=2"])
        procs.start("intruder", [BIN / "flower-supernode", *common, "--port", free_port(), "--max-retries", "2",
                                 "--node-config", "partition-id=0 num-partitions=2"])       # no key at all
        procs.start("stranger", [BIN / "flower-supernode", *common, "--auth-supernode-private-key",
                                 stranger_key["private"], "--port", free_port(), "--max-retries", "2",
                                 "--node-config", "partition-id=1 num-partitions=2"])       # unknown key
        run = subprocess.run([BIN / "flwr", "run", app, "local-tls", "--stream"], env=env, cwd=app,
                             capture_output=True, text=True, timeout=480)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        end = time.time() + 120
        while not (out / "metrics.json").exists() and time.time() < end:
            time.sleep(0.2)
        metrics = json.loads((out / "metrics.json").read_text())
        lines = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
        assert metrics["rounds"] == 2 and [e["round"] for e in lines] == [0, 1, 2]
        assert all(e["aggregated"] == 2 and not e["failed"] and not e["missing"] for e in lines[1:])
        link = procs.log("superlink")
        assert "[/v1/fleet/register-node][ApiError" in link          # the node without a key
        assert "No SuperNode found with the given public key" in link  # the unregistered key
        for name in ("intruder", "stranger"):
            assert "Connection attempt failed" in procs.log(name), procs.log(name)[-2000:]
        assert "-----BEGIN" not in procs.log("node0")  # keys are never logged by the nodes
    finally:
        procs.stop_all()
