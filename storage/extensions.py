"""Where DuckDB's extensions for the lake come from: the one place that decides how to load them.

The lake needs ``ducklake`` plus ``sqlite`` (SQLite catalog), ``postgres`` (PostgreSQL catalog) and
``httpfs`` (data on S3). Two sources, in this order:

1. an extension folder, laid out as DuckDB's own (``<dir>/v<duckdb version>/<platform>/<file>``) or
   flat (``<dir>/<file>``, the binaries of one platform, as :func:`copy_to` writes it):
   ``$STEPWATCH_DUCKDB_EXTENSIONS`` when set, else the one the PyPI packages ``duckdb-ext-ducklake``,
   ``duckdb-ext-sqlite``, ``duckdb-ext-postgres``, ``duckdb-ext-httpfs`` install (``duckdb_ext/extensions``
   in site-packages: DuckDB's signed binaries, built for DuckDB 1.4.4). They load with ``LOAD '<path>'``
   and need no ``allow_unsigned_extensions``;
2. otherwise DuckDB's own repository: ``INSTALL <name>; LOAD <name>`` (needs network access once).

Used by the store, ``stepwatch sql``, the views, the Grafana datasource's initSql and the tests.

Another machine (the Grafana pod) gets a **flat** folder of the binaries for *its* platform, so the
datasource's initSql names no platform: ``python -m stepwatch.storage.extensions copy DEST`` run in
the stepwatch image on that machine (the image is built per platform; the Dockerfile already keeps
such a folder at ``/opt/stepwatch/duckdb-extensions``) copies them there.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from functools import lru_cache
from pathlib import Path, PurePosixPath

import duckdb

#: extension name -> file stem of its binary
FILES = {"ducklake": "ducklake", "sqlite": "sqlite_scanner", "postgres": "postgres_scanner", "httpfs": "httpfs"}


def _lit(s: str) -> str:
    return "'" + str(s).replace("'", "''") + "'"


@lru_cache(maxsize=1)
def platform() -> str:
    return duckdb.connect().execute("SELECT platform FROM pragma_platform()").fetchone()[0]


def version() -> str:
    return "v" + duckdb.__version__


def package_dir() -> Path | None:
    """The extension folder of the ``duckdb-ext-*`` packages, if installed."""
    spec = importlib.util.find_spec("duckdb_ext")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "extensions"
        if d.is_dir():
            return d
    return None


def extension_dir() -> Path | None:
    env = os.environ.get("STEPWATCH_DUCKDB_EXTENSIONS")
    return Path(env) if env else package_dir()


def path(name: str, ext_dir: str | Path | None = None) -> str | None:
    """The binary of extension ``name`` for this DuckDB, or None. With ``ext_dir`` given (a flat
    folder as another machine sees it, e.g. inside the Grafana pod) the path is built without
    looking and names no platform."""
    stem = FILES[name]
    if ext_dir is not None:
        return str(PurePosixPath(str(ext_dir)) / f"{stem}.duckdb_extension")
    d = extension_dir()
    if d is None:
        return None
    for p in (d / f"{stem}.duckdb_extension", d / version() / platform() / f"{stem}.duckdb_extension"):
        if p.is_file():
            return str(p)
    return None


def copy_to(dest: str | Path, names=tuple(FILES)) -> list[Path]:
    """Copy this machine's binaries (this DuckDB version and platform) of ``names`` flat into
    ``dest``; returns the files written. Fails when one is missing (nothing to hand a reader)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for n in names:
        src = path(n)
        if src is None:
            raise FileNotFoundError(f"DuckDB extension {n} for {version()} {platform()} not found "
                                    f"(pip install duckdb-ext-{n}, or set STEPWATCH_DUCKDB_EXTENSIONS)")
        target = dest / f"{FILES[n]}.duckdb_extension"
        if Path(src).resolve() != target.resolve():
            shutil.copyfile(src, target)
        out.append(target)
    return out


def load_sql(names, ext_dir: str | Path | None = None) -> list[str]:
    """Statements that load ``names`` (``LOAD '<path>'`` from a folder, else INSTALL + LOAD)."""
    out = []
    for n in names:
        p = path(n, ext_dir)
        out.append(f"LOAD {_lit(p)};" if p else f"INSTALL {n}; LOAD {n};")
    return out


def load(con: duckdb.DuckDBPyConnection, names) -> None:
    for stmt in load_sql(names):
        con.execute(stmt)


def source() -> str:
    """One line saying where the extensions come from (for logs and ``stepwatch sql``)."""
    d = extension_dir()
    if d is not None and path("ducklake") is not None:
        return f"{d} ({version()}, {platform()})"
    return f"DuckDB's extension repository (INSTALL; {version()}, {platform()})"


if __name__ == "__main__":      # python -m stepwatch.storage.extensions copy DEST
    if len(sys.argv) != 3 or sys.argv[1] != "copy":
        sys.exit("usage: python -m stepwatch.storage.extensions copy DEST")
    for f in copy_to(sys.argv[2]):
        print(f)
    print(f"(DuckDB {version()}, {platform()})")
