"""Host metrics of the node agent: one small plug-in per input, a runner giving each one timing and
success metrics (Telegraf style).

Every plug-in reads its source in :meth:`Plugin.gather` and leaves the arithmetic and the parsing of
tool output to pure functions of strings, numbers and dicts (``parse_*``, ``cpu_percent``,
``top_procs``, ``rate``), which the tests exercise directly. A plug-in whose source does not exist on
this machine (no ``/sys/class/infiniband``, no ``npu-smi``, no NVIDIA driver) raises :class:`Absent`
from :meth:`Plugin.setup`; the runner logs that once and leaves it alone, so an absent tool is a line
in the log, never an error per second.

The fields a plug-in returns are columns of the ``host/1`` row (docs/tables.md, ``host``): ``cpu_util, cpu_iowait,
cpu_steal`` (percent of all CPUs), ``load1``, ``mem_used, mem_available`` (bytes),
``disk_read_bps, disk_write_bps, net_rx_bps, net_tx_bps`` (bytes/s), ``rdma_retrans`` (counter delta
over the sample), ``top_procs`` (list of ``{pid, name, cpu_pct}``, cpu_pct in percent of one core)
and ``accel`` (list of ``{index, util, mem_used, temp_c, power_w, clock_mhz}``).

In a container the node's ``/proc`` and ``/sys`` are mounted elsewhere: ``$HOST_PROC`` and
``$HOST_SYS`` (set by the Helm chart to ``/host/proc`` and ``/host/sys``) point every plug-in there.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from typing import Callable

log = logging.getLogger("stepwatch.agent.host")


def host_proc() -> str:
    """The host's procfs: ``$HOST_PROC`` (an agent in a container sees the node's ``/proc`` mounted
    there, e.g. ``/host/proc`` in the Helm chart), else ``/proc``."""
    return os.environ.get("HOST_PROC") or "/proc"


def host_sys() -> str:
    """The host's sysfs: ``$HOST_SYS`` (e.g. ``/host/sys``), else ``/sys``."""
    return os.environ.get("HOST_SYS") or "/sys"


def _psutil():
    """psutil reading the host's procfs (``PROCFS_PATH`` is psutil's documented knob for this)."""
    import psutil
    p = host_proc()
    if getattr(psutil, "PROCFS_PATH", p) != p:
        if not os.path.isfile(os.path.join(p, "stat")):
            raise Absent(f"HOST_PROC={p} is not a procfs (no {p}/stat)")
        psutil.PROCFS_PATH = p
    return psutil


class Absent(RuntimeError):
    """The plug-in's source is not present on this machine."""


# ---------------------------------------------------------------------------- pure functions

def cpu_percent(prev, cur) -> tuple[float, float, float]:
    """(util, iowait, steal) in percent of all CPUs between two ``psutil.cpu_times()`` samples (or any
    objects with ``user, nice, system, idle`` and optional ``iowait, irq, softirq, steal``).

    util counts everything but idle and iowait; guest time is already inside user/nice (as psutil and
    the kernel account it) and is not added again."""
    fields = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    d = {f: max(0.0, getattr(cur, f, 0.0) - getattr(prev, f, 0.0)) for f in fields}
    total = sum(d.values())
    if total <= 0:
        return 0.0, 0.0, 0.0
    util = 100.0 * (total - d["idle"] - d["iowait"]) / total
    return util, 100.0 * d["iowait"] / total, 100.0 * d["steal"] / total


def rate(prev: float | None, cur: float | None, dt: float) -> float | None:
    """Per-second rate of a monotonic counter; None without a previous sample, on a reset or dt <= 0."""
    if prev is None or cur is None or dt <= 0 or cur < prev:
        return None
    return (cur - prev) / dt


def parse_pid_stat(data: bytes | str) -> tuple[int, bytes, int]:
    """``/proc/<pid>/stat`` -> (pid, comm as bytes, utime + stime in clock ticks). The command name
    may hold spaces and parentheses: it is everything between the first '(' and the last ')'. The
    name stays bytes: only the top few are ever decoded."""
    if isinstance(data, str):
        data = data.encode()
    lp, rp = data.index(b"("), data.rindex(b")")
    rest = data[rp + 2:].split(None, 14)
    # rest[0] is field 3 (state); utime and stime are fields 14 and 15
    return int(data[:lp]), data[lp + 1:rp], int(rest[11]) + int(rest[12])


def top_procs(prev: dict[int, int], cur: dict[int, tuple[str | bytes, int]], dt: float, hz: float,
              n: int = 5) -> list[dict]:
    """The ``n`` processes that used most CPU between two scans: ``{pid, name, cpu_pct}`` with cpu_pct
    in percent of one core (as ``top`` shows it). Processes new in ``cur`` are left out (no baseline),
    and so is a pid whose counter went down (the pid was reused)."""
    if dt <= 0 or hz <= 0:
        return []
    out = []
    for pid, (name, ticks) in cur.items():
        p = prev.get(pid)
        if p is None or ticks < p:
            continue
        d = ticks - p
        if d > 0:
            out.append((d, pid, name))
    out.sort(reverse=True)
    return [{"pid": pid, "name": name.decode("utf-8", "replace") if isinstance(name, bytes) else name,
             "cpu_pct": round(100.0 * d / hz / dt, 2)} for d, pid, name in out[:n]]


#: hw_counters of RDMA NICs (mlx5 names) that count retransmissions or the events that trigger them.
RDMA_RETRANS_COUNTERS = ("local_ack_timeout_err", "packet_seq_err", "out_of_sequence", "implied_nak_seq_err",
                         "rnr_nak_retry_err", "roce_adp_retrans")


def rdma_retrans_total(counters: dict[str, int]) -> int:
    """Sum of the retransmission counters present in one port's ``hw_counters`` (name -> value)."""
    return sum(int(v) for k, v in counters.items() if k in RDMA_RETRANS_COUNTERS)


def _num(s: str) -> float | None:
    s = s.strip()
    try:
        return float(s)
    except ValueError:
        return None


_PAIR = re.compile(r"(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)")


def parse_npu_smi_info(text: str) -> list[dict]:
    """Accelerators from ``npu-smi info`` (Ascend). Each NPU is a pair of table rows::

        | 0     910B3               | OK            | 101.8       43                0    / 0             |
        | 0                         | 0000:C1:00.0  | 0           0    / 0          3318 / 65536         |

    the first with NPU id, name, health, power (W), temperature (C); the second with chip id, bus id,
    AICore utilisation (%), memory used / total (MB) and, on chips with HBM, HBM used / total (MB).
    ``mem_used`` is HBM used when the table has an HBM column, else memory used (bytes). The process
    table that may follow ends the parse. Clock is not in this table (null)."""
    out = []
    has_hbm = "HBM-Usage" in text
    pending = None
    for line in text.splitlines():
        if "Process id" in line or "Process name" in line:
            break
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3:
            continue
        first = cells[0].split()
        if not first or not first[0].isdigit():
            continue
        if pending is None:
            if len(first) < 2:                  # an NPU row has the id and a name
                continue
            vals = cells[2].split()
            pending = {"index": int(first[0]), "power_w": _num(vals[0]) if vals else None,
                       "temp_c": _num(vals[1]) if len(vals) > 1 else None}
        else:
            vals = cells[2].split()
            pairs = _PAIR.findall(cells[2])
            used = None
            if pairs:
                used = float(pairs[-1][0]) if has_hbm or len(pairs) == 1 else float(pairs[0][0])
            out.append({"index": pending["index"], "util": _num(vals[0]) if vals else None,
                        "mem_used": int(used * 1024 * 1024) if used is not None else None,
                        "temp_c": pending["temp_c"], "power_w": pending["power_w"], "clock_mhz": None})
            pending = None
    return out


NVIDIA_SMI_QUERY = "index,utilization.gpu,memory.used,temperature.gpu,power.draw,clocks.sm"


def parse_nvidia_smi_csv(text: str) -> list[dict]:
    """Accelerators from ``nvidia-smi --query-gpu=index,utilization.gpu,memory.used,temperature.gpu,
    power.draw,clocks.sm --format=csv,noheader,nounits`` (memory in MiB; ``[N/A]`` becomes null)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6 or not parts[0].isdigit():
            continue
        mem = _num(parts[2])
        out.append({"index": int(parts[0]), "util": _num(parts[1]),
                    "mem_used": int(mem * 1024 * 1024) if mem is not None else None,
                    "temp_c": _num(parts[3]), "power_w": _num(parts[4]), "clock_mhz": _num(parts[5])})
    return out


# ---------------------------------------------------------------------------- plug-ins

class Plugin:
    """One input. ``setup`` raises Absent when the source is missing; ``gather(now)`` returns host-row
    fields (a dict, possibly empty). ``interval_s`` > 0 makes the runner call it at most that often
    and repeat its last fields in between (for inputs that cost a process spawn)."""

    name = "plugin"
    interval_s = 0.0

    def setup(self) -> None:
        pass

    def gather(self, now: float) -> dict:
        raise NotImplementedError


class CpuPlugin(Plugin):
    name = "cpu"

    def setup(self) -> None:
        self.psutil = psutil = _psutil()
        self.prev = psutil.cpu_times()

    def gather(self, now: float) -> dict:
        cur = self.psutil.cpu_times()
        util, iowait, steal = cpu_percent(self.prev, cur)
        self.prev = cur
        return {"cpu_util": util, "cpu_iowait": iowait, "cpu_steal": steal}


class LoadPlugin(Plugin):
    name = "load"

    def setup(self) -> None:
        if not hasattr(os, "getloadavg"):
            raise Absent("os.getloadavg is not available")

    def gather(self, now: float) -> dict:
        return {"load1": os.getloadavg()[0]}


class MemPlugin(Plugin):
    name = "mem"

    def setup(self) -> None:
        self.psutil = psutil = _psutil()

    def gather(self, now: float) -> dict:
        vm = self.psutil.virtual_memory()
        return {"mem_used": int(vm.used), "mem_available": int(vm.available)}


class _RatePlugin(Plugin):
    """Rates of two monotonic counters read by ``read() -> (a, b)``."""

    keys: tuple[str, str] = ("", "")

    def setup(self) -> None:
        self.psutil = psutil = _psutil()
        self.prev = self.read()
        self.t_prev = time.monotonic()

    def read(self) -> tuple[float, float] | None:
        raise NotImplementedError

    def gather(self, now: float) -> dict:
        cur, t = self.read(), time.monotonic()
        dt = t - self.t_prev
        prev, self.prev, self.t_prev = self.prev, cur, t
        if cur is None or prev is None:
            return {}
        return {self.keys[0]: rate(prev[0], cur[0], dt), self.keys[1]: rate(prev[1], cur[1], dt)}


class DiskPlugin(_RatePlugin):
    name = "disk"
    keys = ("disk_read_bps", "disk_write_bps")

    def read(self):
        c = self.psutil.disk_io_counters(perdisk=False)
        return None if c is None else (c.read_bytes, c.write_bytes)


class NetPlugin(_RatePlugin):
    """All NICs but loopback (RDMA traffic bypasses these counters; see the rdma plug-in)."""

    name = "net"
    keys = ("net_rx_bps", "net_tx_bps")

    def read(self):
        per = self.psutil.net_io_counters(pernic=True) or {}
        rx = sum(c.bytes_recv for n, c in per.items() if n != "lo")
        tx = sum(c.bytes_sent for n, c in per.items() if n != "lo")
        return rx, tx


class TopProcsPlugin(Plugin):
    """Top 5 processes by CPU from ``/proc/<pid>/stat`` (one read per process)."""

    name = "procs"

    def __init__(self, proc: str | None = None, n: int = 5):
        self.proc, self.n = proc or host_proc(), n

    def setup(self) -> None:
        if not os.path.isdir(os.path.join(self.proc, "self")):
            raise Absent(f"{self.proc} is not a procfs")
        self.hz = float(os.sysconf("SC_CLK_TCK"))
        self.prev = {pid: t for pid, (_, t) in self.scan().items()}
        self.t_prev = time.monotonic()

    def scan(self) -> dict[int, tuple[bytes, int]]:
        """pid -> (comm, CPU ticks) of every process: one open/read/close per process, relative to an
        open ``/proc`` (about 18 µs per process here, half of what ``open()`` costs)."""
        out = {}
        dfd = os.open(self.proc, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for e in os.listdir(dfd):
                if not e.isdigit():
                    continue
                try:
                    fd = os.open(e + "/stat", os.O_RDONLY, dir_fd=dfd)
                    try:
                        data = os.read(fd, 4096)
                    finally:
                        os.close(fd)
                    pid, comm, ticks = parse_pid_stat(data)
                except (OSError, ValueError, IndexError):
                    continue                  # the process exited, or a kernel we do not parse
                out[pid] = (comm, ticks)
        finally:
            os.close(dfd)
        return out

    def gather(self, now: float) -> dict:
        cur, t = self.scan(), time.monotonic()
        top = top_procs(self.prev, cur, t - self.t_prev, self.hz, self.n)
        self.prev = {pid: ticks for pid, (_, ticks) in cur.items()}
        self.t_prev = t
        return {"top_procs": top}


class RdmaPlugin(Plugin):
    """Retransmission counters of RDMA NICs: ``/sys/class/infiniband/<dev>/ports/<n>/hw_counters``."""

    name = "rdma"

    def __init__(self, root: str | None = None):
        self.root = root or os.path.join(host_sys(), "class", "infiniband")

    def setup(self) -> None:
        if not os.path.isdir(self.root) or not self.ports():
            raise Absent(f"no RDMA devices under {self.root}")
        self.prev = self.read()

    def ports(self) -> list[str]:
        out = []
        for dev in sorted(os.listdir(self.root)):
            pdir = os.path.join(self.root, dev, "ports")
            if os.path.isdir(pdir):
                out += [os.path.join(pdir, p, "hw_counters") for p in sorted(os.listdir(pdir))]
        return [p for p in out if os.path.isdir(p)]

    def read(self) -> int:
        total = 0
        for d in self.ports():
            counters = {}
            for name in RDMA_RETRANS_COUNTERS:
                try:
                    with open(os.path.join(d, name)) as f:
                        counters[name] = int(f.read().strip() or 0)
                except (OSError, ValueError):
                    continue
            total += rdma_retrans_total(counters)
        return total

    def gather(self, now: float) -> dict:
        cur = self.read()
        prev, self.prev = self.prev, cur
        return {"rdma_retrans": cur - prev if cur >= prev else None}


class _ToolPlugin(Plugin):
    """Runs a command (found on PATH) and parses its output; a timeout or non-zero exit is an error."""

    tool = ""
    args: tuple[str, ...] = ()
    parse: Callable[[str], list[dict]]
    timeout_s = 5.0
    interval_s = 5.0

    def setup(self) -> None:
        self.path = shutil.which(self.tool)
        if not self.path:
            raise Absent(f"{self.tool} not found on PATH")

    def gather(self, now: float) -> dict:
        out = subprocess.run([self.path, *self.args], capture_output=True, timeout=self.timeout_s, check=True,
                             stdin=subprocess.DEVNULL)
        return {"accel": type(self).parse(out.stdout.decode("utf-8", "replace"))}


class NpuSmiPlugin(_ToolPlugin):
    name = "npu"
    tool = "npu-smi"
    args = ("info",)
    parse = staticmethod(parse_npu_smi_info)


class NvidiaPlugin(Plugin):
    """NVIDIA GPUs through NVML when ``pynvml`` (nvidia-ml-py) is importable, else ``nvidia-smi``."""

    name = "nvidia"

    def setup(self) -> None:
        self.nvml = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.interval_s = 0.0
            return
        except ImportError:
            pass
        except Exception as e:  # noqa: BLE001 - NVMLError: no driver
            raise Absent(f"NVML present but not usable: {e}") from None
        self.smi = _NvidiaSmi()
        self.smi.setup()
        self.interval_s = self.smi.interval_s

    def gather(self, now: float) -> dict:
        if self.nvml is None:
            return self.smi.gather(now)
        n = self.nvml
        out = []
        for i, h in enumerate(self.handles):
            def q(f, *a):
                try:
                    return f(h, *a)
                except n.NVMLError:
                    return None
            util = q(n.nvmlDeviceGetUtilizationRates)
            mem = q(n.nvmlDeviceGetMemoryInfo)
            power = q(n.nvmlDeviceGetPowerUsage)
            out.append({"index": i, "util": float(util.gpu) if util is not None else None,
                        "mem_used": int(mem.used) if mem is not None else None,
                        "temp_c": _float(q(n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU)),
                        "power_w": power / 1000.0 if power is not None else None,
                        "clock_mhz": _float(q(n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM))})
        return {"accel": out}


def _float(v) -> float | None:
    return float(v) if v is not None else None


class _NvidiaSmi(_ToolPlugin):
    name = "nvidia"
    tool = "nvidia-smi"
    args = (f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits")
    parse = staticmethod(parse_nvidia_smi_csv)


#: Every plug-in the agent runs, in order (explicit; no registration by import side effects).
PLUGINS: dict[str, type[Plugin]] = {
    "cpu": CpuPlugin,
    "load": LoadPlugin,
    "mem": MemPlugin,
    "disk": DiskPlugin,
    "net": NetPlugin,
    "procs": TopProcsPlugin,
    "rdma": RdmaPlugin,
    "npu": NpuSmiPlugin,
    "nvidia": NvidiaPlugin,
}


# ---------------------------------------------------------------------------- runner

class PluginRunner:
    """Wraps one plug-in: sets it up lazily, times every gather, counts successes and errors
    (``metrics``: an :class:`~stepwatch.agents.agent.AgentMetrics` or None), logs an absent source once
    and an error at most once a minute, and never lets an exception out."""

    ERROR_LOG_EVERY_S = 60.0

    def __init__(self, plugin: Plugin, metrics=None):
        self.plugin = plugin
        self.name = plugin.name
        self.metrics = metrics
        self.state = "new"             # new | ok | absent
        self.last: dict = {}
        self.t_last = -1e18
        self.errors = 0
        self.runs = 0
        self._t_error_log = -1e18

    def _count(self, result: str, seconds: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.plugin_runs.labels(self.name, result).inc()
            if seconds is not None:
                self.metrics.plugin_seconds.labels(self.name).observe(seconds)

    def collect(self, now: float) -> dict:
        if self.state == "absent":
            return {}
        t0 = time.perf_counter()
        if self.state == "new":
            try:
                self.plugin.setup()
                self.state = "ok"
            except Absent as e:
                self.state = "absent"
                log.info("host plug-in %r off: %s", self.name, e)
                self._count("absent")
                return {}
            except Exception as e:  # noqa: BLE001
                self._error(e, t0)
                return {}
        iv = getattr(self.plugin, "interval_s", 0.0)
        if iv > 0 and now - self.t_last < iv:
            return self.last
        try:
            out = self.plugin.gather(now) or {}
        except Exception as e:  # noqa: BLE001 - one input must not stop the others
            self._error(e, t0)
            return {}
        self.runs += 1
        self.last, self.t_last = out, now
        self._count("ok", time.perf_counter() - t0)
        return out

    def _error(self, e: Exception, t0: float) -> None:
        self.errors += 1
        self._count("error", time.perf_counter() - t0)
        now = time.monotonic()
        if now - self._t_error_log >= self.ERROR_LOG_EVERY_S:
            self._t_error_log = now
            log.warning("host plug-in %r failed (%d so far): %r", self.name, self.errors, e)


def build_runners(names: list[str] | None = None, metrics=None, plugins: dict[str, Plugin] | None = None
                  ) -> list[PluginRunner]:
    """Runners for the named plug-ins of :data:`PLUGINS` (default: all), or for given instances."""
    if plugins is not None:
        return [PluginRunner(p, metrics) for p in plugins.values()]
    names = list(PLUGINS) if names is None else names
    unknown = [n for n in names if n not in PLUGINS]
    if unknown:
        raise ValueError(f"unknown host plug-in(s) {', '.join(unknown)}; known: {', '.join(PLUGINS)}")
    return [PluginRunner(PLUGINS[n](), metrics) for n in names]


def sample(runners: list[PluginRunner], now: float) -> dict:
    """One host sample: the fields of every plug-in merged (``accel`` lists concatenated)."""
    row: dict = {}
    for r in runners:
        out = r.collect(now)
        for k, v in out.items():
            if k == "accel" and row.get("accel"):
                row["accel"] = row["accel"] + list(v or [])
            else:
                row[k] = v
    return row
