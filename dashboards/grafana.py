"""Put stepwatch into a running Grafana through its HTTP API (``grafana-client``).

:func:`provision` creates or updates, in this order: the folder, the DuckDB datasource
(:mod:`.datasource`), the dashboards (:mod:`.build`) and one Grafana-managed alert rule per alert kind
(:mod:`.alerting`). It is idempotent: every object is read first and compared with what stepwatch
wants (what stepwatch sets must be there with the same value; fields Grafana adds are ignored), and
only a missing or different object is written — a second run issues GETs only.

Conflicts, as Grafana documents them:

* ``401`` -> :class:`GrafanaAuthError` naming the URL and where the token came from (never the token);
* ``403`` -> :class:`GrafanaError` saying which permission is missing;
* dashboard ``412`` ``version-mismatch`` (someone saved the dashboard since we read it) -> read again
  and save with ``overwrite`` (the dashboards are code; the log says a manual edit was replaced);
  ``412`` ``name-exists`` (another dashboard has the title in the folder) -> :class:`GrafanaConflictError`;
* folder ``409`` on create -> read again by uid (created meanwhile: fine) or
  :class:`GrafanaConflictError` (a folder with that title has another uid); folder ``409`` on update
  (stale version) -> retry with ``overwrite``;
* datasource ``409`` on create (the name is taken by a datasource with another uid) ->
  :class:`GrafanaConflictError`; a datasource provisioned from a file (``readOnly``) that differs ->
  :class:`GrafanaConflictError` telling to update the provisioning file instead.

The token is read from a file or an environment variable only (:func:`read_token`); it is sent as a
Bearer header and never logged or printed.
"""
from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from grafana_client import GrafanaApi
from grafana_client.client import (GrafanaClientError, GrafanaException, GrafanaServerError,
                                   GrafanaTimeoutError, GrafanaUnauthorizedError, TokenAuth)

from . import alerting, build
from .datasource import DATASOURCE_NAME, DATASOURCE_UID, PLUGIN_ID, datasource_model

log = logging.getLogger("stepwatch.grafana")

TOKEN_ENV = "STEPWATCH_GRAFANA_TOKEN"
TOKEN_FILE_ENV = "STEPWATCH_GRAFANA_TOKEN_FILE"
FOLDER_UID = "stepwatch"
FOLDER_TITLE = "stepwatch"
MESSAGE = "provisioned by stepwatch grafana provision"


class GrafanaError(RuntimeError):
    """Provisioning failed; the message says what and what to do."""


class GrafanaAuthError(GrafanaError):
    """Grafana rejected the credentials (401)."""


class GrafanaConflictError(GrafanaError):
    """An object stepwatch wants to own already exists in a form it must not overwrite."""


# ----------------------------------------------------------------------------- token
def read_token(token_file: str | os.PathLike | None = None, env: dict | None = None) -> tuple[str, str]:
    """``(token, source)`` from ``token_file``, else ``$STEPWATCH_GRAFANA_TOKEN_FILE``, else
    ``$STEPWATCH_GRAFANA_TOKEN``. ``source`` describes where it came from (for messages; it never
    contains the token). Raises :class:`GrafanaError` if none is set or the file is empty/unreadable."""
    env = os.environ if env is None else env
    path = token_file or env.get(TOKEN_FILE_ENV)
    if path:
        # the path is not echoed: a token pasted where a path belongs must not end up in a log
        src = "the token file given by " + ("--token-file" if token_file else f"${TOKEN_FILE_ENV}")
        try:
            tok = Path(path).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise GrafanaError(f"cannot read {src}: {e.strerror}") from None
        if not tok:
            raise GrafanaError(f"{src} is empty")
        return tok, src
    tok = (env.get(TOKEN_ENV) or "").strip()
    if tok:
        return tok, f"${TOKEN_ENV}"
    raise GrafanaError(f"no Grafana token: pass --token-file FILE or set ${TOKEN_FILE_ENV} or ${TOKEN_ENV} "
                       "(a service-account token with the Editor role, or Admin for datasources)")


class _FileToken(TokenAuth):
    """Bearer auth whose token comes from a :class:`stepwatch.secretfile.Reread` (read again when the
    file changes) at each request."""

    def __init__(self, reread):                      # no super().__init__: ``token`` is read, not stored
        self._reread = reread

    @property
    def token(self) -> str:
        return self._reread()


def token_file_auth(path: str, what: str) -> TokenAuth:
    """Bearer auth for requests from the token file ``path`` (named ``what`` in messages: the flag or
    variable): read now (:class:`GrafanaError` if it cannot be) and again whenever the file is replaced or
    rewritten, so a rotated token takes effect without a restart; a file other users can read is warned
    about (:mod:`stepwatch.secretfile`); a file found empty mid-rewrite keeps the token in use. Like
    :func:`read_token`'s errors, the logs name ``what``, not the path (a token pasted for a path)."""
    from stepwatch import secretfile

    def read(p):
        secretfile.check(p, what, show_path=False)
        return read_token(p)[0]
    return _FileToken(secretfile.Reread(path, read, what, errors=(GrafanaError,), show_path=False))


def make_api(url: str, token, timeout: float = 10.0) -> GrafanaApi:
    """A :class:`GrafanaApi` for ``url`` (``http(s)://host[:port][/sub-path]``) with Bearer ``token`` (a
    string, or :func:`token_file_auth`)."""
    if not url.startswith(("http://", "https://")):
        raise GrafanaError(f"Grafana URL {url!r} must start with http:// or https://")
    u = urlsplit(url)                 # grafana-client joins the sub-path and "api" without a slash
    url = urlunsplit(u._replace(path=u.path.rstrip("/") + "/"))
    return GrafanaApi.from_url(url, credential=token, timeout=timeout)


# ----------------------------------------------------------------------------- comparison
def contains(have, want) -> bool:
    """Whether ``have`` (what Grafana returned) carries everything in ``want`` (what we send):
    dicts by key (extra keys in ``have`` are ignored), lists element by element with equal length,
    scalars by equality (ints and floats compare by value)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and contains(have[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(map(contains, have, want))
    if isinstance(want, bool) or isinstance(have, bool):
        return have is want
    return have == want


def with_datasource_uid(obj, uid: str):
    """A copy of ``obj`` with every stepwatch datasource reference pointing at ``uid``."""
    if uid == DATASOURCE_UID:
        return obj
    if isinstance(obj, dict):
        out = {k: with_datasource_uid(v, uid) for k, v in obj.items()}
        if out.get("type") == PLUGIN_ID and out.get("uid") == DATASOURCE_UID:
            out["uid"] = uid
        if out.get("datasourceUid") == DATASOURCE_UID:
            out["datasourceUid"] = uid
        return out
    if isinstance(obj, list):
        return [with_datasource_uid(v, uid) for v in obj]
    return obj


# ----------------------------------------------------------------------------- result
@dataclass
class Change:
    kind: str       # folder | datasource | dashboard | alert-rule
    uid: str
    action: str     # created | updated | unchanged
    detail: str = ""

    def line(self) -> str:
        return f"{self.kind:<10} {self.uid:<24} {self.action}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class ProvisionResult:
    changes: list[Change] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(c.action != "unchanged" for c in self.changes)

    def summary(self) -> str:
        return "\n".join(c.line() for c in self.changes)


# ----------------------------------------------------------------------------- provisioner
class Provisioner:
    def __init__(self, api: GrafanaApi, url: str, token_source: str = "the token"):
        self.api = api
        self.url = url
        self.token_source = token_source

    # -- error translation
    def _call(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except GrafanaUnauthorizedError:
            raise GrafanaAuthError(
                f"{what}: Grafana at {self.url} answered 401 Unauthorized: it rejected {self.token_source}. "
                "Check that the token is valid and not expired (a service-account token, sent as Bearer)."
            ) from None
        except GrafanaTimeoutError as e:
            raise GrafanaError(f"{what}: Grafana at {self.url} did not answer in time ({e.message})") from None
        except GrafanaClientError as e:
            if e.status_code == 403:
                raise GrafanaError(
                    f"{what}: Grafana at {self.url} answered 403 Forbidden: {_msg(e)}. The token's service "
                    "account needs the Editor role (folders, dashboards, alert rules) and Admin (datasources)."
                ) from None
            raise
        except GrafanaServerError as e:
            raise GrafanaError(f"{what}: Grafana at {self.url} answered {e.status_code}: {_msg(e)}") from None
        except OSError as e:      # the HTTP library's connection errors and timeouts are OSErrors
            raise GrafanaError(f"{what}: cannot reach Grafana at {self.url}: {type(e).__name__}") from None
        except GrafanaException as e:
            raise GrafanaError(f"{what}: request to Grafana at {self.url} failed: {e.message}") from None

    def _get(self, what: str, fn, *args):
        """The object, or None on 404."""
        try:
            return self._call(what, fn, *args)
        except GrafanaClientError as e:
            if e.status_code == 404:
                return None
            raise GrafanaError(f"{what}: Grafana answered {e.status_code}: {_msg(e)}") from None

    # -- objects
    def folder(self, uid: str, title: str) -> Change:
        what = f"folder {uid!r}"
        have = self._get(what, self.api.folder.get_folder, uid)
        if have is None:
            try:
                self._call(what, self.api.folder.create_folder, title, uid=uid)
                return Change("folder", uid, "created")
            except GrafanaClientError as e:
                if e.status_code != 409:
                    raise GrafanaError(f"{what}: create failed with {e.status_code}: {_msg(e)}") from None
                have = self._get(what, self.api.folder.get_folder, uid)
                if have is None:
                    raise GrafanaConflictError(
                        f"{what}: Grafana answered 409 Conflict ({_msg(e)}): a folder titled {title!r} probably "
                        f"exists with another uid. Rename or delete it, or pass --folder-uid with its uid."
                    ) from None
        if have.get("title") == title:
            return Change("folder", uid, "unchanged")
        try:
            self._call(what, self.api.folder.update_folder, uid, title=title, version=have.get("version"))
        except GrafanaClientError as e:
            if e.status_code not in (409, 412):
                raise GrafanaError(f"{what}: update failed with {e.status_code}: {_msg(e)}") from None
            log.warning("%s changed since it was read (%s); overwriting", what, e.status_code)
            self._call(what, self.api.folder.update_folder, uid, title=title, overwrite=True)
        return Change("folder", uid, "updated", f"title {have.get('title')!r} -> {title!r}")

    def datasource(self, want: dict) -> Change:
        uid = want["uid"]
        what = f"datasource {uid!r}"
        have = self._get(what, self.api.datasource.get_datasource_by_uid, uid)
        if have is None:
            try:
                self._call(what, self.api.datasource.create_datasource, want)
            except GrafanaClientError as e:
                if e.status_code == 409:
                    raise GrafanaConflictError(
                        f"{what}: Grafana answered 409 Conflict ({_msg(e)}): a datasource named "
                        f"{want['name']!r} already exists with another uid. Delete or rename it, or pass "
                        "--datasource-name / --datasource-uid to use other ones.") from None
                raise GrafanaError(f"{what}: create failed with {e.status_code}: {_msg(e)}") from None
            return Change("datasource", uid, "created")
        if contains(have, want):
            return Change("datasource", uid, "unchanged")
        if have.get("readOnly"):
            raise GrafanaConflictError(
                f"{what} is provisioned from a file in Grafana (read-only) and differs from what stepwatch "
                "wants: update that provisioning file (`stepwatch grafana export`) instead.")
        self._call(what, self.api.datasource.update_datasource_by_uid, uid, want)
        return Change("datasource", uid, "updated", _diff_keys(have, want))

    def dashboard(self, dash: dict, folder_uid: str) -> Change:
        uid = dash["uid"]
        what = f"dashboard {uid!r}"
        have = self._get(what, self.api.dashboard.get_dashboard, uid)
        if have is not None:
            cur = have.get("dashboard") or {}
            if contains(cur, dash) and (have.get("meta") or {}).get("folderUid", folder_uid) == folder_uid:
                return Change("dashboard", uid, "unchanged")
        body = {"dashboard": dict(dash), "folderUid": folder_uid, "overwrite": False, "message": MESSAGE}
        if have is not None and isinstance((have.get("dashboard") or {}).get("version"), int):
            body["dashboard"]["version"] = have["dashboard"]["version"]
        try:
            self._call(what, self.api.dashboard.update_dashboard, body)
        except GrafanaClientError as e:
            status = _status(e)
            if e.status_code == 412 and status == "version-mismatch":
                log.warning("%s was saved in Grafana since it was read; replacing it with the generated one", what)
                body = {"dashboard": dict(dash), "folderUid": folder_uid, "overwrite": True, "message": MESSAGE}
                self._call(what, self.api.dashboard.update_dashboard, body)
            elif e.status_code == 412:
                raise GrafanaConflictError(
                    f"{what}: Grafana answered 412 Precondition Failed ({status or 'no status'}: {_msg(e)}). "
                    f"Another dashboard titled {dash['title']!r} probably exists in the folder: rename or "
                    "delete it.") from None
            else:
                raise GrafanaError(f"{what}: save failed with {e.status_code}: {_msg(e)}") from None
        return Change("dashboard", uid, "created" if have is None else "updated")

    def alert_rule(self, rule: dict) -> Change:
        uid = rule["uid"]
        what = f"alert rule {uid!r}"
        have = self._get(what, self.api.alertingprovisioning.get_alertrule, uid)
        if have is None:
            try:
                self._call(what, self.api.alertingprovisioning.create_alertrule, rule)
            except GrafanaClientError as e:
                raise GrafanaError(f"{what}: create failed with {e.status_code}: {_msg(e)}") from None
            return Change("alert-rule", uid, "created")
        if contains(have, rule):
            return Change("alert-rule", uid, "unchanged")
        try:
            self._call(what, self.api.alertingprovisioning.update_alertrule, uid, rule)
        except GrafanaClientError as e:
            raise GrafanaError(f"{what}: update failed with {e.status_code}: {_msg(e)}") from None
        return Change("alert-rule", uid, "updated", _diff_keys(have, rule))


def _msg(e: GrafanaException) -> str:
    r = getattr(e, "response", None)
    if isinstance(r, dict) and r.get("message"):
        return str(r["message"])
    return str(getattr(e, "message", "") or e)


def _status(e: GrafanaException) -> str:
    r = getattr(e, "response", None)
    return str(r.get("status") or "") if isinstance(r, dict) else ""


def _diff_keys(have: dict, want: dict) -> str:
    keys = [k for k, v in want.items() if not contains(have.get(k), v)]
    return "differs in " + ", ".join(keys) if keys else ""


# ----------------------------------------------------------------------------- entry point
def provision(url: str, token: str, data_root: str, *, folder_uid: str = FOLDER_UID,
              folder_title: str = FOLDER_TITLE, datasource_uid: str = DATASOURCE_UID,
              datasource_name: str = DATASOURCE_NAME, org_id: int = 1, alert_rules: bool = True,
              timeout: float = 10.0, token_source: str = "the token", api: GrafanaApi | None = None,
              snapshot_dir: str | None = None) -> ProvisionResult:
    """Create or update the folder, datasource, dashboards and alert rules in the Grafana at ``url``.

    ``data_root`` is the Parquet store's root *as Grafana sees it* (it becomes the datasource's
    initSql); with ``snapshot_dir`` the datasource reads that published snapshot instead (recommended:
    docs/grafana.md §1). ``token`` is a Grafana service-account token (see :func:`read_token`). Returns what was
    created, updated or left unchanged; raises :class:`GrafanaError` (or a subclass) with a clear
    message on failure.
    """
    api = api or make_api(url, token, timeout)
    p = Provisioner(api, url, token_source)
    res = ProvisionResult()
    res.changes.append(p.folder(folder_uid, folder_title))
    res.changes.append(p.datasource(datasource_model(data_root, uid=datasource_uid, name=datasource_name,
                                                    snapshot_dir=snapshot_dir)))
    for dash in build.build_all().values():
        res.changes.append(p.dashboard(with_datasource_uid(copy.deepcopy(dash), datasource_uid), folder_uid))
    if alert_rules:
        for rule in alerting.alert_rules(folder_uid=folder_uid, datasource_uid=datasource_uid, org_id=org_id):
            res.changes.append(p.alert_rule(rule))
    for c in res.changes:
        log.info("%s", c.line())
    return res
