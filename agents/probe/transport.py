"""The probe's transport: the non-blocking ``AF_UNIX`` datagram socket to the node agent, the hello that
tells it who is sending, the datagram buffer the fold packs frames into, and a small backlog while the
agent's queue is full; what cannot be sent is dropped and counted, never waited for. :class:`Transport` is a
part the :class:`~.core.Probe` composes; the identity the hello carries is the probe's (``hello_payload``)."""
from __future__ import annotations

import collections
import json
import os
import socket
import sys

from .eventlog import _perf, _wall
from stepwatch.wire.datagram import DEFAULT_FLUSH_MS, HDR, MAGIC, MAX_BACKLOG, MAX_DATAGRAM, T_HELLO, VERSION

RETRY_NS = 20_000_000                 # while datagrams wait in the backlog, step ends try again this often
HELLO_EVERY_NS = 10_000_000_000       # identity re-sent every 10-20 s (an agent restart learns it again)


def _new_instance() -> int:
    """A random 31-bit id for a probe instance (pid namespaces make pids ambiguous on a node)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def device_fields(extra: dict, local_rank: int | None) -> dict:
    """The hello's ``device``/``device_type`` as this process sees them (none when the user gave ``device``)."""
    out = {}
    if "device" in extra:
        return out
    lr = local_rank if local_rank is not None else 0
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


class Transport:
    """The socket to the agent, its hello, the datagram buffer, the backlog and the delivery counters.

    Collaborators, all given here: ``log``, the hot path's event log (its ``drain_ns``, the replay period,
    is shortened while the backlog holds datagrams); ``hello_payload()``, the hello's fields (the probe's
    identity, names and topology), called when the hello is rebuilt; ``on_hello()``, called when a hello
    reached the agent (the exit goodbyes are armed for it); ``on_flush()``, called at every flush (the
    profiling control socket's poll). The fold packs frames into ``buf`` at ``off`` (``frames`` of them)
    and calls :meth:`send_buf`/:meth:`flush`; whoever learns that the hello changed calls
    :meth:`hello_changed`."""

    def __init__(self, log, hello_payload, on_hello, on_flush):
        self.log, self.hello_payload, self.on_hello, self.on_flush = log, hello_payload, on_hello, on_flush
        self.sock: socket.socket | None = None
        self.path = ""
        self.connected = False
        self.t_connect = -(1 << 62)
        self.reconnect_ns = 1_000_000_000
        self.hello_bytes = b""
        self.hello_dirty = self.need_hello = True
        self.last_hello = 0
        self.wall_off = _wall() - _perf()         # wall ns = perf ns + offset (re-anchored per hello)
        self.backlog: collections.deque = collections.deque()
        self.buf = bytearray(MAX_DATAGRAM)
        self.mv = memoryview(self.buf)
        self.off = self.frames = 0                # bytes and frames (finished steps) packed in buf
        self.last_flush = 0
        self.flush_ns = int(DEFAULT_FLUSH_MS * 1e6)
        self._new_instance()
        self.reset_counters()

    def _new_instance(self) -> None:
        self.instance = _new_instance()
        # periodic hello every 10-20 s, spread per instance so ranks started together do not burst
        self.hello_every = HELLO_EVERY_NS + (self.instance % 10_000) * 1_000_000

    def reset_counters(self) -> None:
        self.sent = 0                    # frames (step records, GC bursts) delivered to the agent
        self.datagrams = 0
        self.dropped_full = 0
        self.dropped_no_agent = 0
        self.dropped_error = 0
        self.dropped = 0                 # frames lost: sum of the three above (carried in every step record)
        self.deferred = 0                # datagrams that waited in the backlog (sent later or dropped)
        self.hellos = 0

    def hello_changed(self) -> None:
        """What the hello says changed: it is rebuilt and sent before the next datagram."""
        self.need_hello = self.hello_dirty = True

    def open(self, path: str) -> None:
        """Send to the agent's socket at ``path`` (``init``; again: a new path reconnects)."""
        if path != self.path:
            self.connected = False
            self.t_connect = -(1 << 62)
            if self.sock is not None:             # a connected datagram socket cannot be re-pointed
                self.sock.close()
                self.sock = None
        self.path = path
        if self.sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.setblocking(False)
            self.sock = s
        self.hello_changed()

    def close(self) -> None:
        """Close the socket and forget the backlog (``shutdown``)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.connected = False
        self.t_connect = -(1 << 62)
        self.backlog.clear()

    def after_fork(self, reopen: bool) -> None:
        """In a forked child: a new instance with its own socket (``reopen``: the probe is on), counters and
        buffer; the parent's pending steps and backlog are the parent's."""
        self._new_instance()
        self.backlog.clear()
        old, self.sock = self.sock, None
        self.connected = False
        self.t_connect = -(1 << 62)
        if old is not None:
            try:
                old.close()
            except OSError:
                pass
        if reopen:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.setblocking(False)
            self.sock = s
        self.reset_counters()
        self.off = self.frames = 0
        self.last_flush = self.last_hello = 0
        self.hello_changed()

    def send_hello(self, perf: int) -> None:
        self.last_hello = perf
        self.wall_off = _wall() - _perf()
        if not self.connected and perf - self.t_connect < self.reconnect_ns:
            return                              # nobody to tell: do not even build it
        if self.hello_dirty or not self.hello_bytes:
            d = self.hello_payload()
            body = json.dumps(d, separators=(",", ":")).encode()
            self.hello_bytes = HDR.pack(MAGIC, VERSION, T_HELLO, self.instance, d.get("rank") or 0, 0, 0, 0, 0) + body
            self.hello_dirty = False
        if self.sendto(self.hello_bytes, hello=True):
            self.need_hello = False
            self.on_hello()                     # the signal goodbyes, for this identity (exitwatch)

    def sendto(self, data, hello: bool = False, frames: int = 0) -> bool:
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
        if not self.connected:
            now = _perf()
            if now - self.t_connect < self.reconnect_ns:
                self.lost(frames, "no_agent")
                return False
            self.t_connect = now
            try:
                self.sock.connect(self.path)
            except (FileNotFoundError, ConnectionRefusedError, PermissionError):
                self.lost(frames, "no_agent")
                return False
            except (OSError, AttributeError):
                self.lost(frames, "error")
                return False
            self.connected = True
            self.need_hello = True
            if not hello:                           # a new agent learns who we are first
                self.send_hello(now)
        if self.backlog and not self.flush_backlog():
            return self.defer(data, hello, frames)     # keep the order
        try:
            self.sock.send(data)
        except BlockingIOError:
            return self.defer(data, hello, frames)
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
            self.agent_gone()
            self.lost(frames, "no_agent")
            return False
        except OSError:
            self.agent_gone()
            self.lost(frames, "error")
            return False
        except AttributeError:                      # socket closed by shutdown()
            self.lost(frames, "error")
            return False
        self.counted(hello, frames)
        return True

    def counted(self, hello: bool, frames: int) -> None:
        """One datagram sent: a hello, or a batch of ``frames`` steps."""
        if hello:
            self.hellos += 1
        else:
            self.datagrams += 1
            self.sent += frames

    def lost(self, frames: int, why: str) -> None:
        if frames:
            if why == "no_agent":
                self.dropped_no_agent += frames
            elif why == "full":
                self.dropped_full += frames
            else:
                self.dropped_error += frames
            self.dropped += frames

    def agent_gone(self) -> None:
        """The agent went away: forget the connection (reconnect on the next send) and the backlog."""
        self.connected = False
        self.t_connect = 0
        self.need_hello = True
        if self.backlog:
            self.lost(sum(f for _, _, f in self.backlog), "no_agent")
            self.backlog.clear()
            self.log.drain_ns = self.flush_ns

    def defer(self, data, hello: bool, frames: int) -> bool:
        """Keep a datagram the agent's full queue refused. While the backlog holds any, step ends drain
        every ``RETRY_NS`` and the drain sends it once there is room: a deferred datagram that waited for
        the next ``flush_ms`` doubled what a crash in between loses."""
        bl = self.backlog
        if len(bl) >= MAX_BACKLOG:
            self.lost(bl.popleft()[2], "full")
        bl.append((bytes(data), hello, frames))
        self.deferred += 1
        self.log.drain_ns = min(self.flush_ns, RETRY_NS)
        return True

    def flush_backlog(self) -> bool:
        """Send the backlog oldest first; False while the agent's queue is still full."""
        bl = self.backlog
        while bl:
            data, hello, frames = bl[0]
            try:
                self.sock.send(data)
            except BlockingIOError:
                return False
            except (OSError, AttributeError):
                self.agent_gone()
                return False
            bl.popleft()
            self.counted(hello, frames)
        self.log.drain_ns = self.flush_ns
        return True

    def flush(self, perf: int) -> None:
        """Send the frames packed so far (and poll the profiling control socket: ``on_flush``)."""
        self.last_flush = perf
        self.on_flush()
        if self.frames:
            self.send_buf(perf)

    def flush_due(self, perf: int) -> None:
        """At a drain (``perf``: its time): send the frames it folded once ``flush_ns`` passed since the
        last send. (Judged by the folded steps' own ends instead, a drain that came ``flush_ns`` after a
        gap sent its first step and kept the rest to the next drain, up to twice ``flush_ns``: a crashed
        DDP rank lost its last 28 steps, 730 ms.)"""
        if self.frames and perf - self.last_flush >= self.flush_ns:
            self.flush(perf)

    def send_buf(self, perf: int) -> None:
        """The buffer's frames as one datagram, after the hello when one is due."""
        frames, off = self.frames, self.off
        self.frames = self.off = 0
        if not self.connected and perf - self.t_connect < self.reconnect_ns:
            self.lost(frames, "no_agent")
            return
        if self.need_hello or perf - self.last_hello > self.hello_every:
            self.send_hello(perf)
        self.sendto(self.mv[:off], frames=frames)
