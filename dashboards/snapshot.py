"""The Grafana snapshot: what Grafana's DuckDB connection reads instead of the lake (docs/grafana.md §1).

A connection that attaches the lake needs the catalog's extension (``sqlite`` / ``postgres``) and
file access to the catalog and the data path. Whatever SQL a Grafana editor types then runs with
those: ``sqlite_scan`` of any file, ``ATTACH`` of the catalog and a write to it, ``postgres_scan`` of
any host. So Grafana never attaches the lake. A publisher (``stepwatch grafana publish``, or
:class:`Publisher` in a process that has the lake) copies the views' rows, every ``every_s`` seconds,
from one snapshot of the lake into a directory only it writes::

    <snapshot dir>/stepwatch.duckdb        the view definitions only (written once, mode 0444)
    <snapshot dir>/data/<table>.parquet    one file per table, replaced atomically (mode 0444)

Grafana's datasource opens ``stepwatch.duckdb`` itself, ``access_mode=READ_ONLY``, as its main
database (:func:`datasource_path`), then :func:`lockdown_sql` allows only ``data/`` and locks the
configuration. What that connection can do:

* read the views (each query opens the newest ``data/*.parquet``: no reconnect needed);
* no extension is loaded, none can be (``autoload``/``autoinstall`` off, external access off):
  no ``sqlite_scan``, ``postgres_scan``, ``httpfs``, no network;
* no file outside ``data/`` is read or written; no database is attached (the main one is
  read-only, so neither a new file nor ``:memory:``); no view is replaced (read-only catalog); no
  setting is changed, ``lock_configuration`` included;
* ``data/`` itself is readable by DuckDB's settings and *written* only by the publisher: its files
  and the directory are read-only (0444 / 0555) and Grafana runs as another user (or mounts it
  read-only), so the operating system refuses a ``COPY … TO 'data/…'``. DuckDB has no read-only
  variant of ``allowed_directories``.

Latency to queryable: one publish period plus the copy. Cost: every publish rewrites each table's
rows in the window (``window_s``, default 7 days, by the table's event time), so it grows with the
window, not with the lake; see docs/grafana.md for figures.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import duckdb

from stepwatch.storage.lake import lit
from stepwatch.storage.store import JOBS, TABLES, TIME_COLUMN
from stepwatch.storage.views import DERIVED_VIEWS
from stepwatch.storage.views import connect as views_connect

log = logging.getLogger("stepwatch.grafana.snapshot")

DB_FILE = "stepwatch.duckdb"
DATA_DIR = "data"
#: the tables Grafana sees (not ``kafka_offsets``: consumer positions are no dashboard's business)
SNAPSHOT_TABLES = TABLES + (JOBS,)
DEFAULT_WINDOW_S = 7 * 86400
DEFAULT_EVERY_S = 10.0

#: set at open (the datasource path's DSN parameters): the main database is read-only from the start
OPEN_CONFIG = {"access_mode": "READ_ONLY"}


def _abs(d: str) -> str:
    d = str(d)
    if not PurePosixPath(d).is_absolute():
        raise ValueError(f"snapshot dir {d!r} must be an absolute path as seen by Grafana "
                         "(e.g. /var/lib/stepwatch/grafana)")
    return d.rstrip("/")


def datasource_path(snapshot_dir: str) -> str:
    """The datasource's ``jsonData.path``: the views file, opened read-only (go-duckdb passes the DSN
    parameters to DuckDB's configuration before the database is opened)."""
    return f"{_abs(snapshot_dir)}/{DB_FILE}?" + "&".join(f"{k}={v}" for k, v in OPEN_CONFIG.items())


def lockdown_sql(snapshot_dir: str) -> str:
    """The datasource's ``initSql`` (run once, after the plugin's own settings): only ``data/`` may be
    read, no temp files, no extension, then the configuration is locked."""
    data = f"{_abs(snapshot_dir)}/{DATA_DIR}/"
    return "\n".join([
        f"SET allowed_directories = [{lit(data)}];",
        "SET temp_directory = '';",
        "SET enable_external_access = false;",
        "SET autoinstall_known_extensions = false;",
        "SET autoload_known_extensions = false;",
        "SET allow_community_extensions = false;",
        "SET lock_configuration = true;",
    ])


def views_file_sql(data_dir: str) -> list[str]:
    """The statements of ``stepwatch.duckdb``: one view per table over its Parquet file (as Grafana
    sees it), plus the derived views of :mod:`stepwatch.storage.views`."""
    out = [f"CREATE OR REPLACE VIEW {t} AS SELECT * FROM read_parquet({lit(f'{data_dir}/{t}.parquet')});"
           for t in SNAPSHOT_TABLES]
    return out + list(DERIVED_VIEWS)


def _make_writable(p: Path) -> None:
    os.chmod(p, 0o755)


def _read_only(p: Path, mode: int) -> None:
    os.chmod(p, mode)


@dataclass
class PublishResult:
    rows: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def publish(root, out_dir: str | Path, window_s: float = DEFAULT_WINDOW_S,
            now_s: float | None = None) -> PublishResult:
    """Copy the views' rows of one lake snapshot into ``out_dir`` (see the module doc), which Grafana
    must see at the same absolute path (the views name their files by it). ``window_s``: rows whose
    event time is older are left out (0: all). Returns the rows per table."""
    t0 = time.monotonic()
    out = Path(out_dir).absolute()
    seen = _abs(str(out))
    data = out / DATA_DIR
    out.mkdir(parents=True, exist_ok=True)
    _make_writable(out)
    data.mkdir(exist_ok=True)
    _make_writable(data)
    res = PublishResult()
    try:
        con = views_connect(root)
        try:
            con.execute("BEGIN")                  # one lake snapshot for every table
            cutoff = (now_s if now_s is not None else time.time()) - window_s
            for t in SNAPSHOT_TABLES:
                tcol = TIME_COLUMN.get(t)
                where = ""
                if window_s and tcol and tcol != "_received":
                    where = f" WHERE {tcol} >= to_timestamp({cutoff:.6f})"
                tmp = data / f".{t}.parquet.tmp"
                n = con.execute(f"COPY (SELECT * FROM {t}{where}) TO {lit(str(tmp))} "
                                "(FORMAT parquet, COMPRESSION zstd)").fetchone()[0]
                res.rows[t] = int(n)
                _read_only(tmp, 0o444)
                os.replace(tmp, data / f"{t}.parquet")   # a query open on the old file keeps reading it
            con.execute("COMMIT")
        finally:
            con.close()
        db = out / DB_FILE
        stray = out / (DB_FILE + ".wal")          # only a writer of the snapshot could have put it there
        if stray.exists():
            log.warning("removing %s: the views file is never written after it is published", stray)
            stray.unlink()
        if not db.exists() or _views_of(db) != views_file_sql(f"{seen}/{DATA_DIR}"):
            _write_views(db, f"{seen}/{DATA_DIR}")
    finally:
        _read_only(data, 0o555)
        _read_only(out, 0o555)
    res.seconds = time.monotonic() - t0
    return res


def _views_of(db: Path) -> list[str] | None:
    try:
        c = duckdb.connect(str(db), read_only=True)
    except duckdb.Error:
        return None
    try:
        got = c.execute("SELECT value FROM stepwatch_views ORDER BY i").fetchall()
        return [r[0] for r in got]
    except duckdb.Error:
        return None
    finally:
        c.close()


def _write_views(db: Path, data_dir: str) -> None:
    """Write the views file beside the data (DuckDB binds a view when it is created: the Parquet files
    must be there, at the path Grafana reads them from)."""
    tmp = db.with_name(f".{db.name}.tmp")
    for p in (tmp, tmp.with_name(tmp.name + ".wal")):
        if p.exists():
            p.unlink()
    stmts = views_file_sql(data_dir)
    c = duckdb.connect(str(tmp))
    try:
        c.execute("CREATE TABLE stepwatch_views (i INTEGER, value VARCHAR)")
        c.executemany("INSERT INTO stepwatch_views VALUES (?, ?)", list(enumerate(stmts)))
        for s in stmts:
            c.execute(s)
        c.execute("CHECKPOINT")
    finally:
        c.close()
    os.chmod(tmp, 0o444)
    os.replace(tmp, db)


class Publisher:
    """Publishes every ``every_s`` seconds on a daemon thread until :meth:`close`; a failed publish is
    logged and retried at the next period (what Grafana shows is then the previous snapshot)."""

    def __init__(self, root, out_dir, every_s: float = DEFAULT_EVERY_S, window_s: float = DEFAULT_WINDOW_S):
        self.root, self.out_dir = root, out_dir
        self.every_s, self.window_s = every_s, window_s
        self.last: PublishResult | None = None
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grafana-snapshot", daemon=True)

    def start(self) -> "Publisher":
        self._thread.start()
        return self

    def publish_once(self) -> PublishResult:
        self.last = publish(self.root, self.out_dir, self.window_s)
        return self.last

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish_once()
            except Exception as e:             # noqa: BLE001 - keep publishing; Grafana keeps the last one
                self.failures += 1
                log.warning("grafana snapshot: publish failed (%s); keeping the previous one", e)
            self._stop.wait(self.every_s)

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
