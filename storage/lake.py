"""Where the lake is and how to attach it: catalog, data path, S3 credentials (docs/tables.md, its opening table; the chart: docs/helm.md).

A DuckLake is a SQL *catalog* (every commit a snapshot) plus Parquet files under a *data path*:

* embedded default (``--data-dir DIR``): SQLite catalog ``DIR/lake.sqlite`` (WAL mode, so readers
  never block the writer), data under ``DIR/lake/``;
* several processors: ``STEPWATCH_LAKE_CATALOG=postgres:<libpq connection string>`` without the
  password, which comes from the environment (``PGPASSWORD``, read by libpq) or a file
  (``STEPWATCH_LAKE_PASSWORD_FILE``, e.g. a mounted Secret; see :func:`password_from_file`), and is
  never part of a string stepwatch prints or logs; and a data path every processor reaches:
  ``STEPWATCH_LAKE_DATA_PATH`` = a shared folder (no rename semantics needed) or ``s3://bucket/prefix/``
  (``httpfs``; endpoint/region/URL style from ``STEPWATCH_S3_*``, keys from ``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY``).

Local files are private to the writer's uid: the catalog's and the data path's folders 0700, the
catalog and every Parquet file 0600 (:meth:`Lake.prepare` and a umask around every write, see
:func:`store_umask`); with ``STEPWATCH_LAKE_GROUP_READ=1`` 0750 and 0640, for a reader (Grafana) of
another uid in the writer's group. The writers' lock file is 0600 in either case.

:func:`Lake.attach_sql` is the one statement list every reader and writer runs (the store, the views,
``stepwatch sql``, the Grafana datasource's initSql).
"""
from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import stat
import threading
from collections import OrderedDict
import contextlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import duckdb

from stepwatch.storage import extensions

log = logging.getLogger("stepwatch.storage.lake")

ALIAS = "lake"
RETRIES = 100          # DuckLake commit retries on a PostgreSQL catalog (see Lake.connect)


_UMASK_LOCK = threading.Lock()
_umask_depth = 0
_umask_saved = 0


@contextmanager
def store_umask(bits: int):
    """The process's umask with ``bits`` added while the block runs (files DuckDB and SQLite create
    then, Parquet files and their folders included, get no more than 0600/0700, or 0640/0750 with
    ``bits`` 0o027). The umask is the process's: nested and concurrent blocks (several threads
    writing) share one depth count, the outermost restores the saved umask, and a file another thread
    creates meanwhile gets the stricter mask too."""
    global _umask_depth, _umask_saved
    with _UMASK_LOCK:
        cur = os.umask(0o077)
        if _umask_depth == 0:
            _umask_saved = cur
        os.umask(cur | bits)
        _umask_depth += 1
    try:
        yield
    finally:
        with _UMASK_LOCK:
            _umask_depth -= 1
            if _umask_depth == 0:
                os.umask(_umask_saved)


def _env_flag(env, name: str) -> bool:
    v = (env.get(name) or "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={v!r}: give 1 or 0")


def _tighten(path: str, mode: int, is_dir: bool) -> None:
    """``chmod`` an existing folder or file of this uid to ``mode`` when it allows more (an older
    store's 0755/0644); never a link, never someone else's, never a sticky folder (``/tmp``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)) and st.st_uid == os.geteuid() \
            and not st.st_mode & stat.S_ISVTX and stat.S_IMODE(st.st_mode) & ~mode:
        os.chmod(path, mode)


def lit(s) -> str:
    return "'" + str(s).replace("'", "''") + "'"


@dataclass(frozen=True)
class S3:
    endpoint: str = ""            # host:port of an S3-compatible server; empty: AWS
    region: str = "us-east-1"
    url_style: str = ""           # "path" for most S3-compatible servers; empty: DuckDB's default (vhost)
    use_ssl: bool = True
    key_id: str = ""
    secret: str = ""

    @classmethod
    def from_env(cls, env=os.environ) -> "S3":
        return cls(endpoint=env.get("STEPWATCH_S3_ENDPOINT", ""),
                   region=env.get("STEPWATCH_S3_REGION") or env.get("AWS_REGION") or "us-east-1",
                   url_style=env.get("STEPWATCH_S3_URL_STYLE", ""),
                   use_ssl=env.get("STEPWATCH_S3_USE_SSL", "true").lower() not in ("0", "false", "no"),
                   key_id=env.get("AWS_ACCESS_KEY_ID", ""), secret=env.get("AWS_SECRET_ACCESS_KEY", ""))

    def secret_sql(self, scope: str, from_env_placeholders: bool = False) -> str:
        """``CREATE SECRET`` for httpfs. With ``from_env_placeholders`` every value is written as
        ``${AWS_ACCESS_KEY_ID}``, ``${AWS_SECRET_ACCESS_KEY}``, ``${STEPWATCH_S3_ENDPOINT|REGION|URL_STYLE|USE_SSL}``:
        Grafana expands them from its environment when it reads a provisioning file, so no key is
        stored in the datasource."""
        if from_env_placeholders:
            parts = ["TYPE s3", "KEY_ID '${AWS_ACCESS_KEY_ID}'", "SECRET '${AWS_SECRET_ACCESS_KEY}'",
                     "REGION '${STEPWATCH_S3_REGION}'", f"SCOPE {lit(scope)}", "ENDPOINT '${STEPWATCH_S3_ENDPOINT}'",
                     "URL_STYLE '${STEPWATCH_S3_URL_STYLE}'", "USE_SSL ${STEPWATCH_S3_USE_SSL}"]
            return f"CREATE OR REPLACE SECRET stepwatch_lake_s3 ({', '.join(parts)});"
        parts = ["TYPE s3", f"KEY_ID {lit(self.key_id)}", f"SECRET {lit(self.secret)}", f"REGION {lit(self.region)}",
                 f"SCOPE {lit(scope)}"]
        if self.endpoint:
            parts.append(f"ENDPOINT {lit(self.endpoint)}")
        if self.url_style:
            parts.append(f"URL_STYLE {lit(self.url_style)}")
        parts.append(f"USE_SSL {'true' if self.use_ssl else 'false'}")
        return f"CREATE OR REPLACE SECRET stepwatch_lake_s3 ({', '.join(parts)});"


@dataclass(frozen=True)
class Lake:
    catalog: str                  # "sqlite:/abs/lake.sqlite" | "postgres:<libpq connection string>"
    data_path: str                # "/abs/folder/" | "s3://bucket/prefix/"
    s3: S3 | None = None
    dir: Path | None = None       # the local data dir it was made from (reports, bench scratch files)
    group_read: bool = False      # local files 0640 / folders 0750 (STEPWATCH_LAKE_GROUP_READ), else 0600 / 0700

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dir(cls, data_dir: str | Path | "Lake", env=os.environ) -> "Lake":
        """The lake of ``--data-dir``: SQLite + local files there, unless ``STEPWATCH_LAKE_CATALOG`` /
        ``STEPWATCH_LAKE_DATA_PATH`` say otherwise."""
        if isinstance(data_dir, Lake):
            return data_dir
        d = Path(data_dir).absolute()
        catalog = env.get("STEPWATCH_LAKE_CATALOG") or f"sqlite:{d / 'lake.sqlite'}"
        if catalog.startswith("postgres:"):
            password_from_file(env)
        data = env.get("STEPWATCH_LAKE_DATA_PATH") or str(d / "lake")
        return cls.make(catalog, data, S3.from_env(env) if data.startswith("s3://") else None, d,
                        group_read=_env_flag(env, "STEPWATCH_LAKE_GROUP_READ"))

    @classmethod
    def make(cls, catalog: str, data_path: str, s3: S3 | None = None, dir: str | Path | None = None,
             group_read: bool = False) -> "Lake":
        if not catalog.startswith(("sqlite:", "postgres:")):
            raise ValueError(f"lake catalog {catalog!r}: give sqlite:<file> or postgres:<connection string>")
        if not data_path.endswith("/"):
            data_path += "/"
        if data_path.startswith("s3://") and s3 is None:
            s3 = S3()
        return cls(catalog, data_path, s3, Path(dir) if dir else None, bool(group_read))

    def at(self, data_path: str | None = None, catalog: str | None = None) -> "Lake":
        """The same lake as another machine sees it (Grafana's mount points)."""
        return replace(self, data_path=data_path or self.data_path, catalog=catalog or self.catalog)

    # ------------------------------------------------------------------ properties
    @property
    def kind(self) -> str:
        return self.catalog.split(":", 1)[0]

    @property
    def sqlite_file(self) -> str | None:
        return self.catalog.split(":", 1)[1] if self.kind == "sqlite" else None

    @property
    def local_data(self) -> bool:
        return not self.data_path.startswith(("s3://", "gs://", "r2://", "az://", "abfss://"))

    @property
    def file_mode(self) -> int:
        return 0o640 if self.group_read else 0o600

    @property
    def dir_mode(self) -> int:
        return 0o750 if self.group_read else 0o700

    def umask(self):
        """:func:`store_umask` for this lake's modes (around every write)."""
        return store_umask(0o027 if self.group_read else 0o077)

    @property
    def extensions(self) -> list[str]:
        return ["ducklake", self.kind] + (["httpfs"] if self.s3 is not None else [])

    def describe(self) -> str:
        cat = self.catalog
        if self.kind == "postgres":     # never print a password
            cat = " ".join(p if not p.startswith("password=") else "password=***" for p in cat.split(" "))
        return f"DuckLake catalog {cat}, data {self.data_path}"

    # ------------------------------------------------------------------ SQL
    def attach_sql(self, read_only: bool = False, ext_dir: str | Path | None = None, lockdown: bool = False,
                   s3_keys_from_env: bool = False, alias: str = ALIAS) -> list[str]:
        """Statements that load the extensions, [lock DuckDB down,] and attach the lake as ``alias``.

        ``lockdown`` (the Grafana datasource): after the extensions are loaded and before the lake is
        attached, file access is limited to the lake (its data path and catalog file),
        ``enable_external_access = false``, extension auto-install/auto-load off, then the
        configuration is locked, so SQL typed into a panel can neither read nor write other files,
        load extensions, or undo these settings."""
        out = extensions.load_sql(self.extensions, ext_dir)
        if self.s3 is not None:
            out.append(self.s3.secret_sql(self.data_path.rstrip("/"), s3_keys_from_env))
        if lockdown:
            out.append(f"SET allowed_directories = [{lit(self.data_path)}];")
            if self.sqlite_file:
                out.append(f"SET allowed_paths = [{lit(self.sqlite_file)}];")
            out += ["SET enable_external_access = false;", "SET autoinstall_known_extensions = false;",
                    "SET autoload_known_extensions = false;", "SET lock_configuration = true;"]
        opts = [f"DATA_PATH {lit(self.data_path)}"] + (["READ_ONLY"] if read_only else [])
        out.append(f"ATTACH {lit('ducklake:' + self.catalog)} AS {alias} ({', '.join(opts)});")
        return out

    def prepare(self) -> None:
        """Before the first (writing) attach: the folders (``dir_mode``; the store's own existing
        ``--data-dir`` and data path, when this uid's, are tightened to it) and a SQLite catalog in
        WAL mode (readers then never block the writer; WAL is a property of the file, so it is set
        once), created ``file_mode`` (SQLite gives its ``-wal`` and ``-shm`` files the catalog's mode)."""
        with self.umask():
            if self.sqlite_file:
                d = os.path.dirname(self.sqlite_file)
                os.makedirs(d, mode=self.dir_mode, exist_ok=True)
                if self.dir is not None and Path(d) == self.dir:     # the store's own folder (--data-dir)
                    _tighten(d, self.dir_mode, True)
                for f in (self.sqlite_file, self.sqlite_file + "-wal", self.sqlite_file + "-shm"):
                    _tighten(f, self.file_mode, False)
                if not Path(self.sqlite_file).exists():
                    # Only a file nobody has open: closing a second SQLite library's handle on a file that
                    # DuckDB's SQLite holds would drop DuckDB's POSIX locks in this process.
                    try:
                        os.close(os.open(self.sqlite_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                         self.file_mode))
                    except FileExistsError:
                        pass
                    c = sqlite3.connect(self.sqlite_file, timeout=30)
                    try:
                        c.execute("PRAGMA journal_mode=WAL")
                    finally:
                        c.close()
            if self.local_data:
                os.makedirs(self.data_path, mode=self.dir_mode, exist_ok=True)
                _tighten(self.data_path.rstrip("/") or "/", self.dir_mode, True)

    @contextmanager
    def write_lock(self):
        """Held around every writing transaction (a flush, a claim, a compaction step) on a SQLite
        catalog; a no-op on PostgreSQL. A DuckLake transaction reads the catalog when it begins and
        writes it when it commits; SQLite (WAL) refuses the write ("database is locked", whatever
        the transaction touched) once another connection committed in between. Without this lock a
        compaction step, which takes longer than the gap between two flushes, would never commit.
        Readers take no lock. (An ``flock`` on ``<catalog>.lock``: one machine, as a SQLite catalog is;
        released when its process dies. The lock file is 0600 and this uid's, whatever the lake's
        modes: a user who could open it, even read-only, could hold every flush for as long as he
        liked.) The files the transaction creates get the lake's modes (:meth:`umask`)."""
        with self.umask():
            if not self.sqlite_file:
                yield
                return
            fd = self._lock_fd()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def _lock_fd(self) -> int:
        path = self.sqlite_file + ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise PermissionError(f"lake lock {path} belongs to uid {st.st_uid}, not to this process's uid "
                                      f"{os.geteuid()}: another user could hold every write; remove it")
            if stat.S_IMODE(st.st_mode) != 0o600:
                os.fchmod(fd, 0o600)                    # an older store's 0644 lock
        except BaseException:
            os.close(fd)
            raise
        return fd

    def connect(self, read_only: bool = False, threads: int | None = None) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection with the lake attached as ``lake`` (times shown in UTC). One DuckDB
        instance per lake and mode is kept per process (loading the signed extensions costs a
        fraction of a second each time); every call returns a new connection to it, with its own
        transactions."""
        def setup(db: duckdb.DuckDBPyConnection) -> None:
            if not read_only:
                self.prepare()
            with contextlib.nullcontext() if read_only else self.umask():   # a new catalog is written here
                for stmt in self.attach_sql(read_only=read_only):
                    db.execute(stmt)
            # DuckLake's own commit retry redoes only the catalog write, on a fresh snapshot, after
            # another commit took the ids this transaction allocated (PostgreSQL). Without it a
            # transaction longer than the gap between two flushes (a compaction step) never
            # commits. On SQLite the writers take turns (write_lock) and it is not needed.
            db.execute(f"SET GLOBAL ducklake_max_retry_count = {RETRIES if self.kind == 'postgres' else 0}")
        return _INSTANCES.cursor((self, read_only), setup, threads)


class InstanceCache:
    """In-memory DuckDB instances kept per process, by key, the ``keep`` most recently used (loading
    the signed extensions costs a fraction of a second per instance: the signature covers the whole
    binary). :meth:`cursor` returns a new connection to the key's instance (``cursor()``: its own
    transactions, so each query reads the newest snapshot), made by ``setup(db)`` on first use (times
    shown in UTC). One cache for the lake's writers and readers (:meth:`Lake.connect`) and one for the
    views (:func:`stepwatch.storage.views.connect`)."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._dbs: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def cursor(self, key, setup, threads: int | None = None) -> duckdb.DuckDBPyConnection:
        with self._lock:
            db = self._dbs.get(key)
            if db is None:
                db = duckdb.connect(":memory:")
                db.execute("SET GLOBAL TimeZone = 'UTC'")
                setup(db)
                self._dbs[key] = db
                while len(self._dbs) > self.keep:     # open connections keep an evicted instance alive
                    self._dbs.popitem(last=False)
            else:
                self._dbs.move_to_end(key)
            con = db.cursor()
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        return con


_INSTANCES = InstanceCache()               # (Lake, read_only) -> the instance with the lake attached


def password_from_file(env=os.environ) -> None:
    """The catalog's password from the file ``STEPWATCH_LAKE_PASSWORD_FILE`` names (a Kubernetes
    Secret mounted as a file), handed to libpq as ``PGPASSWORD`` in this process's environment, so
    it never appears in a connection string (which errors and logs may show). A ``PGPASSWORD``
    already set wins. The file's content is not logged, not even on error."""
    path = env.get("STEPWATCH_LAKE_PASSWORD_FILE")
    if not path or os.environ.get("PGPASSWORD"):
        return
    from stepwatch import secretfile
    secretfile.check(path, "STEPWATCH_LAKE_PASSWORD_FILE")
    try:
        pw = Path(path).read_text().rstrip("\r\n")
    except OSError as e:
        raise RuntimeError(f"STEPWATCH_LAKE_PASSWORD_FILE={path}: cannot read it ({e.strerror})") from None
    if pw:
        os.environ["PGPASSWORD"] = pw


def lake_of(x) -> Lake:
    """A :class:`Lake` from a Lake, a data dir, or anything with a ``lake`` attribute (a store)."""
    if isinstance(x, Lake):
        return x
    if hasattr(x, "lake"):
        return x.lake
    return Lake.from_dir(x)
