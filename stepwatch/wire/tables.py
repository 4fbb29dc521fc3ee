"""The Arrow schema of every table of wire contract v1 (docs/wire-format.md, docs/tables.md), with the
value rules the decoder checks (:data:`NONNEGATIVE`, :data:`JOB_RE`), and the message's content types. The
table catalog (:mod:`stepwatch.wire.catalog`: names, keys, topics) names the tables; producers encode rows
of these schemas with :mod:`stepwatch.wire.encode`, and the processor's decoder
(:mod:`stepwatch.wire.decode`) conforms what it receives to them.

Units: times are UTC nanoseconds (``timestamp[ns, tz=UTC]``), durations float64 milliseconds, sizes bytes.
"""
from __future__ import annotations

import re
from datetime import datetime, timezone

import pyarrow as pa

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

TS = pa.timestamp("ns", tz="UTC")
F64 = pa.float64()

STEPS = pa.schema([
    pa.field("job", pa.string(), nullable=False),
    pa.field("node", pa.string(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("step", pa.int64(), nullable=False),
    pa.field("t_start", TS),
    pa.field("t_end", TS, nullable=False),
    pa.field("step_ms", F64, nullable=False),
    pa.field("data_ms", F64),
    pa.field("compute_ms", F64),
    pa.field("comm_ms", F64),
    pa.field("comm_wait_ms", F64),
    pa.field("gc_ms", F64),
    pa.field("gc_count", pa.int32()),
    pa.field("samples", pa.int64()),
    pa.field("tokens", pa.int64()),
    pa.field("phases", pa.map_(pa.string(), F64)),
    pa.field("data_queue", pa.int32()),
    # CPU starvation: the step-ending thread's CPU time, and its time runnable but waiting for a CPU
    pa.field("cpu_ms", F64),
    pa.field("cpu_wait_ms", F64),
    # exposed communication: the step's communication in flight (the union of its collectives' intervals)
    # and the part of it not hidden behind compute (what held the step; null: not reported)
    pa.field("comm_total_ms", F64),
    pa.field("comm_exposed_ms", F64),
])

TOPOLOGY = pa.schema([
    pa.field("job", pa.string(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("node", pa.string(), nullable=False),
    pa.field("world_size", pa.int32(), nullable=False),
    pa.field("device", pa.string()),
    pa.field("dp", pa.int32()),
    pa.field("tp", pa.int32()),
    pa.field("pp", pa.int32()),
    pa.field("ep", pa.int32()),
    pa.field("cp", pa.int32()),
    pa.field("framework", pa.string()),
    pa.field("agent_version", pa.string()),
    pa.field("device_type", pa.string()),
    pa.field("dtype", pa.string()),
    pa.field("model_flops_per_token", F64),
    pa.field("model_params", pa.int64()),
    pa.field("model_flops_per_sample", F64),
    # where the FLOPs per token (sample) came from: user | counted | analytic (agents/probe/flops.py)
    pa.field("flops_source", pa.string()),
    # the Slurm job and step this rank runs in (SLURM_JOB_ID, SLURM_STEP_ID; null outside Slurm): join sacct's
    # JobID "<slurm_job>.<slurm_step>" (docs/baremetal.md)
    pa.field("slurm_job", pa.int64()),
    pa.field("slurm_step", pa.int64()),
])

TOP_PROC = pa.struct([("pid", pa.int64()), ("name", pa.string()), ("cpu_pct", F64)])
ACCEL = pa.struct([("index", pa.int32()), ("util", F64), ("mem_used", pa.int64()),
                   ("temp_c", F64), ("power_w", F64), ("clock_mhz", F64)])

HOST = pa.schema([
    pa.field("job", pa.string(), nullable=False),
    pa.field("node", pa.string(), nullable=False),
    pa.field("t", TS, nullable=False),
    pa.field("cpu_util", F64),
    pa.field("cpu_iowait", F64),
    pa.field("cpu_steal", F64),
    pa.field("load1", F64),
    pa.field("mem_used", pa.int64()),
    pa.field("mem_available", pa.int64()),
    pa.field("disk_read_bps", F64),
    pa.field("disk_write_bps", F64),
    pa.field("net_rx_bps", F64),
    pa.field("net_tx_bps", F64),
    pa.field("rdma_retrans", pa.int64()),
    pa.field("top_procs", pa.list_(TOP_PROC)),
    pa.field("accel", pa.list_(ACCEL)),
])

GC = pa.schema([
    pa.field("job", pa.string(), nullable=False),
    pa.field("node", pa.string(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("t", TS, nullable=False),
    pa.field("generation", pa.int32()),
    pa.field("duration_ms", F64, nullable=False),
    pa.field("collected", pa.int64()),
    pa.field("uncollectable", pa.int64()),
])

COMM = pa.schema([
    pa.field("job", pa.string(), nullable=False),
    pa.field("node", pa.string(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("step", pa.int64(), nullable=False),
    pa.field("op", pa.string(), nullable=False),
    pa.field("group", pa.string()),
    pa.field("count", pa.int64()),
    pa.field("bytes", pa.int64()),
    pa.field("time_ms", F64),
    pa.field("wait_ms", F64),
    pa.field("group_size", pa.int32()),
])

#: What a rank is doing while its step runs far longer than usual (the probe's watchdog), or what its node
#: agent sees of a rank that went quiet (``source`` "agent": the process stopped, exited, or sends nothing).
INFLIGHT = pa.schema([
    pa.field("job", pa.string(), nullable=False),
    pa.field("node", pa.string(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("t", TS, nullable=False),                    # when it was observed
    pa.field("source", pa.string(), nullable=False),      # probe | agent
    pa.field("state", pa.string(), nullable=False),       # collective | data | compute | done | exited | stopped | gone | silent
    pa.field("step", pa.int64()),                         # the step in progress
    pa.field("step_kind", pa.string()),                   # first, eval, checkpoint (comma-separated) or null
    pa.field("elapsed_ms", F64),                          # how long the step has run (done: its length)
    pa.field("since", TS),                                # when the rank entered this state
    pa.field("op", pa.string()),                          # collective: its op, process group and sequence number
    pa.field("group", pa.string()),
    pa.field("seq", pa.int64()),                          # per process group, 1 = the group's first collective
    pa.field("group_size", pa.int32()),
    pa.field("stack", pa.string()),                       # the main thread's Python stack, innermost frame last
    pa.field("pid", pa.int64()),
    pa.field("exit_code", pa.int32()),                    # exited: the process's exit status (when known)
    pa.field("signal", pa.int32()),                       # exited: the signal that ended it (when one did)
    pa.field("error", pa.string()),                       # exited: the exception that ended it ("Type: message")
])

ALERTS = pa.schema([
    pa.field("alert_id", pa.string(), nullable=False),
    pa.field("job", pa.string(), nullable=False),
    pa.field("kind", pa.string(), nullable=False),
    pa.field("severity", pa.string()),
    pa.field("status", pa.string(), nullable=False),
    pa.field("t_detected", TS),
    pa.field("step_first", pa.int64()),
    pa.field("step_detected", pa.int64()),
    pa.field("ranks", pa.list_(pa.int32())),
    pa.field("nodes", pa.list_(pa.string())),
    pa.field("cause", pa.string()),
    pa.field("evidence", pa.string()),
    pa.field("cost_pct", F64),
    pa.field("suggestion", pa.string()),
    pa.field("incident_id", pa.string()),   # one id per fault: its alerts, cause and consequences (nullable)
])

DEADLETTER = pa.schema([
    pa.field("job", pa.string()),           # partition key: the job if it could be read, else "_unknown"
    pa.field("t_received", TS, nullable=False),
    pa.field("source_topic", pa.string()),
    pa.field("source_partition", pa.int32()),
    pa.field("source_offset", pa.int64()),
    pa.field("schema", pa.string()),
    pa.field("row", pa.int64()),            # row index inside the message, null if the whole message
    pa.field("reason", pa.string(), nullable=False),
    pa.field("payload", pa.binary()),       # raw message (whole-message errors) or the row as JSON
])

#: Derived by the store from every batch of step rows it writes: per-rank partial sums per minute,
#: so per-rank questions over hours read ~60x fewer rows. Several rows may exist for one
#: (job, rank, minute) — one per flush — and queries add them up.
RANK_MINUTES = pa.schema([
    pa.field("job", pa.string(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("node", pa.string()),
    pa.field("minute", TS, nullable=False),
    pa.field("steps", pa.int64()),
    pa.field("step_min", pa.int64()),
    pa.field("step_max", pa.int64()),
    pa.field("step_ms", F64),
    pa.field("busy_ms", F64),
    pa.field("data_ms", F64),
    pa.field("compute_ms", F64),
    pa.field("comm_ms", F64),
    pa.field("comm_wait_ms", F64),
    pa.field("gc_ms", F64),
    pa.field("gc_count", pa.int64()),
])

#: Derived by the store from every batch of step rows it writes: per (job, step) partial aggregates
#: over the ranks in the batch, so per-step questions over hours read one row per step, not one per
#: rank and step. A step whose rows came in two flushes has two rows: aggregate with sum/min/max.
STEP_SUMMARY = pa.schema([
    pa.field("job", pa.string(), nullable=False),
    pa.field("step", pa.int64(), nullable=False),
    pa.field("ranks", pa.int64()),          # step rows aggregated
    pa.field("t_start", TS),                # min
    pa.field("t_end", TS, nullable=False),  # max
    pa.field("step_ms_min", F64),
    pa.field("step_ms_max", F64),
    pa.field("step_ms_sum", F64),
])

#: Written by the processor (the ``mfu`` detector, :mod:`stepwatch.detectors.mfu`): one row per
#: job and closed step with the model FLOPs, MFU and the productive share of its wall time.
EFFICIENCY = pa.schema([
    pa.field("job", pa.string(), nullable=False),
    pa.field("step", pa.int64(), nullable=False),
    pa.field("t_end", TS, nullable=False),
    pa.field("step_ms", F64),               # median step time over the ranks
    pa.field("wall_ms", F64),               # t_end - previous closed step's t_end (gaps included)
    pa.field("productive_ms", F64),         # wall time that counts as productive (goodput numerator)
    pa.field("devices", pa.int32()),        # ranks that reported the step
    pa.field("tokens", F64),                # global tokens of the step (replication removed)
    pa.field("samples", F64),               # global samples of the step (replication removed)
    pa.field("model_flops", F64),           # model FLOPs of the step (whole job)
    pa.field("peak_tflops", F64),           # per-device peak used
    pa.field("mfu", F64),                   # model_flops / (step_ms * devices * peak), 0..1
    pa.field("data_queue_p50", F64),        # median DataLoader ready batches over the ranks
    pa.field("data_queue_empty", F64),      # share of reporting ranks whose queue was empty
    pa.field("flops_source", pa.string()),  # model_flops from: user | counted | analytic | params
    pa.field("dtype", pa.string()),         # the dtype whose peak was used (bf16, fp8, tf32, ...)
])

#: Written by the processor: per job, analysis window (``step_lo..step_hi``), collective kind and group,
#: the achieved algorithm / bus bandwidth against the link's peak.
COMM_BW = pa.schema([
    pa.field("job", pa.string(), nullable=False),
    pa.field("step_lo", pa.int64(), nullable=False),
    pa.field("step_hi", pa.int64(), nullable=False),
    pa.field("t_end", TS, nullable=False),  # t_end of step_hi
    pa.field("op", pa.string(), nullable=False),
    pa.field("group", pa.string()),
    pa.field("group_size", pa.int32()),
    pa.field("ranks", pa.int32()),          # ranks that reported the group in the window
    pa.field("link", pa.string()),          # link type the peak is taken from
    pa.field("calls_per_step", F64),        # calls per rank and step
    pa.field("bytes_per_call", F64),        # payload bytes per call (this rank's, mean)
    pa.field("xfer_ms_per_step", F64),      # transfer time per step (the last-arriving rank's wall time)
    pa.field("time_ms_per_step", F64),      # wall time in the collective per rank and step (mean)
    pa.field("wait_share", F64),            # wait_ms / time_ms
    pa.field("algbw_gbps", F64),            # bytes / transfer time, GB/s
    pa.field("busbw_gbps", F64),            # algbw x bus factor of the op (nccl-tests), GB/s
    pa.field("peak_gbps", F64),             # the link's peak bus bandwidth, GB/s
    pa.field("util", F64),                  # busbw / peak
    pa.field("diagnosis", pa.string()),     # small-messages | slow-link | sync-bound | null
])

#: Targeted profiling (docs/profiling.md). ``control``: one signed command per node (keyed by node; never
#: stored). ``reference`` (ranks profiled as the healthy comparison) is signed with the rest; see
#: :mod:`stepwatch.agents.profiling` for the canonical form that ``signature`` covers.
CONTROL = pa.schema([
    pa.field("cmd_id", pa.string(), nullable=False),
    pa.field("job", pa.string(), nullable=False),
    pa.field("node", pa.string(), nullable=False),
    pa.field("ranks", pa.list_(pa.int32())),
    pa.field("steps", pa.int32()),
    pa.field("kind", pa.string()),
    pa.field("reason", pa.string()),
    pa.field("issued_at", TS),
    pa.field("expires_at", TS),
    pa.field("signature", pa.string()),
    pa.field("reference", pa.list_(pa.int32())),
])

#: ``profiles``: one row per (command, rank, outcome), published by the node agent (or by the
#: processor for a command it did not issue because of the cap). ``reason`` is the alert id.
PROFILES = pa.schema([
    pa.field("cmd_id", pa.string(), nullable=False),
    pa.field("job", pa.string(), nullable=False),
    pa.field("node", pa.string()),
    pa.field("rank", pa.int32()),
    pa.field("status", pa.string(), nullable=False),     # ok | failed | rejected | expired | busy
    pa.field("uri", pa.string()),
    pa.field("bytes", pa.int64()),
    pa.field("summary", pa.string()),                     # JSON: top operators/functions by self time
    pa.field("started_at", TS),
    pa.field("finished_at", TS),
    pa.field("kind", pa.string()),                        # torch | py-spy
    pa.field("role", pa.string()),                        # suspect | reference
    pa.field("reason", pa.string()),                      # alert id that asked for it ('' by hand)
    pa.field("detail", pa.string()),                      # why: rejection/failure reason, or a note
    pa.field("steps", pa.int32()),                        # steps profiled (asked for, when not ok)
    pa.field("t", TS),                                    # when the outcome was published
])

PROFILE_DIFFS = pa.schema([
    pa.field("alert_id", pa.string()),                    # the alert that asked for the profile ('' by hand)
    pa.field("job", pa.string(), nullable=False),
    pa.field("cmd_id", pa.string(), nullable=False),
    pa.field("suspect_rank", pa.int32()),
    pa.field("reference_rank", pa.int32()),
    pa.field("position", pa.int32(), nullable=False),      # 1 = the most slower; -1, -2 ... the most faster
    pa.field("name", pa.string(), nullable=False),         # operator / record_function range / Python function
    pa.field("suspect_ms", F64),                          # self time per profiled step
    pa.field("reference_ms", F64),
    pa.field("delta_ms", F64),
    pa.field("ratio", F64),                               # suspect / reference (null: the reference has none)
    pa.field("t", TS, nullable=False),                    # when the processor compared them
])

SCHEMAS: dict[str, pa.Schema] = {
    "steps": STEPS, "topology": TOPOLOGY, "host": HOST, "gc": GC, "comm": COMM,
    "alerts": ALERTS, "deadletter": DEADLETTER, "rank_minutes": RANK_MINUTES, "step_summary": STEP_SUMMARY,
    "efficiency": EFFICIENCY, "comm_bw": COMM_BW,
    "profiles": PROFILES,               # targeted profiling results (agents publish, the processor stores)
    "profile_diffs": PROFILE_DIFFS,     # suspect vs reference, per operator (the processor computes them)
    "inflight": INFLIGHT,               # in-flight state of ranks in an overlong step (probe watchdog, agent)
}
# TELEMETRY (kinds a producer may send) and NATURAL_KEYS live in the table catalog, stepwatch/wire/catalog.py.

#: Columns that are durations (ms) or sizes: finite and >= 0 when present.
NONNEGATIVE: dict[str, tuple[str, ...]] = {
    "steps": ("step_ms", "data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms", "gc_count",
              "samples", "tokens", "rank", "step", "data_queue", "cpu_ms", "cpu_wait_ms",
              "comm_total_ms", "comm_exposed_ms"),
    "topology": ("rank", "world_size", "dp", "tp", "pp", "ep", "cp", "model_flops_per_token",
                 "model_params", "model_flops_per_sample"),
    "host": ("cpu_util", "cpu_iowait", "cpu_steal", "load1", "mem_used", "mem_available",
             "disk_read_bps", "disk_write_bps", "net_rx_bps", "net_tx_bps", "rdma_retrans"),
    "gc": ("rank", "duration_ms", "collected", "uncollectable", "generation"),
    "comm": ("rank", "step", "count", "bytes", "time_ms", "wait_ms", "group_size"),
    "inflight": ("rank", "step", "elapsed_ms", "seq", "group_size", "pid", "exit_code", "signal"),
}

#: Job ids become directory names (``job=<id>``): keep them to a safe alphabet.
JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}\Z")   # \Z: "$" would let "job\n" in
JOB_PATTERN = JOB_RE.pattern
