"""Generates ``docs/tables.md`` from the schemas and the view definitions, so the documented
schema is the schema (a test fails when the checked-in file differs; regenerate with
``python tools/tablesdoc.py > docs/tables.md``). A tool of the repository, not part of the package."""
from __future__ import annotations

from stepwatch.wire.catalog import NATURAL_KEYS
from stepwatch.wire.tables import SCHEMAS
from stepwatch.storage.lake import Lake
from stepwatch.storage.store import JOBS, LAKE_OPTIONS, OFFSETS, SORT_COLUMNS, TIME_COLUMN
from stepwatch.storage.views import view_sql

ABOUT = {
    "steps": "One row per rank per training step (wire `steps/1`). Durations in ms; `step_ms - comm_wait_ms` "
             "is the rank's busy time.",
    "topology": "One row per rank of a job (wire `topology/1`): world size, node, parallel coordinates "
                "(`pp` = pipeline stage).",
    "host": "One row per node per host sample (wire `host/1`): CPU, memory, disk, NIC, RDMA, top processes, "
            "accelerators.",
    "gc": "One row per Python garbage collection in a training process (wire `gc/1`).",
    "comm": "One row per rank per step per collective kind and group (wire `comm/1`).",
    "alerts": "One row per alert state change (`firing`, then `resolved`) written by the processor. "
              "`alert_id` is stable for the same finding; `evidence` is JSON text; `incident_id` groups the "
              "alerts of one fault (cause, consequences, re-fires; null in rows written before incidents). "
              "Lifecycle events are rows too: `job_end` (severity `info`, status `resolved` only, never sent "
              "as an alert; `evidence.outcome` `finished`, `stopped`, `exit_failed` or `ended_while_hung`), "
              "beside the alerts `rank_crash` (critical) and `exit_failed` (warning).",
    "deadletter": "Rejected input: ONE row per source message (Kafka topic, partition, offset), whether the "
                  "whole message was refused (`row` null) or some of its rows (`row` = index of the first bad "
                  "row; `reason` = how many rows and the first distinct reasons). `payload` is the raw message "
                  "(cut at 1 MiB). See docs/limits.md.",
    "rank_minutes": "Derived by the store from every batch of step rows it writes: per (job, rank, minute of "
                    "`t_end`) partial sums (`steps` = rows summed). One (job, rank, minute) may have several "
                    "rows (one per flush): always aggregate with `sum`. Per-rank questions over hours read "
                    "this instead of `steps` (about 60x fewer rows).",
    "step_summary": "Derived by the store from every batch of step rows it writes: per (job, step) the ranks "
                    "reported (`ranks`), first start, last end, min/max/sum of `step_ms` over them. A step whose "
                    "rows came in several flushes has several rows: aggregate with `sum`/`min`/`max`. Per-step "
                    "questions over hours read this instead of `steps` (one row per step instead of per rank).",
    "profiles": "Targeted profiling (wire `profiles/1`, see docs/profiling.md): one row per command, rank and "
                "outcome (`ok`, `failed`, `rejected`, `expired`, `busy`). `reason` is the alert id that asked for "
                "it, `role` says suspect or reference, `summary` is JSON (top operators or Python functions by "
                "self time, ms per step), `uri` the trace file, `detail` why a command was refused or failed.",
    "profile_diffs": "Written by the processor when a command's suspect and reference profiles are both `ok`: one "
                     "row per operator (or Python function) the two differ in, `position` 1 = the one the suspect "
                     "spends most extra self time in (ms per profiled step), negative positions = where it spends "
                     "less. `alert_id` links it to the alert; `stepwatch profile diff CMD_ID` prints the same.",
}

ABOUT["inflight"] = ("What ranks were doing while a step ran far longer than usual (wire `inflight/1`): one row per "
                     "rank every few seconds from the probe's watchdog (`source` = `probe`: `state` collective with "
                     "`op`/`group`/`seq`, data or compute, the main thread's `stack`; `done` when the step ended), and "
                     "rows from the node agent for a rank that cannot speak (`source` = `agent`: `stopped`, `gone`, "
                     "`silent`). The `job_hang` alert names the ranks from these (docs/detectors.md). A rank's "
                     "goodbye is a row too (`source` = `probe`, `state` = `exited`, with `exit_code`, `signal` and "
                     "`error` — the exception, its traceback in `stack`): how each rank ended, from which the "
                     "processor tells a finished or stopped job (a `job_end` row in `alerts`) from a crash "
                     "(`rank_crash`) and a hang (docs/detectors.md#lifecycle). A Slurm prolog/epilog's word on the "
                     "job is a row with `source` = `slurm`, `state` = `sched_start`/`sched_end`, `rank` 0 (the job), "
                     "the Slurm state in `error` (docs/baremetal.md).")
ABOUT["efficiency"] = ("Written by the processor's `mfu` detector: one row per job and closed step. `mfu` = "
                       "`model_flops` / (`step_ms`/1000 x `devices` x `peak_tflops` x 1e12); goodput over a window "
                       "= sum(`productive_ms`) / sum(`wall_ms`). Definitions and the peak table: docs/efficiency.md.")
ABOUT["comm_bw"] = ("Written by the processor's `comm_bw` detector: per job, window of steps (`step_lo..step_hi`), "
                    "collective kind and group: payload per call, transfer time, achieved algorithm and bus "
                    "bandwidth (GB/s, nccl-tests factors) against the link's peak, wait share and the diagnosis "
                    "(`small-messages`, `slow-link`, `sync-bound`).")

LAKE = f"""
The store is a [DuckLake](https://ducklake.select) (format {"0.3"}, DuckDB 1.4 LTS): Parquet data files
plus a SQL **catalog** in which every commit is a **snapshot**.

| set-up | catalog | data files |
|---|---|---|
| embedded default (`--data-dir D`, `make demo`, one processor) | SQLite file `D/lake.sqlite` (WAL mode) | `D/lake/` |
| several processors (the chart with `store.lake.catalog: postgres`) | PostgreSQL: `STEPWATCH_LAKE_CATALOG=postgres:<libpq connection string>` without the password, which comes from `PGPASSWORD` or the file `STEPWATCH_LAKE_PASSWORD_FILE` names (the chart mounts a Secret there) | `STEPWATCH_LAKE_DATA_PATH`: a shared folder (any filesystem: nothing is renamed), or `s3://bucket/prefix/` (`STEPWATCH_S3_ENDPOINT`, `_REGION`, `_URL_STYLE`, `_USE_SSL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`) |

A SQLite catalog serves the processes of one machine: one processor, `stepwatch compact`, any
number of readers (`stepwatch sql`, reports, Grafana). Its writers take turns on an `flock` of
`lake.sqlite.lock` for the length of a transaction (SQLite refuses a commit once another writer
committed after the transaction began); readers take no lock. PostgreSQL serves processors on many
machines; DuckLake detects conflicting commits there (and redoes only the catalog write when
another commit merely took the same new ids).

Local files belong to the writer's uid alone: the store's folder (`--data-dir`) and the data path
are 0700 (an existing one of that uid is tightened at start), the catalog (and its `-wal`/`-shm`)
and every Parquet file 0600 (a umask around every write). With `STEPWATCH_LAKE_GROUP_READ=1` in
the writers' environment (processor, `stepwatch compact`) they are 0750 and 0640 instead, for a
reader of another uid in the writer's group (Grafana, `stepwatch sql`). `lake.sqlite.lock` is 0600
either way and must be the writer's (a lock of another uid is refused): a user who can open it,
even read-only, can hold every flush.

Tested here: SQLite and PostgreSQL 15 (Debian's package, a cluster started by the tests) catalogs;
data on a local folder and on moto's S3-compatible server (path-style URLs, no TLS) through DuckDB's
`httpfs`. Not tested: AWS S3 itself, GCS/Azure, TLS to the S3 endpoint.

Each table below is a lake table of the same name with one more column, `date` (UTC day of the event
time given as "date partition from"), **partitioned by `date`** only: its files are
`<data path>/main/<table>/date=YYYY-MM-DD/ducklake-<uuid>.parquet` ({LAKE_OPTIONS["parquet_compression"]},
Parquet v{LAKE_OPTIONS["parquet_version"]}, rows sorted within a file as listed: job first). A flush writes one
file per table (per day it spans) however many jobs it holds. DuckLake writes them (`INSERT`), except
`steps`: the store writes its files itself (Arrow's Parquet writer with the lake's compression and
row-group size: durations byte-stream-split, integers and times delta-encoded, a dictionary for strings
only; the `date` column left out: DuckLake reads it from the folder; DuckDB's `COPY` where the data path
is an object store) and adds them with `ducklake_add_data_files` in the flush's transaction
(`DIRECT_TABLES` in `storage/store.py`; 0.25 CPU-seconds per million step rows, where DuckDB's `COPY`
took 0.70-0.81 and DuckLake's `INSERT` 0.75 plus its buffering). On a SQLite catalog
only: on PostgreSQL, with processors committing concurrently, readers failed on such files
("Unknown name map id"), so there DuckLake writes `steps` too. A query for one job and time range opens
only the files whose `job` and time range, as the catalog's per-file min/max statistics say, can hold
such rows, and within a file only the row groups that can. Event times are stored as `TIMESTAMPTZ`
(microseconds). The table `{JOBS}` names every job stored (a row per job and writer start).

**Snapshots.** A processor's flush is one transaction: the rows of every table and the Kafka
positions (`{OFFSETS}`) become visible together, in one new snapshot. A query reads one whole
snapshot, never a half-written flush or half of a compaction. Older snapshots stay readable until
expired: `SELECT * FROM lake.snapshots()`, `SELECT count(*) FROM lake.steps AT (VERSION => 42)`.

**Compaction and retention** (`stepwatch compact`, the chart's CronJob; `storage/compact.py`):

1. `--retention-days N` deletes whole `date` partitions older than N days (the files leave the
   next snapshot);
2. each partition's small files are rewritten in groups of up to `--target-mb` (256), one transaction
   per group: `INSERT INTO t SELECT * FROM t WHERE filename IN (group) ORDER BY <sort columns>`, then
   `DELETE FROM t WHERE filename IN (group)`, which ends the old files; `{OFFSETS}` the same way;
3. `ducklake_expire_snapshots` expires each snapshot a newer one replaced more than `--grace`
   seconds ago (default 300), `ducklake_cleanup_old_files` deletes the files scheduled for deletion
   more than `--grace` ago, and `ducklake_delete_orphaned_files` the files of flushes killed before
   their commit (after an hour).

DuckLake's `ducklake_merge_adjacent_files` is not used: it removes the merged files' catalog rows,
and DuckDB 1.4.4's `sqlite` extension reads a read-only transaction's catalog tables through separate
connections bounded by the rowids seen when the query was planned, so a query during a merge could
read no files at all (0 rows, no error). The rewrite only adds catalog rows or ends them in place.
Two passes at once rewrite each file once (tested: two `stepwatch compact` processes during writes and
queries, every query saw each row once). Keep `--grace` above the longest query: a query has that
long to read its snapshot's file list.

**From a DuckDB shell** (DuckDB 1.4.4): load the extensions, then attach the lake read-only. The
`duckdb-ext-*` packages (`pip install duckdb-ext-ducklake duckdb-ext-sqlite duckdb-ext-postgres
duckdb-ext-httpfs`) put DuckDB's signed binaries under `<site-packages>/duckdb_ext/extensions/v1.4.4/<platform>/`
(`python -m stepwatch.storage.extensions copy DIR` copies them flat into `DIR`; the image has them in
`/opt/stepwatch/duckdb-extensions`); with network access `INSTALL ducklake; INSTALL sqlite;` does
instead.

```sql
LOAD '/opt/stepwatch/duckdb-extensions/ducklake.duckdb_extension';
LOAD '/opt/stepwatch/duckdb-extensions/sqlite_scanner.duckdb_extension';   -- postgres_scanner, httpfs as needed
ATTACH 'ducklake:sqlite:/data/lake.sqlite' AS lake (READ_ONLY, DATA_PATH '/data/lake/');
--  or 'ducklake:postgres:host=... dbname=... user=...' (password from PGPASSWORD), DATA_PATH 's3://bucket/prefix/'
SELECT job, count(*) FROM lake.steps GROUP BY job;
SELECT snapshot_id, snapshot_time, changes FROM lake.snapshots() ORDER BY 1 DESC LIMIT 5;
```

or `stepwatch sql "..."`, which attaches the lake read-only and defines the views below (the same
names as the tables, plus `job_steps` and `rank_busy`), as the Grafana datasource does after locking
DuckDB down to the lake's files.
"""

VIEWS = {
    "job_steps": "One row per job and step: ranks reported, median/max step time, median busy time and phases, "
                 "samples and tokens.",
    "rank_busy": "One row per job and rank over everything stored: median busy time and phases.",
}


def tables_markdown() -> str:
    out = ["# Tables and views", "",
           "Generated from the code by `python tools/tablesdoc.py`; do not edit by hand. The tables, their",
           "natural keys, time and sort columns are listed once, in `stepwatch/wire/catalog.py` (the lake sorts by",
           "job first); their columns in `stepwatch/wire/tables.py` (the processor decodes with `stepwatch/wire/decode.py`).", "",
           LAKE.strip(), "",
           "Times are UTC; durations are float64 milliseconds; sizes are bytes. The lake stores the step",
           "durations of `steps` (`*_ms`) as FLOAT (float32: 7 significant digits; a float64 duration from a",
           "nanosecond clock does not compress: 26 B a step row, as FLOAT 11 B); the views read them as DOUBLE.", ""]
    for t, s in SCHEMAS.items():
        out += [f"## `{t}`", "", ABOUT.get(t, ""), ""]
        meta = []
        if t in NATURAL_KEYS:
            meta.append(f"natural key: `{', '.join(NATURAL_KEYS[t])}`")
        if t in TIME_COLUMN:
            tc = TIME_COLUMN[t]
            meta.append("date partition from: " + ("time of receipt" if tc == "_received" else f"`{tc}`"))
        if t in SORT_COLUMNS:
            meta.append(f"sorted by: `{', '.join(SORT_COLUMNS[t])}`")
        if meta:
            out += ["; ".join(meta), ""]
        out += ["| column | type | required |", "|---|---|---|"]
        out += [f"| `{f.name}` | `{f.type}` | {'yes' if not f.nullable else ''} |" for f in s]
        out.append("")
    out += ["## Views", ""]
    for v, about in VIEWS.items():
        out += [f"### `{v}`", "", about, ""]
    out += [f"## `{OFFSETS}`", "", "The consumed Kafka positions, committed in the same transaction as the rows "
            "they produced: per Kafka cluster, topic and partition the next offset (`-1`: claimed, nothing "
            "consumed yet), the offsets done above it (`done`, JSON ranges), the consumer-group `generation` "
            "and `member` that wrote it. A commit from an older generation is rejected (fencing). The row "
            "with `partition` -1 is a sentinel that serializes the creation of a partition's first row.", ""]
    out += [f"## `{JOBS}`", "", "Every job the lake holds rows of: `job`, `first_stored` (when a writer first "
            "stored it; a row per job per writer start, written in the transaction of the rows). A processor "
            "reads it to decide whether a job it meets has history to rebuild its state from.", ""]
    out += ["## View definitions", "", "As `stepwatch sql --print-views` prints them for a data dir `/data` "
            "(extensions in the flat folder `/opt/stepwatch/duckdb-extensions`, as in the image):", "",
            "```sql", view_sql(Lake.from_dir("/data", env={}), ext_dir="/opt/stepwatch/duckdb-extensions"), "```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(tables_markdown(), end="")
