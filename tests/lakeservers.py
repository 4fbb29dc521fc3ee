"""Real servers for the lake tests: a PostgreSQL cluster (Debian's ``postgresql`` package) in a
temporary folder and moto's S3-compatible server, each on a free loopback port, waited for, and
stopped by pid."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit import free_port


def pg_bin() -> Path | None:
    """The newest installed PostgreSQL server's bin folder (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    w = shutil.which("initdb")
    return Path(w).parent if w else None


class PostgresServer:
    """``initdb`` + ``postgres`` on 127.0.0.1:<free port>, trust auth, database ``lake``. As root,
    the server runs as the ``postgres`` user (initdb refuses root)."""

    def __init__(self, base: Path | None = None):
        self.bin = pg_bin()
        if self.bin is None:
            raise FileNotFoundError("PostgreSQL server binaries (initdb) not found: apt-get install postgresql")
        self.base = Path(base or tempfile.mkdtemp(prefix="stepwatch-pg-"))
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.user = "postgres"

    def _as_server_user(self) -> dict:
        if os.geteuid() != 0:
            return {}
        pw = pwd.getpwnam("postgres")

        def demote():
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
        return {"preexec_fn": demote}

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname=lake"

    def start(self) -> "PostgresServer":
        data = self.base / "data"
        self.base.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
        kw = self._as_server_user()
        subprocess.run([str(self.bin / "initdb"), "-D", str(data), "-U", self.user, "--auth=trust", "-E", "UTF8",
                        "--no-sync"], check=True, capture_output=True, **kw)
        self.log = open(self.base / "server.log", "wb")
        self.proc = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", str(data), "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
             "-c", f"unix_socket_directories={self.base}", "-c", "fsync=off", "-c", "max_connections=200"],
            stdout=self.log, stderr=subprocess.STDOUT, **kw)
        deadline = time.monotonic() + 30
        while True:
            r = subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                               capture_output=True)
            if r.returncode == 0:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"postgres did not start: {(self.base / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)
        subprocess.run([str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user,
                        "-d", "postgres", "-c", "CREATE DATABASE lake"], check=True, capture_output=True)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)        # fast shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        log = self.base / "server.log"
        if log.exists() and ("terminated by signal" in log.read_text() or os.environ.get("STEPWATCH_KEEP_PG_LOG")):
            shutil.copy(log, Path(tempfile.gettempdir()) / f"stepwatch-pg-{self.port}.log")
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class MotoS3:
    """moto's S3-compatible server on 127.0.0.1:<free port> with one bucket."""

    def __init__(self, bucket: str = "lake"):
        self.port = free_port()
        self.bucket = bucket
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "MotoS3":
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import urllib.request
        deadline = time.monotonic() + 30
        while True:
            try:
                req = urllib.request.Request(f"http://{self.endpoint}/{self.bucket}", method="PUT")
                urllib.request.urlopen(req, timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
