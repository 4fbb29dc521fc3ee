"""The node agent's memory: its whole path (datagrams -> columns -> Arrow IPC for Kafka) runs without
``pyarrow.compute`` and without the decoder half of the codec (``stepwatch.schema``), which cost ~9 MB of
its RSS (docs/agents.md, agent cost). Checked in a fresh interpreter on a real probe's datagrams."""
from __future__ import annotations

import subprocess
import sys

CODE = r"""
import os, socket, sys
from stepwatch.agents import agent, control, shipper, wirecols         # what `stepwatch agent` imports
from stepwatch.agents.probe import Probe, SOCKET_NAME, T_HELLO, decode
from stepwatch import kafkaio
from stepwatch import wireenc

d = sys.argv[1]
rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
rx.bind(os.path.join(d, SOCKET_NAME))
rx.setblocking(False)
p = Probe().init(job="fp", rank=0, world_size=1, socket_dir=d, auto=False, flush_ms=100000)
ar, grp = p._intern("all_reduce"), p._intern("dp")
for i in range(12):
    with p.step(samples=8):
        if i % 3 == 0:
            with p.phase("forward"):
                pass
        p._record_comm(ar, grp, 1 << 20, 2_000_000, 500_000.0)
p.flush()
grams = []
while True:
    try:
        grams.append(rx.recv(65536))
    except BlockingIOError:
        break
p.shutdown()
idents, bc = {}, wirecols.BatchColumns()
for g in grams:
    typ, inst, frames = wirecols.scan(g)
    if typ == T_HELLO:
        idents[inst] = agent.identity_from_hello(decode(g)[0][3], "n1", None)
    else:
        bc.add(idents[inst], g, frames)
(job, (steps, comm, gcs)), = bc.take().items()
assert steps.num_rows == 12 and comm.num_rows == 12, (steps.num_rows, comm.num_rows)
assert steps.column("phases").null_count == 8
blob = wireenc.encode_arrow(steps) + wireenc.encode_arrow(comm)
print(sorted(m for m in ("pyarrow.compute", "stepwatch.schema") if m in sys.modules))
"""


def test_the_agents_path_loads_neither_pyarrow_compute_nor_the_decoder(sockdir):
    r = subprocess.run([sys.executable, "-c", CODE, sockdir], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]"], r.stdout
