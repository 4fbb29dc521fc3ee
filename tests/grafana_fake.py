"""Test helpers for the Grafana integration: Grafana's published API spec as a request/response
validator, and a small stateful stand-in for Grafana on 127.0.0.1 that checks every request against it.

The spec is ``shared/grafana/api-merged.json`` (Swagger 2.0, Grafana 11.4), found beside the repository
(``<repo>/../shared``, as CI clones it) or at ``$STEPWATCH_SHARED``. Tests that need it use the
``api_spec`` fixture, which skips with the reason when it is absent.

:class:`ApiSpec` checks a request's path (templated paths such as ``/dashboards/uid/{uid}``, under
``basePath`` ``/api``), method, declared query parameters, the ``Authorization`` header, and the JSON
body against the referenced definitions (``$ref`` resolved): required fields, JSON types, enums,
string lengths and patterns, integer formats; unknown fields of objects whose properties the spec
lists are errors too (a typo such as ``folderUID`` for ``folderUid`` would otherwise pass). Responses
the fake sends are checked the same way, and their status must be one the spec documents for the
operation — so the fake only answers what Grafana says it can answer.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

SPEC_REL = Path("grafana") / "api-merged.json"


def shared_dir() -> Path:
    env = os.environ.get("STEPWATCH_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared"


def spec_path() -> Path:
    return shared_dir() / SPEC_REL


# ============================================================================ spec validator
_DURATION = re.compile(r"^-?(\d+(\.\d+)?(ns|us|µs|ms|s|m|h|d|w|y))+$|^0$")
_INT64 = (-(2 ** 63), 2 ** 63 - 1)


class ApiSpec:
    def __init__(self, path: Path):
        self.doc = json.loads(Path(path).read_text(encoding="utf-8"))
        if self.doc.get("swagger") != "2.0":
            raise ValueError(f"{path}: not a Swagger 2.0 document")
        self.base = self.doc.get("basePath", "")
        self.routes = []
        for template, ops in self.doc["paths"].items():
            segs = template.strip("/").split("/")
            rx = "^/" + "/".join("[^/]+" if s.startswith("{") else re.escape(s) for s in segs) + "$"
            literal = sum(not s.startswith("{") for s in segs)
            self.routes.append((re.compile(rx), template, literal, ops))
        # most specific first: more literal segments win (/datasources/uid/{uid} over /datasources/{id}/{x})
        self.routes.sort(key=lambda r: -r[2])

    # -- lookup
    def route(self, path: str):
        """(template, operations) for a request path under basePath, or None."""
        if not path.startswith(self.base + "/"):
            return None
        rel = path[len(self.base):]
        for rx, template, _, ops in self.routes:
            if rx.match(rel):
                return template, ops
        return None

    def resolve(self, schema: dict) -> dict:
        seen = 0
        while "$ref" in schema:
            ref = schema["$ref"]
            if not ref.startswith("#/"):
                raise ValueError(f"external $ref {ref}")
            node = self.doc
            for part in ref[2:].split("/"):
                node = node[part]
            schema = node
            seen += 1
            if seen > 50:
                raise ValueError(f"$ref loop at {ref}")
        return schema

    # -- schema check
    def check(self, schema: dict, v, where: str = "body", strict: bool = True) -> list[str]:
        errs: list[str] = []
        self._check(schema, v, where, errs, strict)
        return errs

    def _check(self, schema, v, where, errs, strict):
        schema = self.resolve(schema)
        for sub in schema.get("allOf", ()):
            self._check(sub, v, where, errs, strict)
        t = schema.get("type") or ("object" if "properties" in schema else None)
        if v is None:
            if t is not None and not schema.get("x-nullable"):
                errs.append(f"{where}: null where the spec wants {t}")
            return
        if t == "object":
            if not isinstance(v, dict):
                errs.append(f"{where}: expected object, got {type(v).__name__}")
                return
            for r in schema.get("required", ()):
                if r not in v:
                    errs.append(f"{where}: required field {r!r} missing")
            props = schema.get("properties", {})
            addl = schema.get("additionalProperties")
            for k, x in v.items():
                if k in props:
                    self._check(props[k], x, f"{where}.{k}", errs, strict)
                elif isinstance(addl, dict):
                    self._check(addl, x, f"{where}.{k}", errs, strict)
                elif strict and props and addl is None:
                    errs.append(f"{where}: field {k!r} is not in the spec ({', '.join(sorted(props))})")
        elif t == "array":
            if not isinstance(v, list):
                errs.append(f"{where}: expected array, got {type(v).__name__}")
                return
            for i, x in enumerate(v):
                self._check(schema.get("items", {}), x, f"{where}[{i}]", errs, strict)
        elif t == "string":
            if not isinstance(v, str):
                errs.append(f"{where}: expected string, got {type(v).__name__} {v!r}")
                return
            if "enum" in schema and v not in schema["enum"]:
                errs.append(f"{where}: {v!r} not one of {schema['enum']}")
            if "minLength" in schema and len(v) < schema["minLength"]:
                errs.append(f"{where}: shorter than {schema['minLength']}")
            if "maxLength" in schema and len(v) > schema["maxLength"]:
                errs.append(f"{where}: longer than {schema['maxLength']}")
            if "pattern" in schema and not re.search(schema["pattern"], v):
                errs.append(f"{where}: {v!r} does not match {schema['pattern']}")
            fmt = schema.get("format")
            if fmt == "date-time":
                try:
                    datetime.fromisoformat(v.replace("Z", "+00:00"))
                except ValueError:
                    errs.append(f"{where}: {v!r} is not a date-time")
            elif fmt == "duration" and not _DURATION.match(v):
                errs.append(f"{where}: {v!r} is not a duration")
        elif t == "integer":
            if isinstance(v, bool) or not isinstance(v, int):
                errs.append(f"{where}: expected integer, got {type(v).__name__} {v!r}")
            elif schema.get("format") == "int64" and not _INT64[0] <= v <= _INT64[1]:
                errs.append(f"{where}: {v} out of int64 range")
        elif t == "number":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                errs.append(f"{where}: expected number, got {type(v).__name__} {v!r}")
        elif t == "boolean":
            if not isinstance(v, bool):
                errs.append(f"{where}: expected boolean, got {type(v).__name__} {v!r}")
        if "enum" in schema and t != "string" and v not in schema["enum"]:
            errs.append(f"{where}: {v!r} not one of {schema['enum']}")

    def _param_type_ok(self, p: dict, raw: str) -> bool:
        t = p.get("type")
        if t == "integer":
            return re.fullmatch(r"-?\d+", raw) is not None
        if t == "number":
            try:
                float(raw)
                return True
            except ValueError:
                return False
        if t == "boolean":
            return raw in ("true", "false")
        return True

    # -- request / response
    def validate_request(self, method: str, raw_path: str, headers: dict[str, str], body: bytes | None) -> list[str]:
        u = urlsplit(raw_path)
        hit = self.route(u.path)
        if hit is None:
            return [f"{method} {u.path}: no such path in the spec (basePath {self.base})"]
        template, ops = hit
        op = ops.get(method.lower())
        if op is None:
            return [f"{method} {u.path}: method not allowed for {template} (spec has {', '.join(ops)})"]
        name = f"{method} {template}"
        errs = []
        security = op.get("security", self.doc.get("security"))
        if security and not headers.get("authorization", "").startswith(("Bearer ", "Basic ")):
            errs.append(f"{name}: no Authorization header")
        params = op.get("parameters", [])
        query = parse_qs(u.query, keep_blank_values=True)
        declared_q = {p["name"]: p for p in params if p.get("in") == "query"}
        for k, vals in query.items():
            if k not in declared_q:
                errs.append(f"{name}: query parameter {k!r} is not in the spec")
            elif not all(self._param_type_ok(declared_q[k], x) for x in vals):
                errs.append(f"{name}: query parameter {k!r}={vals} is not {declared_q[k].get('type')}")
        for p in declared_q.values():
            if p.get("required") and p["name"] not in query:
                errs.append(f"{name}: required query parameter {p['name']!r} missing")
        body_params = [p for p in params if p.get("in") == "body"]
        has_body = bool(body and body.strip())
        if body_params:
            bp = body_params[0]
            if not has_body:
                if bp.get("required"):
                    errs.append(f"{name}: required body missing")
            else:
                ct = headers.get("content-type", "")
                if "application/json" not in ct:
                    errs.append(f"{name}: body sent as {ct!r}, not application/json")
                try:
                    doc = json.loads(body)
                except ValueError as e:
                    return errs + [f"{name}: body is not JSON ({e})"]
                errs += self.check(bp["schema"], doc, f"{name} body")
        elif has_body:
            errs.append(f"{name}: the spec takes no body")
        return errs

    def validate_response(self, method: str, template: str, status: int, body) -> list[str]:
        op = self.doc["paths"][template][method.lower()]
        resp = op.get("responses", {}).get(str(status))
        name = f"{method} {template} -> {status}"
        if resp is None:
            return [f"{name}: status not documented (spec: {', '.join(op.get('responses', {}))})"]
        resp = self.resolve(resp)
        if "schema" in resp and body is not None:
            return self.check(resp["schema"], body, f"{name} response", strict=False)
        return []


# ============================================================================ fake Grafana
@dataclass
class Captured:
    method: str
    path: str
    template: str | None
    headers: dict[str, str]
    body: object
    status: int = 0


@dataclass
class Fault:
    method: str
    path: re.Pattern
    status: int | None          # None: no answer, close the connection (after delay)
    body: dict | None = None
    times: int = 1
    delay: float = 0.0
    release: threading.Event | None = None   # wait for this (max `delay`) before answering


@dataclass
class FakeGrafana:
    """Stateful stand-in for the parts of Grafana's API stepwatch uses. Records every request in
    :attr:`requests`; spec violations (requests and its own responses) in :attr:`violations`."""

    spec: ApiSpec | None = None
    token: str = "test-token-0123456789"
    requests: list[Captured] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    folders: dict = field(default_factory=dict)
    datasources: dict = field(default_factory=dict)
    dashboards: dict = field(default_factory=dict)
    rules: dict = field(default_factory=dict)
    annotations: list = field(default_factory=list)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._ids = iter(range(1, 10 ** 9))
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle
    def start(self, port: int = 0) -> "FakeGrafana":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _any(self):
                fake._handle(self)
            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def fail(self, method: str, path_regex: str, status: int | None, body: dict | None = None, times: int = 1,
             delay: float = 0.0, release: threading.Event | None = None) -> Fault:
        f = Fault(method, re.compile(path_regex), status, body, times, delay, release)
        self.faults.append(f)
        return f

    def writes(self) -> list[Captured]:
        return [r for r in self.requests if r.method in ("POST", "PUT", "DELETE", "PATCH")]

    # -- plumbing
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(n) if n else b""
        headers = {k.lower(): v for k, v in h.headers.items()}
        path = urlsplit(h.path).path
        hit = self.spec.route(path) if self.spec else None
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = raw
        cap = Captured(h.command, h.path, hit[0] if hit else None, headers, body)
        with self._lock:
            self.requests.append(cap)
            if self.spec:
                self.violations += self.spec.validate_request(h.command, h.path, headers, raw)
        fault = self._take_fault(h.command, path)
        if fault is not None:
            if fault.release is not None:
                fault.release.wait(fault.delay)
            elif fault.delay:
                time.sleep(fault.delay)
            if fault.status is None:
                h.close_connection = True
                return
            status, out = fault.status, fault.body or {"message": f"injected {fault.status}"}
        elif headers.get("authorization") != f"Bearer {self.token}":
            status, out = 401, {"message": "Unauthorized"}
        else:
            with self._lock:
                status, out = self._route(h.command, path, body)
        cap.status = status
        if self.spec and hit:
            with self._lock:
                self.violations += self.spec.validate_response(h.command, hit[0], status, out)
        data = b"" if out is None else json.dumps(out).encode()
        try:
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
        except OSError:
            pass

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.times > 0 and f.method == method and f.path.search(path):
                    f.times -= 1
                    return f
        return None

    # -- Grafana's behaviour (the subset stepwatch uses)
    def _route(self, method: str, path: str, body):
        m = re.fullmatch
        if (g := m(r"/api/folders/([^/]+)", path)) and method == "GET":
            f = self.folders.get(g[1])
            return (200, f) if f else (404, {"message": "folder not found"})
        if path == "/api/folders" and method == "POST":
            uid, title = body.get("uid") or f"f{next(self._ids)}", body["title"]
            if uid in self.folders or any(f["title"] == title for f in self.folders.values()):
                return 409, {"message": "a folder with the same name or uid already exists"}
            f = {"id": next(self._ids), "uid": uid, "title": title, "version": 1, "url": f"/dashboards/f/{uid}"}
            self.folders[uid] = f
            return 200, f
        if (g := m(r"/api/folders/([^/]+)", path)) and method == "PUT":
            f = self.folders.get(g[1])
            if f is None:
                return 404, {"message": "folder not found"}
            if not body.get("overwrite") and body.get("version") != f["version"]:
                return 409, {"message": "the folder has been changed by someone else", "status": "version-mismatch"}
            f.update(title=body.get("title", f["title"]), version=f["version"] + 1)
            return 200, f
        if (g := m(r"/api/datasources/uid/([^/]+)", path)) and method == "GET":
            d = self.datasources.get(g[1])
            return (200, d) if d else (404, {"message": "Data source not found"})
        if path == "/api/datasources" and method == "POST":
            if any(d["name"] == body.get("name") for d in self.datasources.values()):
                return 409, {"message": "data source with the same name already exists"}
            d = {"id": next(self._ids), "orgId": 1, "version": 1, "readOnly": False, "basicAuth": False,
                 "withCredentials": False, "database": "", "user": "", **body}
            self.datasources[d["uid"]] = d
            return 200, {"datasource": d, "id": d["id"], "name": d["name"], "message": "Datasource added"}
        if (g := m(r"/api/datasources/uid/([^/]+)", path)) and method == "PUT":
            d = self.datasources.get(g[1])
            if d is None:
                return 500, {"message": "Failed to update datasource"}
            d.update(body, version=d["version"] + 1)
            return 200, {"datasource": d, "id": d["id"], "name": d["name"], "message": "Datasource updated"}
        if (g := m(r"/api/dashboards/uid/([^/]+)", path)) and method == "GET":
            d = self.dashboards.get(g[1])
            if d is None:
                return 404, {"message": "Dashboard not found"}
            meta = {"folderUid": d["folderUid"], "version": d["dashboard"]["version"], "slug": d["slug"],
                    "url": f"/d/{g[1]}/{d['slug']}", "provisioned": False, "canSave": True}
            return 200, {"dashboard": d["dashboard"], "meta": meta}
        if path == "/api/dashboards/db" and method == "POST":
            dash = dict(body["dashboard"])
            uid, folder = dash["uid"], body.get("folderUid", "")
            cur = self.dashboards.get(uid)
            for other_uid, o in self.dashboards.items():
                if other_uid != uid and o["folderUid"] == folder and o["dashboard"]["title"] == dash["title"] \
                        and not body.get("overwrite"):
                    return 412, {"message": "A dashboard with the same name in the folder already exists",
                                 "status": "name-exists"}
            if cur is not None and not body.get("overwrite") and dash.get("version") != cur["dashboard"]["version"]:
                return 412, {"message": "The dashboard has been changed by someone else",
                             "status": "version-mismatch"}
            version = (cur["dashboard"]["version"] + 1) if cur else 1
            did = cur["dashboard"]["id"] if cur else next(self._ids)
            dash.update(id=did, version=version)
            slug = re.sub(r"[^a-z0-9]+", "-", dash["title"].lower()).strip("-")
            self.dashboards[uid] = {"dashboard": dash, "folderUid": folder, "slug": slug}
            return 200, {"id": did, "uid": uid, "url": f"/d/{uid}/{slug}", "status": "success",
                         "version": version, "title": slug, "folderUid": folder}
        if (g := m(r"/api/v1/provisioning/alert-rules/([^/]+)", path)) and method == "GET":
            r = self.rules.get(g[1])
            return (200, r) if r else (404, None)
        if path == "/api/v1/provisioning/alert-rules" and method == "POST":
            if body["uid"] in self.rules:
                return 400, {"message": "a rule with this uid already exists"}
            r = {"id": next(self._ids), **body, "provenance": "api", "updated": "2025-01-01T00:00:00Z"}
            self.rules[body["uid"]] = r
            return 201, r
        if (g := m(r"/api/v1/provisioning/alert-rules/([^/]+)", path)) and method == "PUT":
            if g[1] not in self.rules:
                return 400, {"message": "rule not found"}
            r = {"id": self.rules[g[1]]["id"], **body, "provenance": "api", "updated": "2025-01-01T00:01:00Z"}
            self.rules[g[1]] = r
            return 200, r
        if path == "/api/annotations" and method == "POST":
            a = {"id": next(self._ids), **body}
            self.annotations.append(a)
            return 200, {"id": a["id"], "message": "Annotation added"}
        if (g := m(r"/api/annotations/(\d+)", path)) and method == "PATCH":
            # Grafana's PatchAnnotation: only the fields given (text, tags, time, timeEnd) change
            a = next((x for x in self.annotations if x["id"] == int(g[1])), None)
            if a is None:
                return 404, {"message": "Annotation not found"}
            a.update({k: body[k] for k in ("text", "tags", "time", "timeEnd") if body.get(k) is not None})
            return 200, {"message": "Annotation patched"}
        return 404, {"message": "Not found"}


# ============================================================================ sample data
T_FIRST = 1_735_689_600 * 10**9               # 2025-01-01T00:00:00Z
T_DETECTED = T_FIRST + 48 * 10**9


def sample_alert(status: str = "firing", kind: str = "slow_rank"):
    from stepwatch.detectors.base import Alert
    return Alert(job="j1", kind=kind, status=status, step_first=40, step_detected=48, t_detected=T_DETECTED,
                 ranks=[13], nodes=["node-0001"], cause="computation", cost_pct=22.5,
                 suggestion="isolate slow nodes", evidence={"busy_ms": 1300.0})


# ============================================================================ fixtures
@pytest.fixture(scope="session")
def api_spec() -> ApiSpec:
    p = spec_path()
    if not p.exists():
        pytest.skip(f"needs Grafana's API spec shared/{SPEC_REL.as_posix()} (Grafana 11.4, Swagger 2.0): not found "
                    f"at {p}; clone the shared folder beside the repository or set STEPWATCH_SHARED")
    return ApiSpec(p)


@pytest.fixture(scope="session")
def optional_spec() -> ApiSpec | None:
    p = spec_path()
    return ApiSpec(p) if p.exists() else None


@pytest.fixture
def grafana(optional_spec):
    """A fake Grafana on a free loopback port; validates every exchange when the spec is present."""
    g = FakeGrafana(spec=optional_spec).start()
    yield g
    g.stop()
