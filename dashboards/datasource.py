"""The Grafana datasource stepwatch's dashboards and alert rules read from.

Two kinds. **Snapshot** (``snapshot_dir=``, :mod:`.snapshot`): the datasource opens the snapshot that
``stepwatch grafana publish`` writes, read-only, with no extension and no file but the snapshot's
data: a panel's SQL reaches the views and nothing else. **Lake** (the older default, below): the
datasource attaches the lake itself, which needs the catalog's extension, and with it any panel's SQL
can ``sqlite_scan`` any readable file, write the catalog, or (PostgreSQL) connect to any host.

The lake kind:
One DuckDB datasource of the ``motherduck-duckdb-datasource`` plugin, in memory (``jsonData.path``
empty), whose ``initSql`` is :func:`stepwatch.storage.views.view_sql` over the lake *as Grafana sees
it* (paths inside the Grafana container, which may differ from the processor's), locked down:

1. load the extensions from ``ext_dir`` (``/var/lib/stepwatch/duckdb-extensions``; the Helm chart
   never uses this kind: it gives Grafana only the snapshot);
2. ``allowed_directories`` = the lake's data path, ``allowed_paths`` = its SQLite catalog,
   ``enable_external_access = false``, extension auto-install/auto-load off, ``lock_configuration = true``;
3. only then attach the lake READ_ONLY and define the views.

So a Grafana editor's SQL sees the same views as ``stepwatch sql`` and nothing else: no other file
read or written (``read_text('/etc/passwd')`` fails), no extension loaded, no setting undone. With
data on S3 the secret's keys are ``${AWS_ACCESS_KEY_ID}`` / ``${AWS_SECRET_ACCESS_KEY}``, which
Grafana expands from its environment when it reads a provisioning file.

Two ways to install it, with the same content: :func:`datasource_model` is the body for
``POST /api/datasources`` / ``PUT /api/datasources/uid/{uid}`` (see :mod:`.grafana`), and
:func:`provisioning_file` is a Grafana provisioning file (``provisioning/datasources/*.yaml``,
or a ConfigMap picked up by the Grafana Helm chart's sidecar).
"""
from __future__ import annotations

import os
from pathlib import PurePosixPath

from stepwatch.storage.lake import S3, Lake
from stepwatch.storage.views import view_sql

from . import yamlout

#: where the Grafana pod finds the DuckDB extensions (``<dir>/v<version>/<platform>/*.duckdb_extension``)
GRAFANA_EXT_DIR = os.environ.get("STEPWATCH_GRAFANA_EXTENSIONS", "/var/lib/stepwatch/duckdb-extensions")

PLUGIN_ID = "motherduck-duckdb-datasource"
DATASOURCE_UID = "stepwatch-duckdb"
DATASOURCE_NAME = "stepwatch"
DS_REF = {"type": PLUGIN_ID, "uid": DATASOURCE_UID}


def grafana_lake(data_root: str, catalog: str | None = None, data_path: str | None = None) -> Lake:
    """The lake as Grafana sees it: by default the embedded layout under ``data_root`` (SQLite
    catalog ``lake.sqlite``, data ``lake/``); ``catalog`` (``postgres:...``, best a read-only role)
    and ``data_path`` (``s3://...`` or a mount) for the other set-ups (defaults:
    ``$STEPWATCH_GRAFANA_LAKE_CATALOG``, ``$STEPWATCH_GRAFANA_LAKE_DATA_PATH``)."""
    root = str(data_root)
    if not PurePosixPath(root).is_absolute():
        raise ValueError(f"data root {root!r} must be an absolute path as seen by Grafana "
                         "(e.g. /var/lib/stepwatch/data)")
    base = Lake.from_dir(root, env={})
    catalog = catalog or os.environ.get("STEPWATCH_GRAFANA_LAKE_CATALOG")      # (the chart's provision Job)
    dp = data_path or os.environ.get("STEPWATCH_GRAFANA_LAKE_DATA_PATH") or base.data_path
    s3 = S3.from_env({k: v for k, v in os.environ.items() if k.startswith("STEPWATCH_S3_")}) \
        if dp.startswith("s3://") else None
    return Lake.make(catalog or base.catalog, dp, s3)


def init_sql(data_root: str, *, catalog: str | None = None, data_path: str | None = None,
             ext_dir: str | None = GRAFANA_EXT_DIR) -> str:
    """The datasource's initSql: lockdown, then the view definitions over the lake (as Grafana sees it)."""
    return view_sql(grafana_lake(data_root, catalog, data_path), ext_dir=ext_dir, lockdown=True,
                    s3_keys_from_env=True)


def json_data(data_root: str | None, snapshot_dir: str | None = None, **lake) -> dict:
    """``jsonData``: with ``snapshot_dir`` the published snapshot, read-only, locked, no lake
    (:mod:`.snapshot`: what Grafana should use); else the lake itself through the catalog's extension
    (``init_sql``: any panel SQL can then read and write the catalog, see docs/grafana.md)."""
    if snapshot_dir:
        from .snapshot import datasource_path, lockdown_sql
        return {"path": datasource_path(snapshot_dir), "initSql": lockdown_sql(snapshot_dir)}
    return {"path": "", "initSql": init_sql(data_root, **lake)}


def datasource_model(data_root: str | None, *, uid: str = DATASOURCE_UID, name: str = DATASOURCE_NAME,
                     snapshot_dir: str | None = None, **lake) -> dict:
    """The datasource as the HTTP API takes it (``AddDataSourceCommand``)."""
    return {
        "uid": uid,
        "name": name,
        "type": PLUGIN_ID,
        "access": "proxy",
        "url": "",
        "isDefault": False,
        "jsonData": json_data(data_root, snapshot_dir, **lake),
    }


def provisioning_doc(data_root: str | None, *, uid: str = DATASOURCE_UID, name: str = DATASOURCE_NAME,
                     org_id: int = 1, snapshot_dir: str | None = None, **lake) -> dict:
    m = datasource_model(data_root, uid=uid, name=name, snapshot_dir=snapshot_dir, **lake)
    entry = {"name": m["name"], "uid": m["uid"], "type": m["type"], "access": m["access"], "orgId": org_id,
             "isDefault": False, "editable": False, "jsonData": m["jsonData"]}
    return {"apiVersion": 1, "datasources": [entry]}


def provisioning_file(data_root: str | None, **kw) -> str:
    """Grafana datasource provisioning YAML for the stepwatch datasource."""
    if kw.get("snapshot_dir"):
        return yamlout.dumps(provisioning_doc(data_root, **kw), header=(
            "stepwatch DuckDB datasource (generated by `stepwatch grafana export`; do not edit).\n"
            "Reads the snapshot `stepwatch grafana publish` writes into "
            f"{kw['snapshot_dir']} (same path on both sides),\n"
            "read-only and locked: no lake, no extension, no other file (docs/grafana.md)."))
    return yamlout.dumps(provisioning_doc(data_root, **kw), header=(
        "stepwatch DuckDB datasource (generated by `stepwatch grafana export`; do not edit).\n"
        "Needs the motherduck-duckdb-datasource plugin (DuckDB 1.4) and the DuckDB extensions under\n"
        f"{GRAFANA_EXT_DIR}; initSql = stepwatch.dashboards.datasource.init_sql({data_root!r}"
        + "".join(f", {k}={v!r}" for k, v in kw.items() if k in ("catalog", "data_path")) + ")."))
