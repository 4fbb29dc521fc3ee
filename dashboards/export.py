"""``stepwatch grafana export``: everything Grafana needs, as files (e.g. for Helm ConfigMaps).

One flat directory (file names are valid ConfigMap keys):

* ``<dashboard uid>.json`` — one per dashboard (for a ConfigMap labelled ``grafana_dashboard: "1"``,
  or a file dashboard provider);
* ``datasources.yaml`` — Grafana datasource provisioning: the DuckDB datasource with the views over
  the data root as Grafana sees it (``grafana_datasource: "1"``);
* ``alert-rules.yaml`` — Grafana alerting provisioning: one rule per alert kind (``grafana_alert: "1"``);
* ``dashboards-provider.yaml`` — a dashboard provider reading the JSON files from
  ``--dashboards-path`` into the stepwatch folder (when not using the sidecar).
"""
from __future__ import annotations

import copy
from pathlib import Path

from . import alerting, build, datasource, yamlout
from .grafana import FOLDER_TITLE, FOLDER_UID, with_datasource_uid

DEFAULT_DATA_ROOT = "/var/lib/stepwatch/data"
DEFAULT_DASHBOARDS_PATH = "/var/lib/grafana/dashboards/stepwatch"
#: where the Helm chart's publisher writes the snapshot and Grafana mounts it (the chart substitutes
#: ``<grafana.snapshot.mountPath>/snapshot`` for this path in the datasource it embeds)
DEFAULT_SNAPSHOT_DIR = "/var/lib/stepwatch/grafana/snapshot"


def provider_doc(folder_title: str, folder_uid: str, path: str) -> dict:
    return {"apiVersion": 1, "providers": [{
        "name": "stepwatch", "orgId": 1, "folder": folder_title, "folderUid": folder_uid, "type": "file",
        "disableDeletion": False, "allowUiUpdates": False, "updateIntervalSeconds": 30,
        "options": {"path": path, "foldersFromFilesStructure": False}}]}


def export(out_dir: str | Path, data_root: str = DEFAULT_DATA_ROOT, *, folder_uid: str = FOLDER_UID,
           folder_title: str = FOLDER_TITLE, datasource_uid: str = datasource.DATASOURCE_UID,
           datasource_name: str = datasource.DATASOURCE_NAME,
           dashboards_path: str = DEFAULT_DASHBOARDS_PATH, snapshot_dir: str | None = None) -> list[Path]:
    """Write the files into ``out_dir`` (created if needed); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    for uid, dash in build.build_all().items():
        files[f"{uid}.json"] = build.render(with_datasource_uid(copy.deepcopy(dash), datasource_uid))
    files["datasources.yaml"] = datasource.provisioning_file(data_root, uid=datasource_uid, name=datasource_name,
                                                            snapshot_dir=snapshot_dir)
    files["alert-rules.yaml"] = alerting.provisioning_file(folder_title=folder_title, folder_uid=folder_uid,
                                                          datasource_uid=datasource_uid)
    files["dashboards-provider.yaml"] = yamlout.dumps(provider_doc(folder_title, folder_uid, dashboards_path),
                                                      header="stepwatch dashboards from files (generated).")
    paths = []
    for name, text in files.items():
        p = out / name
        tmp = p.with_name(f".{name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(p)
        paths.append(p)
    return paths
