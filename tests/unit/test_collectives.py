"""One collectives model (agents/probe/collectives.py) for the probe, its C fast path, the simulator and the
efficiency detector: the ring traffic of every collective kind the probe wraps, the nccl-tests bus and size
factors it is built from, and the device/link peaks, with no second copy anywhere."""
import shutil
import tempfile

import numpy as np
import pytest

from stepwatch.agents import probe as P
from stepwatch.agents.probe import collectives as C
from stepwatch.agents.probe import decode, eventlog
from stepwatch.wire import datagram
from stepwatch.detectors import busbw, commagg, commbw, mfu
from stepwatch.devtools import simtables

pytestmark = pytest.mark.unit

# bytes on the wire per payload byte for n ranks (ring algorithms; all_gather's payload is the rank's shard)
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_reduce_coalesced": lambda n: 2 * (n - 1) / n,
        "all_gather": lambda n: n - 1, "all_gather_into_tensor": lambda n: n - 1,
        "all_gather_single": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
        "reduce_scatter_tensor": lambda n: (n - 1) / n, "reduce_scatter_single": lambda n: (n - 1) / n,
        "all_to_all": lambda n: (n - 1) / n, "all_to_all_single": lambda n: (n - 1) / n,
        "barrier": lambda n: 0.0}
NO_PAYLOAD = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"}


@pytest.mark.parametrize("n", [1, 2, 8, 1024])
def test_traffic_of_every_kind_is_size_x_bus_factor(n):
    for op in C.COLLECTIVES:
        want = 0.0 if op in NO_PAYLOAD else RING.get(op, lambda n: 1.0)(n)
        assert C.traffic_factor(op, n) == pytest.approx(want), op
        if op not in NO_PAYLOAD and op != "barrier":
            assert C.traffic_factor(op, n) == pytest.approx(C.size_factor(op, n) * C.bus_factor(op, n)), op
        # the detector's vectorised factors are the same function, element by element
        assert busbw.bus_factor(op, np.array([n, n]))[1] == pytest.approx(C.bus_factor(op, float(n))), op
        assert busbw.size_factor(op, np.array([n]))[0] == pytest.approx(C.size_factor(op, float(n))), op
    assert C.transfer_ms("all_reduce", 10**9, n, 25.0) == pytest.approx(2 * (n - 1) / n * 1e9 / 25e9 * 1e3)


def test_detector_and_simulator_use_the_one_module():
    # the detectors' and the simulator's tables and link model are the probe's (agents/probe/collectives.py)
    assert busbw.LINK_GBPS is C.LINK_GBPS and busbw.SATURATE_BYTES is C.SATURATE_BYTES and busbw.link_type is C.link_type
    assert commagg.LINK_GBPS is C.LINK_GBPS and commagg.SATURATE_BYTES is C.SATURATE_BYTES
    assert commbw.device_family is C.device_family and mfu.peak_tflops is C.peak_tflops
    assert simtables.bus_factor is C.bus_factor and simtables.LINK_GBPS is C.LINK_GBPS
    assert C.LINK_GBPS["loopback"] == C.DEFAULT_COMM_GBPS       # the probe's default model is gloo on one host


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="swc-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_c_fast_path_and_python_split_every_kind_alike(sockdir):
    """The C hot path (``_probefast.pack_step``) takes each slot's traffic factor from
    :func:`collectives.traffic_factor`; for every collective kind, one call split by the bandwidth model packs
    the same bytes in C and in Python, and the wait is the call's time less :func:`collectives.transfer_ms`."""
    assert eventlog._fast is not None, "the C hot path was not built (README: a C compiler and the Python headers)"
    kinds = list(C.COLLECTIVES)
    n, nbytes, dt = 8, 1 << 24, 9_000_000
    for lo in range(0, len(kinds), datagram.MAX_COMM):
        p = P.Probe()
        try:
            p.init(job="coll", rank=1, world_size=n, socket_dir=sockdir, auto=False, comm_gbps=10)
            grp = p.names.intern("dp")
            calls, want = [], {}
            for op in kinds[lo:lo + datagram.MAX_COMM]:
                oid = p.names.intern(op)
                s = p.names.comm_slot_for(op, oid, grp, n)
                calls.append((s, 1, nbytes, dt, None))
                want[oid] = dt - min(dt, C.transfer_ms(op, nbytes, n, 10.0) * 1e6)
            args = (7, 10**18, 10**18 + 50_000_000, 50_000_000, 0, 0, 3, 32, -1)
            p.transport.buf[:] = bytes(len(p.transport.buf))
            end_py = p.fold._pack_py(0, *args, list(calls), 0, -1.0, -1.0)
            py = bytes(p.transport.buf[:end_py])
            p.transport.buf[:] = bytes(len(p.transport.buf))
            end_c = eventlog._fast.pack_step(p.transport.buf, 0, p.instance, p.rank, *args[:4], p.fold._ph_ns[0], -1, *args[4:],
                                      p.dropped, p.fold._ph_touched, p.fold._ph_ns, p.names.phase_ids, list(calls), p.names.c_traffic,
                                      p.fold._ns_per_byte, p.names.comm_key, None, -1.0, -1.0)
            assert end_c == end_py and bytes(p.transport.buf[:end_c]) == py
            (_, _, _, (_, _, comm, _)), = decode(py)
            assert len(comm) == len(want)
            for c in comm:
                assert c[5] == pytest.approx(want[c[0]], rel=1e-9, abs=1.0), c
        finally:
            p.shutdown()
