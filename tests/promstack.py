"""The real Prometheus and Alertmanager (Debian's ``prometheus`` 2.42 and ``prometheus-alertmanager``
0.25) on free loopback ports, for tests: started from a config written here, ready when their
``/-/ready`` answers, stopped by pid. Plus a local webhook receiver that records Alertmanager's
notifications, and small HTTP helpers."""
from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from testkit import free_port  # noqa: F401 - (test modules import it from here too)

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
AMTOOL = shutil.which("amtool")
MISSING_PROM = "Debian's prometheus package is not installed (apt-get install prometheus): no prometheus/promtool"
MISSING_AM = ("Debian's prometheus-alertmanager package is not installed (apt-get install prometheus-alertmanager): "
              "no alertmanager binary")




def http_get(url: str, timeout: float = 5.0, headers: dict | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
        return r.read()


def wait_until(pred, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as e:  # noqa: BLE001 - keep polling; report the last error
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


class _Server:
    name = "server"

    def __init__(self, workdir: Path, port: int | None = None):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.dir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self, cmd: list[str], timeout: float = 30.0):
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                http_get(self.url + "/-/ready", timeout=1)
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} not ready on {self.url}: {self.log.read_text()[-2000:]}")

    def stop(self, timeout: float = 10.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


class Prometheus(_Server):
    name = "prometheus"

    def start(self, scrape: list[dict], interval: str = "1s", rule_files: list[str] = ()) -> "Prometheus":
        cfg = {"global": {"scrape_interval": interval, "evaluation_interval": interval},
               "scrape_configs": scrape}
        if rule_files:
            cfg["rule_files"] = list(rule_files)
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        return self._start([PROMETHEUS, f"--config.file={self.dir / 'prometheus.yml'}",
                            f"--storage.tsdb.path={self.dir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
                            "--web.enable-lifecycle", "--log.level=warn"])

    def query(self, promql: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": promql})
        r = json.loads(http_get(f"{self.url}/api/v1/query?{q}"))
        assert r["status"] == "success", r
        return r["data"]["result"]

    def series(self, match: str) -> list[dict]:
        q = urllib.parse.urlencode({"match[]": match})
        r = json.loads(http_get(f"{self.url}/api/v1/series?{q}"))
        assert r["status"] == "success", r
        return r["data"]

    def targets_up(self) -> dict[str, str]:
        r = json.loads(http_get(f"{self.url}/api/v1/targets"))
        return {t["labels"]["job"]: t["health"] for t in r["data"]["activeTargets"]}


class Alertmanager(_Server):
    name = "alertmanager"

    def start(self, config: dict, web_config: dict | None = None) -> "Alertmanager":
        (self.dir / "alertmanager.yml").write_text(yaml.safe_dump(config))
        cmd = [ALERTMANAGER, f"--config.file={self.dir / 'alertmanager.yml'}", f"--storage.path={self.dir / 'data'}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=warn"]
        if web_config is not None:
            (self.dir / "web.yml").write_text(yaml.safe_dump(web_config))
            cmd.append(f"--web.config.file={self.dir / 'web.yml'}")
        self._start(cmd)
        return self

    def _start(self, cmd, timeout: float = 30.0):
        # with basic auth on, /-/ready also wants credentials: readiness = any HTTP answer
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"alertmanager exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                http_get(self.url + "/-/ready", timeout=1)
                return self
            except urllib.error.HTTPError:
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"alertmanager not ready on {self.url}")

    def alerts(self, headers: dict | None = None) -> list[dict]:
        return json.loads(http_get(f"{self.url}/api/v2/alerts", headers=headers))


class Webhook:
    """A local HTTP server recording every JSON body POSTed to it (Alertmanager's webhook receiver)."""

    def __init__(self):
        self.received: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                with outer.lock:
                    outer.received.append(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def notifications(self) -> list[dict]:
        with self.lock:
            return list(self.received)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def promtool_check_metrics(text: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60)
