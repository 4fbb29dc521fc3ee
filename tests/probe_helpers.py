"""Shared by the probe's tests (tests/*/test_probe_*.py, test_probe_package.py, test_inflight.py): a fake
agent (a bound Unix datagram socket), the ``rx``, ``probe`` (the C and the Python hot path) and ``gloo``
fixtures, and ``split`` (decoded datagrams -> rows)."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from stepwatch.agents.probe import Probe, decode, eventlog
from stepwatch.wire import datagram


class Rx:
    """A fake agent: a bound datagram socket. ``listen=True`` drains it on a thread (as the agent does:
    the kernel queues only ``net.unix.max_dgram_qlen`` datagrams); otherwise it is read on demand."""

    def __init__(self, d: str, listen: bool = True):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(os.path.join(d, datagram.SOCKET_NAME))
        self.got: list[bytes] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.th = None
        if listen:
            self.sock.settimeout(0.05)
            self.th = threading.Thread(target=self._loop, daemon=True)
            self.th.start()
        else:
            self.sock.setblocking(False)

    def _loop(self):
        while not self.stop.is_set():
            try:
                data = self.sock.recv(65536)
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            with self.lock:
                self.got.append(data)

    def read(self) -> list[tuple]:
        if self.th is None:
            while True:
                try:
                    self.got.append(self.sock.recv(65536))
                except BlockingIOError:
                    break
        else:
            time.sleep(0.15)
        with self.lock:
            out, self.got = self.got, []
        return [f for b in out for f in decode(b)]

    def close(self):
        self.stop.set()
        if self.th is not None:
            self.th.join(2)
        self.sock.close()


@pytest.fixture
def rx(sockdir):
    r = Rx(sockdir)
    yield r
    r.close()


@pytest.fixture(params=["c", "python"])
def probe(request, monkeypatch):
    """A probe on each hot path: the C one (``_probefast``, built by ``pip install``) and the pure-Python
    fallback; both must produce the same records."""
    if request.param == "c":
        assert eventlog._fast is not None, ("the C hot path (stepwatch.agents._probefast) was not built: "
                                     "pip install needs a C compiler and the Python headers (README)")
    else:
        monkeypatch.setattr(eventlog, "_fast", None)     # (the hot path new probes take)
    p = Probe()
    yield p
    p.shutdown()


def split(msgs):
    """(last hello, {name id: name}, [step rows as dicts], [comm], [gc]) of decoded datagrams, durations
    converted from the datagram's ns to ms."""
    hello, steps, comm, gcs = None, [], [], []
    for typ, inst, rank, body in msgs:
        if typ == datagram.T_HELLO:
            hello = body
            continue
        if typ != datagram.T_BATCH:                 # an in-flight state or the rank's goodbye
            continue
        st, phases, cm, gg = body
        if st is not None:
            d = dict(zip(datagram.STEP_FIELDS, st))
            for k in ("step", "data", "compute", "comm", "comm_wait", "gc"):
                d[k + "_ms"] = d.pop(k + "_ns") / 1e6           # the datagram carries ns
            for k in ("cpu", "cpu_wait"):                       # -1: not measured
                v = d.pop(k + "_ns")
                d[k + "_ms"] = v / 1e6 if v >= 0 else None
            d["phases"] = [(i, ns / 1e6) for i, ns in phases]
            d["rank"] = rank
            steps.append(d)
            comm += [(st[0],) + c[:4] + (c[4] / 1e6, c[5] / 1e6) for c in cm]
        gcs += [g[:1] + (g[1] / 1e6,) + g[2:] for g in gg]
    names = {int(k): v for k, v in (hello or {}).get("names", {}).items()}
    return hello, names, steps, comm, gcs


@pytest.fixture
def gloo(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()
