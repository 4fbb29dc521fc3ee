"""``stepwatch grafana …`` subcommands; :func:`register` adds them to the main parser.

    stepwatch grafana provision --url URL [--token-file FILE] --data-root DIR
    stepwatch grafana export --out DIR [--data-root DIR | --snapshot-dir DIR]
    stepwatch grafana publish --data-dir DIR --snapshot-dir DIR [--every S] [--once]

The Grafana token comes from ``--token-file``, ``$STEPWATCH_GRAFANA_TOKEN_FILE`` or
``$STEPWATCH_GRAFANA_TOKEN``; there is deliberately no flag that takes the token itself.
"""
from __future__ import annotations

import argparse
import os
import sys

from .datasource import DATASOURCE_NAME, DATASOURCE_UID
from .export import DEFAULT_DASHBOARDS_PATH, DEFAULT_DATA_ROOT
from .grafana import FOLDER_TITLE, FOLDER_UID, TOKEN_ENV, TOKEN_FILE_ENV

URL_ENV = "STEPWATCH_GRAFANA_URL"
DATA_ROOT_ENV = "STEPWATCH_GRAFANA_DATA_ROOT"
SNAPSHOT_ENV = "STEPWATCH_GRAFANA_SNAPSHOT_DIR"


class _NoTokenFlag(argparse.Action):
    """``--token VALUE`` is refused without echoing VALUE (and keeps argparse from reading it as an
    abbreviation of ``--token-file``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"the Grafana token is never taken on the command line: put it in a file and pass "
                     f"--token-file FILE, or set ${TOKEN_FILE_ENV} or ${TOKEN_ENV}")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--folder-uid", default=FOLDER_UID, help=f"Grafana folder uid (default {FOLDER_UID})")
    p.add_argument("--folder-title", default=FOLDER_TITLE, help=f"Grafana folder title (default {FOLDER_TITLE})")
    p.add_argument("--datasource-uid", default=DATASOURCE_UID, help=f"default {DATASOURCE_UID}")
    p.add_argument("--datasource-name", default=DATASOURCE_NAME, help=f"default {DATASOURCE_NAME}")


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``grafana provision`` and ``grafana export`` to ``subparsers`` (from ``add_subparsers``)."""
    g = subparsers.add_parser("grafana", help="put stepwatch's dashboards, datasource and alert rules into Grafana",
                              description="Grafana integration: provision over the HTTP API, or export files.")
    gs = g.add_subparsers(dest="grafana_cmd", metavar="ACTION")
    g.set_defaults(func=lambda a: (g.print_help(), 2)[1])

    p = gs.add_parser("provision", allow_abbrev=False,
                      help="create/update folder, datasource, dashboards and alert rules (idempotent)")
    p.add_argument("--url", default=os.environ.get(URL_ENV),
                   help=f"Grafana base URL, e.g. http://grafana:3000 (or ${URL_ENV})")
    p.add_argument("--token-file", default=None,
                   help=f"file holding a Grafana service-account token (or ${TOKEN_FILE_ENV} / ${TOKEN_ENV})")
    p.add_argument("--token", nargs="?", action=_NoTokenFlag, help=argparse.SUPPRESS)
    p.add_argument("--data-root", default=os.environ.get(DATA_ROOT_ENV),
                   help=f"the Parquet store root as Grafana sees it (absolute path; or ${DATA_ROOT_ENV})")
    _snapshot_arg(p)
    _common(p)
    p.add_argument("--org-id", type=int, default=1)
    p.add_argument("--no-alert-rules", action="store_true", help="skip the Grafana-managed alert rules")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")
    p.set_defaults(func=cmd_provision)

    e = gs.add_parser("export", allow_abbrev=False,
                      help="write dashboards and provisioning files (ConfigMap-ready) into a directory")
    e.add_argument("--out", required=True, help="directory to write into")
    e.add_argument("--data-root", default=os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT,
                   help=f"the Parquet store root as Grafana sees it (default {DEFAULT_DATA_ROOT})")
    e.add_argument("--dashboards-path", default=DEFAULT_DASHBOARDS_PATH,
                   help="where Grafana will find the dashboard JSON files (for dashboards-provider.yaml)")
    _snapshot_arg(e)
    _common(e)
    e.set_defaults(func=cmd_export)

    pb = gs.add_parser("publish", allow_abbrev=False,
                       help="write the read-only snapshot of the views that Grafana's datasource opens")
    pb.add_argument("--data-dir", required=True, help="the lake's data dir (STEPWATCH_LAKE_* as for the processor)")
    pb.add_argument("--snapshot-dir", required=True,
                    help="where to write it: Grafana must see it at the same absolute path, read-only")
    pb.add_argument("--every", type=float, default=10.0, help="seconds between publishes (default 10)")
    pb.add_argument("--window-days", type=float, default=7.0,
                    help="rows older than this (by event time) are left out; 0: all (default 7)")
    pb.add_argument("--once", action="store_true", help="publish once and exit")
    pb.set_defaults(func=cmd_publish)
    return g


def _snapshot_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--snapshot-dir", default=os.environ.get(SNAPSHOT_ENV),
                   help="the datasource reads the snapshot `stepwatch grafana publish` writes there (absolute, "
                        f"as Grafana sees it; or ${SNAPSHOT_ENV}) instead of attaching the lake: recommended, "
                        "Grafana's SQL then reaches only the views")


def add_annotation_args(p: argparse.ArgumentParser) -> None:
    """Flags for a process that posts its alerts to Grafana as annotations (``stepwatch process``)."""
    p.add_argument("--grafana-url", default=None,
                   help="post every alert to this Grafana as an annotation (token: --grafana-token-file, "
                        f"${TOKEN_FILE_ENV} or ${TOKEN_ENV})")
    p.add_argument("--grafana-token-file", default=None, help="file holding the Grafana token")
    p.add_argument("--grafana-token", nargs="?", action=_NoTokenFlag, help=argparse.SUPPRESS)


def annotation_sink_from_args(a, registry=None):
    """An :class:`~.annotations.AnnotationSink` from :func:`add_annotation_args` flags, or None when
    ``--grafana-url`` is not given. Raises :class:`~.grafana.GrafanaError` if there is no token."""
    if not getattr(a, "grafana_url", None):
        return None
    from .annotations import AnnotationSink
    from .grafana import TOKEN_FILE_ENV, read_token, token_file_auth
    path = a.grafana_token_file or os.environ.get(TOKEN_FILE_ENV)
    if path:                          # read again when it changes: a rotated token needs no restart
        token = token_file_auth(path, "--grafana-token-file" if a.grafana_token_file else TOKEN_FILE_ENV)
    else:
        token, _ = read_token()
    return AnnotationSink(a.grafana_url, token, registry=registry)


LAKE_DATASOURCE_WARNING = (
    "warning: without --snapshot-dir the datasource attaches the lake itself, with the catalog's "
    "extension: any panel's SQL can then read files Grafana can read (sqlite_scan of grafana.db), "
    "ATTACH the catalog and rewrite it, overwrite data files, and (PostgreSQL) connect to any host. "
    "Run `stepwatch grafana publish --data-dir DIR --snapshot-dir SNAP` and pass --snapshot-dir SNAP "
    f"(or set ${SNAPSHOT_ENV}): Grafana then reads only the views (docs/grafana.md, section 1)")


def _warn_lake_datasource(cmd: str, a) -> None:
    if not a.snapshot_dir:
        print(f"stepwatch grafana {cmd}: {LAKE_DATASOURCE_WARNING}", file=sys.stderr, flush=True)


def cmd_provision(a) -> int:
    from .grafana import GrafanaError, provision, read_token
    if not a.url:
        print(f"stepwatch grafana provision: give --url (or set ${URL_ENV})", file=sys.stderr)
        return 2
    if not a.data_root and not a.snapshot_dir:
        print(f"stepwatch grafana provision: give --snapshot-dir (or set ${SNAPSHOT_ENV}) or --data-root "
              f"(or set ${DATA_ROOT_ENV}): the snapshot dir or the store root as Grafana sees it", file=sys.stderr)
        return 2
    _warn_lake_datasource("provision", a)
    try:
        token, source = read_token(a.token_file)
        res = provision(a.url, token, a.data_root, folder_uid=a.folder_uid, folder_title=a.folder_title,
                        datasource_uid=a.datasource_uid, datasource_name=a.datasource_name, org_id=a.org_id,
                        alert_rules=not a.no_alert_rules, timeout=a.timeout, token_source=source,
                        snapshot_dir=a.snapshot_dir)
    except (GrafanaError, ValueError) as e:
        print(f"stepwatch grafana provision: {e}", file=sys.stderr)
        return 1
    print(res.summary())
    print("changed" if res.changed else "nothing to change")
    return 0


def cmd_export(a) -> int:
    from .export import export
    _warn_lake_datasource("export", a)
    try:
        paths = export(a.out, a.data_root, folder_uid=a.folder_uid, folder_title=a.folder_title,
                       datasource_uid=a.datasource_uid, datasource_name=a.datasource_name,
                       dashboards_path=a.dashboards_path, snapshot_dir=a.snapshot_dir)
    except (OSError, ValueError) as e:
        print(f"stepwatch grafana export: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


def cmd_publish(a) -> int:
    import signal
    import threading

    from .snapshot import Publisher
    pub = Publisher(a.data_dir, a.snapshot_dir, every_s=a.every, window_s=a.window_days * 86400)
    try:
        r = pub.publish_once()
    except (OSError, ValueError, RuntimeError) as e:
        print(f"stepwatch grafana publish: {e}", file=sys.stderr)
        return 1
    print(f"published {sum(r.rows.values())} rows in {r.seconds:.2f}s to {a.snapshot_dir}", flush=True)
    if a.once:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(a.every):
        try:
            pub.publish_once()
        except Exception as e:              # noqa: BLE001 - Grafana keeps the previous snapshot
            print(f"stepwatch grafana publish: {e} (keeping the previous snapshot)", file=sys.stderr, flush=True)
    return 0
