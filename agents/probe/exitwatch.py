"""The rank's goodbye: how its process ended, told to the node agent as an ``exited`` in-flight state.

The processor tells a job that **finished** (every rank said goodbye with status 0) from one that was
**stopped** (its ranks ended by SIGTERM together, the way a scheduler ends a job), a **crashed** rank
(one ended by an exception, a non-zero status or a fatal signal while the others still run) and a
**hang** (ranks alive and not stepping); see :mod:`stepwatch.detectors.lifecycle`. It can do so only if
every way a rank ends leaves a word:

* **interpreter exit** (an ``atexit`` function, run before the probe shuts down; in a child of
  ``multiprocessing``, which ends with ``os._exit``, one of its finalizers): the exit status is
  0, the code given to ``sys.exit`` (recorded by a thin wrapper), 1 with the exception's type, message
  and traceback when an exception ended the program (``sys.excepthook`` is wrapped, the program's own
  hook still runs; ``sys.exit(1)`` called in an ``except`` clause, as torch's spawn wrapper does, takes the
  exception being handled), or signal 2 for an uncaught ``KeyboardInterrupt``;
* **a signal with its default action** (SIGTERM, SIGHUP, SIGQUIT, SIGABRT, SIGSEGV, SIGBUS, SIGFPE,
  SIGILL, SIGXCPU): a handler in C (``_probefast.arm_exit``) sends a goodbye built in advance, then
  lets the signal end the process as it would have. A handler the program installed is left alone;
  so is everything without the C extension (the agent still sees the process go);
* **what leaves no word** (SIGKILL, ``os._exit``, the OOM killer): the node agent sees the pid go
  (:class:`stepwatch.agents.inflight.Liveness`, state ``gone``).

Nothing is sent by a process that never said hello (a launcher, a DataLoader worker), and nothing here
blocks: the datagram goes out on its own non-blocking socket or is lost.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback

from .eventlog import _wall
from stepwatch.wire.datagram import HDR, MAGIC, T_INFLIGHT, VERSION

#: signals whose default action ends the process and that a handler can see
SIGNALS = tuple(int(getattr(signal, n)) for n in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGABRT", "SIGSEGV",
                                                     "SIGBUS", "SIGFPE", "SIGILL", "SIGXCPU")
                if hasattr(signal, n))
MAX_STACK = 3072
#: how long the last steps and the goodbye at interpreter exit may wait for room in the agent's queue (s)
GOODBYE_WAIT_S = 1.0


class ExitWatch:
    """One per probe: records how the program ends and sends the goodbye (see the module docs). Given what
    it uses: ``transport`` (the agent's socket path, the hello sent, the instance; at exit its backlog),
    ``identity`` (the rank), ``fold`` (the step the goodbye names: :meth:`.fold.StepFold.position`),
    ``flush()`` (the last steps, before the goodbye) and ``is_on()`` (whether the probe is on)."""

    def __init__(self, transport, identity, fold, flush, is_on):
        self.transport, self.identity, self.fold, self.flush, self.is_on = transport, identity, fold, flush, is_on
        self.code: int | None = None          # sys.exit's code
        self.exc = None                       # (type, value, tb) of the exception that ended the program
        self.sent = False
        self._armed_key = None                # (instance, rank, path) the signal datagrams were built for
        self._sock: socket.socket | None = None
        self._installed = False

    # -- recording ----------------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap ``sys.excepthook`` and ``sys.exit`` (once per process; the originals still run)."""
        if self._installed:
            return
        self._installed = True
        prev_hook, prev_exit = sys.excepthook, sys.exit

        def excepthook(tp, val, tb, _prev=prev_hook):
            self.exc = (tp, val, tb)
            return _prev(tp, val, tb)

        def exit(code=None, _prev=prev_exit):
            self.code = (code & 0xFF) if isinstance(code, int) and not isinstance(code, bool) else (0 if code is None else 1)
            if self.code and self.exc is None:
                ei = sys.exc_info()                  # sys.exit(1) in an except clause (torch's spawn wrapper)
                if ei[0] is not None and not issubclass(ei[0], SystemExit):
                    self.exc = ei
            return _prev(code)

        exit.__doc__ = prev_exit.__doc__
        sys.excepthook, sys.exit = excepthook, exit

    def status(self) -> dict:
        """How the interpreter is ending, as the goodbye's fields."""
        if self.exc is not None:
            tp, val, tb = self.exc
            if issubclass(tp, KeyboardInterrupt):
                return {"signal": int(signal.SIGINT)}
            err = "".join(traceback.format_exception_only(tp, val)).strip()
            stack = "".join(traceback.format_exception(tp, val, tb))
            return {"exit_code": self.code or 1, "error": err[-512:], "stack": stack[-MAX_STACK:]}
        return {"exit_code": 0 if self.code is None else int(self.code)}

    # -- sending ------------------------------------------------------------------------------------
    def _datagram(self, body: dict) -> bytes:
        body = {"state": "exited", "pid": os.getpid(), **body}
        return HDR.pack(MAGIC, VERSION, T_INFLIGHT, self.transport.instance, self.identity.rank or 0, 0, 0, 0, 0) + \
            json.dumps(body, separators=(",", ":"), default=str).encode()

    def _socket(self) -> socket.socket | None:
        if self._sock is None:
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                s.setblocking(False)
                s.connect(self.transport.path)
                self._sock = s
            except OSError:
                return None
        return self._sock

    def on_hello(self) -> None:
        """The agent heard the probe's identity: (re)build the signal goodbyes for it."""
        fast = _fast()
        tr, rank = self.transport, self.identity.rank
        key = (tr.instance, rank, tr.path, os.getpid())
        if fast is None or key == self._armed_key or rank is None:
            return
        if self._armed_key is not None and self._armed_key[2] != tr.path:
            self.close()
        s = self._socket()
        if s is None:
            return
        try:
            fast.arm_exit(s.fileno(), {sig: self._datagram({"signal": sig})
                                       for sig in SIGNALS})
            self._armed_key = key
        except (ValueError, OSError):
            pass

    def at_exit(self) -> None:
        """The interpreter is ending: say how (only a probe that said hello; once)."""
        tr = self.transport
        if self.sent or not self.is_on() or tr.hello_bytes == b"" or self._armed_key is None and not tr.connected:
            return
        self.sent = True
        end = time.monotonic() + GOODBYE_WAIT_S
        try:
            self.flush()                                  # the last steps first
            # ... also those the agent's full queue deferred: nobody sends the backlog after the exit
            # (CI: a rank's last 27 steps never stored); they wait for room as the goodbye does
            while tr.backlog and not tr.flush_backlog() and tr.connected and time.monotonic() < end:
                time.sleep(0.005)
        except Exception:  # noqa: BLE001
            pass
        body = self.status()
        body["t"] = _wall()
        body["step"] = int(self.fold.position().step)
        s = self._socket()
        if s is not None:
            # the process is ending: the goodbye may wait a little for room in the agent's queue (a busy
            # agent: 4 ranks on 2 loaded cores lost one, and the job's clean end read as a failed exit)
            data, end = self._datagram(body), max(end, time.monotonic() + 0.1)
            while True:
                try:
                    s.send(data)
                    break
                except BlockingIOError:
                    if time.monotonic() >= end:
                        break
                    time.sleep(0.005)
                except OSError:
                    break

    def after_fork(self) -> None:
        """A forked child is not the rank that armed the handlers (the C side checks the pid too)."""
        self._armed_key = None
        self._sock = None                                 # the parent's socket object stays the parent's
        self.sent = False
        self.code, self.exc = None, None

    def close(self) -> None:
        fast = _fast()
        if fast is not None and self._armed_key is not None:
            fast.disarm_exit()
        self._armed_key = None
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


def _fast():
    from . import eventlog
    f = eventlog._fast
    return f if f is not None and hasattr(f, "arm_exit") else None
