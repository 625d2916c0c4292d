"""Real Flower processes on localhost for tests/flower/test_deployment.py.

A :class:`Cluster` is a ``flower-superlink`` over TLS (a private CA and a certificate for 127.0.0.1, made with
openssl for the test), ``flower-supernode`` processes with their ``partition-id``, and ``flwr run`` of the
example app (``examples/flower_app``) against that SuperLink, all in one temporary folder with its own
``FLWR_HOME``. Each SuperLink and SuperNode runs in a process group of its own, so that killing one (a crash) takes
its SuperExec and app processes with it; :meth:`Cluster.stop` kills every process the cluster started, by id.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flower_app"
BIN = Path(sys.executable).parent  # the environment's flower-superlink, flower-supernode, flwr, flower-superexec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_certificates(folder: Path) -> dict[str, Path]:
    """A private CA and the SuperLink's certificate for localhost / 127.0.0.1 (valid for 2 days)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert, san = (folder / n for n in ("ca.key", "ca.crt", "server.key", "server.csr",
                                                              "server.pem", "san.ext"))
    quiet = dict(check=True, capture_output=True)
    subprocess.run(["openssl", "genrsa", "-out", ca_key, "2048"], **quiet)
    subprocess.run(["openssl", "req", "-x509", "-new", "-key", ca_key, "-sha256", "-days", "2", "-subj",
                    "/CN=fedhet-test-ca", "-out", ca], **quiet)
    subprocess.run(["openssl", "genrsa", "-out", key, "2048"], **quiet)
    subprocess.run(["openssl", "req", "-new", "-key", key, "-subj", "/CN=superlink", "-out", csr], **quiet)
    san.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    subprocess.run(["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days",
                    "2", "-sha256", "-extfile", san, "-out", cert], **quiet)
    return {"ca": ca, "cert": cert, "key": key}


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """The ids of every process below ``pid``."""
    children, out, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """``sig`` to ``pid`` and every process below it (a crash of the process and what it started)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


@dataclass
class Node:
    partition: int
    process: subprocess.Popen
    log: Path

    def node_id(self, timeout: float = 120) -> int:
        """The node id the SuperLink gave this SuperNode (from its log, once it is connected)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"SuperNode ID: (\d+)", self.log.read_text(errors="replace"))
            if found:
                return int(found.group(1))
            if self.process.poll() is not None:
                raise RuntimeError(f"SuperNode {self.partition} exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"SuperNode {self.partition} did not connect: {self.log.read_text()[-2000:]}")

    def count(self, text: str) -> int:
        return self.log.read_text(errors="replace").count(text)


class Cluster:
    """A SuperLink over TLS and ``num_nodes`` SuperNodes (``partition-id`` 0 .. num_nodes-1) on localhost."""

    def __init__(self, folder: Path, certs: dict[str, Path], num_nodes: int) -> None:
        self.folder = folder
        self.certs = certs
        self.num_nodes = num_nodes
        self.port = free_port()
        self.home = folder / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\nroot-certificates = "{certs["ca"]}"\n'
        )
        self.env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_HOME": str(self.home),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "WANDB_MODE": "offline",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
        }
        self.superlink: subprocess.Popen | None = None
        self.nodes: list[Node] = []
        self.processes: list[subprocess.Popen] = []
        self._logs = 0

    def _spawn(self, args: list, log: Path, new_group: bool = True) -> subprocess.Popen:
        with open(log, "w") as out:
            process = subprocess.Popen([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                       cwd=self.folder, start_new_session=new_group)
        self.processes.append(process)
        return process

    def start(self) -> Cluster:
        c = self.certs
        self.superlink = self._spawn(
            [BIN / "flower-superlink", "--ssl-ca-certfile", c["ca"], "--ssl-certfile", c["cert"], "--ssl-keyfile",
             c["key"], "--disable-runtime-dependency-installation", "--port", self.port, "--database",
             self.folder / "superlink.db"],
            self.folder / "superlink.log",
        )
        deadline = time.monotonic() + 120
        while True:  # until the SuperLink listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            if self.superlink.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the SuperLink did not start: {self.log('superlink')[-3000:]}")
            time.sleep(0.2)
        for partition in range(self.num_nodes):
            self.start_node(partition)
        for node in self.nodes:
            node.node_id()
        return self

    def start_node(self, partition: int) -> Node:
        """A SuperNode with ``partition-id=partition`` (over TLS; no persistent key, so a new node id each time)."""
        self._logs += 1
        log = self.folder / f"supernode-{partition}-{self._logs}.log"
        process = self._spawn(
            [BIN / "flower-supernode", "--superlink", f"127.0.0.1:{self.port}", "--root-certificates",
             self.certs["ca"], "--node-config", f"partition-id={partition} num-partitions={self.num_nodes}",
             "--port", free_port()],
            log,
        )
        node = Node(partition, process, log)
        self.nodes.append(node)
        return node

    def kill_node(self, node: Node) -> None:
        """SIGKILL the SuperNode and everything it started (its SuperExec, a ClientApp in the middle of training)."""
        kill_tree(node.process.pid)
        node.process.wait(timeout=30)

    def serverapps(self) -> list[int]:
        """The ids of the running ServerApp processes (``flwr-serverapp``, started by the SuperLink's SuperExec)."""
        return [p for p in descendants(self.superlink.pid) if "flwr-serverapp" in cmdline(p)]

    def run(self, overrides: dict, name: str) -> subprocess.Popen:
        """``flwr run examples/flower_app local --stream`` with ``overrides`` of the run config (not waited)."""
        items = " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}" for k, v in overrides.items())
        return self._spawn([BIN / "flwr", "run", EXAMPLE, "local", "--stream", "--run-config", items],
                           self.folder / f"{name}.log", new_group=False)

    def log(self, name: str) -> str:
        path = self.folder / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def diagnostics(self, run: str) -> str:
        tails = [f"--- {run}.log\n{self.log(run)[-4000:]}", f"--- superlink.log\n{self.log('superlink')[-3000:]}"]
        for node in self.nodes:
            tails.append(f"--- {node.log.name}\n{node.log.read_text(errors='replace')[-1500:]}")
        return "\n".join(tails)

    def stop(self) -> None:
        """Kill every process this cluster started and everything below them (by id), then reap them."""
        pids = []
        for process in self.processes:  # the whole trees first: a parent that exits orphans its children
            if process.poll() is None:
                pids += [process.pid, *descendants(process.pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while sig == signal.SIGTERM and time.monotonic() < deadline:
                if all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in pids):
                    break
                time.sleep(0.2)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"
