"""A real network link between training ranks on one machine, whose bandwidth a run can cut mid-way.

This kernel has no ``netem``, but network namespaces, veth pairs and the ``tbf`` qdisc work as root. A
:class:`SlowLink` makes a namespace ``swl<id>`` joined to this one by a veth pair on the project's own test
addresses (RFC 2544's benchmarking block, 198.18.0.0/15: never routed, never leaves this machine), a token
bucket on both ends of the pair (each direction), and :meth:`SlowLink.rate` changes its rate with
``tc qdisc change`` while traffic flows. The training script (:mod:`stepwatch.devtools.ddp_train`,
``SW_NETNS``) puts one rank in the namespace (``setns`` in the forked rank before it opens a socket), so
its collectives with the others cross the link; everything else (the probe's unix socket to the agent)
is unaffected.
"""
from __future__ import annotations

import os
import subprocess

#: the addresses of the link: this side, the namespace's side (a /30 of 198.18.0.0/15)
HOST_ADDR, NS_ADDR = "198.18.0.1", "198.18.0.2"


def _run(*cmd: str) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")


def available() -> str | None:
    """None where a :class:`SlowLink` can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth and tc)"
    for tool in ("ip", "tc"):
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin")):
            return f"no '{tool}' (iproute2)"
    return None


class SlowLink:
    """See the module docs. ``with SlowLink("1gbit") as link: ...; link.rate("100mbit")``."""

    def __init__(self, rate: str = "1gbit", tag: str | None = None):
        tag = tag or str(os.getpid() % 100000)
        self.ns, self.host_if, self.ns_if = f"swl{tag}", f"swh{tag}", f"swn{tag}"
        self.host_addr, self.ns_addr = HOST_ADDR, NS_ADDR
        self._rate = rate
        self._up = False

    @staticmethod
    def _tbf(rate: str) -> list[str]:
        # the bucket holds at least a timer tick's worth of the rate (250 Hz: rate / 250), or tbf cannot
        # reach the rate; packets wait up to 200 ms in it before they are dropped
        bits = _bits(rate)
        burst = max(64 * 1024, int(bits / 8 / 250) * 2)
        return ["tbf", "rate", rate, "burst", str(burst), "latency", "200ms"]

    def __enter__(self) -> "SlowLink":
        why = available()
        if why:
            raise RuntimeError(f"slow link: {why}")
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)      # a leftover of a killed run
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        _run("ip", "netns", "add", self.ns)
        self._up = True
        try:
            _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _run("ip", "link", "set", self.ns_if, "netns", self.ns)
            _run("ip", "addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            _run("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if)
            _run("ip", "netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up")
            _run("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
            _run("tc", "qdisc", "add", "dev", self.host_if, "root", *self._tbf(self._rate))
            _run("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.ns_if, "root",
                 *self._tbf(self._rate))
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def rate(self, rate: str) -> None:
        """Change the link's rate in both directions now (traffic in flight stays queued)."""
        _run("tc", "qdisc", "change", "dev", self.host_if, "root", *self._tbf(rate))
        _run("ip", "netns", "exec", self.ns, "tc", "qdisc", "change", "dev", self.ns_if, "root", *self._tbf(rate))
        self._rate = rate

    def env(self, ranks_inside: tuple[int, ...] = (1,)) -> dict:
        """The training script's settings (``ddp_train.py``) for ranks ``ranks_inside`` in the namespace."""
        return {"SW_NETNS": self.ns, "SW_NETNS_RANKS": ",".join(map(str, ranks_inside)),
                "SW_MASTER_ADDR": self.host_addr, "SW_IFNAMES": f"{self.host_if},{self.ns_if}"}

    def __exit__(self, *exc) -> None:
        if self._up:
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)        # takes the veth pair
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
            self._up = False


def _bits(rate: str) -> float:
    r = rate.strip().lower()
    for suf, mul in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if r.endswith(suf):
            return float(r[: -len(suf)]) * mul
    raise ValueError(f"rate: {rate!r} is not <number>gbit|mbit|kbit|bit")


def enter_netns(name: str) -> None:
    """Move the calling (single-threaded, freshly forked) process into network namespace ``name``
    (``setns(2)``; Python 3.11 has no ``os.setns``)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:                    # CLONE_NEWNET
            e = ctypes.get_errno()
            raise OSError(e, f"setns({name}): {os.strerror(e)}")
    finally:
        os.close(fd)
