"""The probe's transport: its identity (the hello) and the non-blocking ``AF_UNIX`` datagram socket to the
node agent, with a small backlog while the agent's queue is full; what cannot be sent is dropped and
counted, never waited for. :class:`Transport` is a part of :class:`~.core.Probe` (its state lives there)."""
from __future__ import annotations

import json
import os
import sys

from .eventlog import _perf, _wall
from stepwatch.wire.datagram import HDR, MAGIC, MAX_BACKLOG, T_HELLO, VERSION

RETRY_NS = 20_000_000                 # while datagrams wait in the backlog, step ends try again this often
HELLO_EVERY_NS = 10_000_000_000       # identity re-sent every 10-20 s (an agent restart learns it again)


def _new_instance() -> int:
    """A random 31-bit id for a probe instance (pid namespaces make pids ambiguous on a node)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


class Transport:
    """Identity, hello and sending (methods of :class:`~.core.Probe`)."""

    def _resolve_identity(self) -> None:
        if self.rank is None or self.world_size is None:
            try:
                dist = sys.modules.get("torch.distributed")
                if dist is not None and dist.is_available() and dist.is_initialized():
                    if self.rank is None:
                        self.rank = dist.get_rank()
                    if self.world_size is None:
                        self.world_size = dist.get_world_size()
            except Exception:  # noqa: BLE001
                pass
            if self.rank is None:
                self.rank = 0
            if self.world_size is None:
                self.world_size = max(1, self.rank + 1)
        self._identity_ready = True
        self._need_hello = self._hello_dirty = True

    def _device(self) -> dict:
        out = {}
        if "device" in self.extra:
            return out
        lr = self.local_rank if self.local_rank is not None else 0
        npu = sys.modules.get("torch_npu")
        torch = sys.modules.get("torch")
        try:
            if npu is not None:
                out["device"] = f"npu:{lr}"
                try:
                    out["device_type"] = str(npu.npu.get_device_name(lr))
                except Exception:  # noqa: BLE001
                    pass
            elif torch is not None and torch.cuda.is_initialized():
                idx = torch.cuda.current_device()
                out["device"] = f"cuda:{idx}"
                out["device_type"] = torch.cuda.get_device_name(idx)
            else:
                out["device"] = "cpu"
        except Exception:  # noqa: BLE001
            pass
        return out

    def hello_payload(self) -> dict:
        torch = sys.modules.get("torch")
        fw = f"pytorch-{torch.__version__}" if torch is not None else "python"
        if sys.modules.get("torch_npu") is not None:
            fw += "+torch_npu"
        d = {"v": VERSION, "job": self.job, "rank": self.rank, "world_size": self.world_size,
             "local_rank": self.local_rank, "pid": os.getpid(), "framework": fw,
             "names": {str(i): n for n, i in self._names.items()}}
        if self._group_sizes:
            d["group_sizes"] = dict(self._group_sizes)
        if self.node:
            d["node"] = self.node
        ctl = self._ctl_path()
        if ctl:
            d["ctl"] = ctl
        d.update(self._device())
        d.update(self.extra)
        tok = os.environ.get("STEPWATCH_JOB_TOKEN")       # the job's own secret: its pods share the job (agent)
        if tok:
            d["job_token"] = tok
        return d

    def _send_hello(self, perf: int) -> None:
        self._last_hello = perf
        self._wall_off = _wall() - _perf()
        if not self._connected and perf - self._t_connect < self.reconnect_ns:
            return                              # nobody to tell: do not even build it
        if self._hello_dirty or not self._hello_bytes:
            body = json.dumps(self.hello_payload(), separators=(",", ":")).encode()
            self._hello_bytes = HDR.pack(MAGIC, VERSION, T_HELLO, self.instance, self.rank or 0, 0, 0, 0, 0) + body
            self._hello_dirty = False
        if self._sendto(self._hello_bytes, hello=True):
            self._need_hello = False
            self._exitw.on_hello()              # the signal goodbyes, for this identity (exitwatch)

    def _sendto(self, data, hello: bool = False, frames: int = 0) -> bool:
        """Hand one datagram (a hello, or ``frames`` frames) to the agent; never blocks, never
        raises. True when it was sent or queued in the backlog, False when it was dropped; lost
        frames are counted (a lost hello is not: it is sent again with the next datagram).

        The socket is connected to the agent's path once (a connected send costs ~3 µs, a send by
        path ~5 µs). While no agent listens, a reconnect is tried at most every ``reconnect_ns``
        (1 s) and datagrams in between are dropped without a system call; a new agent receives the
        hello first. When the agent's queue is full (``EAGAIN``: the kernel queues only
        ``net.unix.max_dgram_qlen`` datagrams, 10 by default) the datagram is copied into a backlog
        of ``MAX_BACKLOG`` that is sent, in order, before the next one; only what falls out of it is
        dropped."""
        if not self._connected:
            now = _perf()
            if now - self._t_connect < self.reconnect_ns:
                self._lost(frames, "no_agent")
                return False
            self._t_connect = now
            try:
                self._sock.connect(self._path)
            except (FileNotFoundError, ConnectionRefusedError, PermissionError):
                self._lost(frames, "no_agent")
                return False
            except (OSError, AttributeError):
                self._lost(frames, "error")
                return False
            self._connected = True
            self._need_hello = True
            if not hello:                           # a new agent learns who we are first
                self._send_hello(now)
        if self._backlog and not self._flush_backlog():
            return self._defer(data, hello, frames)     # keep the order
        try:
            self._sock.send(data)
        except BlockingIOError:
            return self._defer(data, hello, frames)
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
            self._agent_gone()
            self._lost(frames, "no_agent")
            return False
        except OSError:
            self._agent_gone()
            self._lost(frames, "error")
            return False
        except AttributeError:                      # socket closed by shutdown()
            self._lost(frames, "error")
            return False
        self._counted(hello, frames)
        return True

    def _counted(self, hello: bool, frames: int) -> None:
        """One datagram sent: a hello, or a batch of ``frames`` steps."""
        if hello:
            self.hellos += 1
        else:
            self.datagrams += 1
            self.sent += frames

    def _lost(self, frames: int, why: str) -> None:
        if frames:
            if why == "no_agent":
                self.dropped_no_agent += frames
            elif why == "full":
                self.dropped_full += frames
            else:
                self.dropped_error += frames
            self.dropped += frames

    def _agent_gone(self) -> None:
        """The agent went away: forget the connection (reconnect on the next send) and the backlog."""
        self._connected = False
        self._t_connect = 0
        self._need_hello = True
        if self._backlog:
            self._lost(sum(f for _, _, f in self._backlog), "no_agent")
            self._backlog.clear()
            self._log.drain_ns = self.flush_ns

    def _defer(self, data, hello: bool, frames: int) -> bool:
        """Keep a datagram the agent's full queue refused. While the backlog holds any, step ends drain
        every ``RETRY_NS`` and the drain sends it once there is room: a deferred datagram that waited for
        the next ``flush_ms`` doubled what a crash in between loses."""
        bl = self._backlog
        if len(bl) >= MAX_BACKLOG:
            self._lost(bl.popleft()[2], "full")
        bl.append((bytes(data), hello, frames))
        self.deferred += 1
        self._log.drain_ns = min(self.flush_ns, RETRY_NS)
        return True

    def _flush_backlog(self) -> bool:
        """Send the backlog oldest first; False while the agent's queue is still full."""
        bl = self._backlog
        while bl:
            data, hello, frames = bl[0]
            try:
                self._sock.send(data)
            except BlockingIOError:
                return False
            except (OSError, AttributeError):
                self._agent_gone()
                return False
            bl.popleft()
            self._counted(hello, frames)
        self._log.drain_ns = self.flush_ns
        return True

    def flush(self) -> None:
        """Send the finished steps that wait for company now (shutdown and exit do it too)."""
        self._drain()
        self._flush(_perf())

    def _flush(self, perf: int) -> None:
        """Send the frames packed so far (and poll the profiling control socket)."""
        self._last_flush = perf
        if self._ctl is not None:
            self._ctl_poll()
        if self._frames:
            self._send_buf(perf)

    def _send_buf(self, perf: int) -> None:
        """The buffer's frames as one datagram, after the hello when one is due."""
        frames, off = self._frames, self._off
        self._frames = self._off = 0
        if not self._connected and perf - self._t_connect < self.reconnect_ns:
            self._lost(frames, "no_agent")
            return
        if self._need_hello or perf - self._last_hello > self._hello_every:
            self._send_hello(perf)
        self._sendto(self._mv[:off], frames=frames)
