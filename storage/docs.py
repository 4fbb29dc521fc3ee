"""Generates ``docs/tables.md`` from the schemas and the view definitions, so the documented
schema is the schema (a test fails when the checked-in file differs; regenerate with
``python -m stepwatch.storage.docs > docs/tables.md``)."""
from __future__ import annotations

from stepwatch.catalog import NATURAL_KEYS, SORT_COLUMNS, TIME_COLUMN
from stepwatch.schema import SCHEMAS
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
              "alerts of one fault (cause, consequences, re-fires; null in rows written before incidents).",
    "deadletter": "Rejected input: ONE row per source message (Kafka topic, partition, offset), whether the "
                  "whole message was refused (`row` null) or some of its rows (`row` = index of the first bad "
                  "row; `reason` = how many rows and the first distinct reasons). `payload` is the raw message "
                  "(cut at 1 MiB). See docs/limits.md.",
    "rank_minutes": "Derived by the store from every batch of step rows it writes: per (job, rank, minute of "
                    "`t_end`) partial sums (`steps` = rows summed). One (job, rank, minute) may have several "
                    "rows (one per flush): always aggregate with `sum`. Per-rank questions over hours read "
                    "this instead of `steps` (about 60x fewer rows).",
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
                     "`silent`). The `job_hang` alert names the ranks from these (docs/detectors.md).")
ABOUT["efficiency"] = ("Written by the processor's `mfu` detector: one row per job and closed step. `mfu` = "
                       "`model_flops` / (`step_ms`/1000 x `devices` x `peak_tflops` x 1e12); goodput over a window "
                       "= sum(`productive_ms`) / sum(`wall_ms`). Definitions and the peak table: docs/detectors.md.")
ABOUT["comm_bw"] = ("Written by the processor's `comm_bw` detector: per job, window of steps (`step_lo..step_hi`), "
                    "collective kind and group: payload per call, transfer time, achieved algorithm and bus "
                    "bandwidth (GB/s, nccl-tests factors) against the link's peak, wait share and the diagnosis "
                    "(`small-messages`, `slow-link`, `sync-bound`).")

VIEWS = {
    "job_steps": "One row per job and step: ranks reported, median/max step time, median busy time and phases, "
                 "samples and tokens.",
    "rank_busy": "One row per job and rank over everything stored: median busy time and phases.",
}


def tables_markdown() -> str:
    out = ["# Tables and views", "",
           "Generated from the code by `python -m stepwatch.storage.docs`; do not edit by hand. The tables, their",
           "natural keys, time and sort columns are listed once, in `stepwatch/catalog.py`; their columns in",
           "`stepwatch/schema.py`.", "",
           "The store keeps one folder per table: `<data-dir>/<table>/job=<job>/date=YYYY-MM-DD/*.parquet`",
           "(zstd, rows sorted within a file as listed). `stepwatch sql` and the Grafana datasource read them",
           "through DuckDB views of the same names. The views add the hive columns `job` and `date`, and show",
           "event times as `TIMESTAMPTZ` (microseconds).", "",
           "Times are UTC; durations are float64 milliseconds; sizes are bytes.", ""]
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
    out += ["## View definitions", "", "As `stepwatch sql --print-views` prints them (for a data dir `/data`):", "",
            "```sql", view_sql("/data"), "```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(tables_markdown(), end="")
