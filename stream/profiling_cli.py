"""``stepwatch profile``: targeted profiling by hand, and the side-by-side diff of a command's results.

``stepwatch profile --job J --rank R --steps N [--kind torch|py-spy] [--reference R2]`` signs a
``control`` command (private key from ``STEPWATCH_PROFILING_PRIVATE_KEY[_FILE]``) for the node(s) of those ranks (from
``--node``, else the ``topology`` table under ``--data-dir``), publishes it and waits for the
``profiles`` rows (``--no-wait``: print the command id and return).

``stepwatch profile diff CMD_ID --data-dir D`` reads the command's rows from the ``profiles`` table and
prints which operators/functions the suspect spends more self time in than the reference, most first.
"""
from __future__ import annotations

import json
import os
import sys
import time


def _nodes_from_store(data_dir: str, job: str, ranks: list[int]) -> dict[int, str]:
    from stepwatch.storage.views import connect
    con = connect(data_dir)
    rows = con.execute("SELECT rank, node FROM topology WHERE job = ? QUALIFY row_number() OVER "
                       "(PARTITION BY rank ORDER BY date DESC) = 1", [job]).fetchall()
    con.close()
    known = {int(r): n for r, n in rows}
    return {r: known[r] for r in ranks if r in known}


def cmd_profile(a) -> int:
    if a.action:
        if a.action[0] == "keygen":
            return cmd_keygen(a.action[1:])
        if a.action[0] != "diff" or len(a.action) != 2:
            print("usage: stepwatch profile diff CMD_ID [--data-dir D]  |  stepwatch profile --job J --rank R ...",
                  file=sys.stderr)
            return 2
        return cmd_diff(a.action[1], a.data_dir)
    if a.job is None or a.rank is None:
        print("stepwatch profile: --job and --rank are required (or: stepwatch profile diff CMD_ID)", file=sys.stderr)
        return 2
    from stepwatch.agents import profiling
    from stepwatch.agents.profiling import protocol
    from stepwatch.kafkaio import make_producer, settings_from_args
    from stepwatch.stream.profiling import Issuer, ProfilingSettings
    try:
        key = profiling.load_private_key()
    except protocol.KeyError_ as e:
        print(f"stepwatch profile: {e}", file=sys.stderr)
        return 2
    if key is None:
        print("stepwatch profile: no key: set STEPWATCH_PROFILING_PRIVATE_KEY_FILE (or STEPWATCH_PROFILING_PRIVATE_KEY); "
              "'stepwatch profile keygen DIR' makes a key pair", file=sys.stderr)
        return 2
    ranks = list(a.rank)
    refs = list(a.reference or [])
    if a.node:
        nodes = {r: a.node for r in ranks + refs}
    else:
        nodes = _nodes_from_store(a.data_dir, a.job, ranks + refs)
        missing = [r for r in ranks + refs if r not in nodes]
        if missing:
            print(f"stepwatch profile: node of rank(s) {missing} unknown: pass --node, or --data-dir with the "
                  f"job's topology", file=sys.stderr)
            return 2
    s = settings_from_args(a)
    watch = None if a.no_wait else _watch(s)
    prod = make_producer(s)
    iss = Issuer(ProfilingSettings(key=key, ttl_s=a.ttl, max_in_flight=10**6), s, prod)
    cmd_id, rows = iss.issue(a.job, nodes, ranks, refs, a.kind, a.steps, reason=a.reason or "")
    prod.close(5)
    if rows:
        print(json.dumps(rows, indent=1, default=str))
        return 1
    print(f"command {cmd_id}: {a.kind} profile of {a.steps} steps of job {a.job} rank(s) {ranks}"
          + (f", reference {refs}" if refs else "") + f" on {sorted(set(nodes.values()))}", flush=True)
    if watch is None:
        return 0
    want = set(ranks + refs)
    got: dict[int, dict] = {}
    deadline = time.monotonic() + a.ttl + 35
    try:
        while time.monotonic() < deadline and not want <= {r for r, x in got.items() if x["status"] != "pending"}:
            for r in _poll(watch, cmd_id):
                if r.get("rank") is None:
                    continue
                got[int(r["rank"])] = r
                print(f"rank {r['rank']}: {r['status']} {r.get('uri') or ''} {r.get('detail') or ''}".rstrip(),
                      flush=True)
    finally:
        watch.close()
    oks = {r: x for r, x in got.items() if x["status"] == "ok"}
    for r, x in sorted(oks.items()):
        summ = json.loads(x["summary"]) if x.get("summary") else {}
        print(f"\nrank {r} ({x.get('role')}): top by self time, ms/step")
        for o in summ.get("top", [])[:8]:
            print(f"  {o['self_ms']:>10.3f}  {o['name']}")
    s_ok = [r for r in ranks if r in oks]
    r_ok = [r for r in refs if r in oks]
    if s_ok and r_ok:
        from stepwatch.agents.profiling.summary import diff, format_diff
        print(f"\nsuspect rank {s_ok[0]} vs reference rank {r_ok[0]}:")
        print(format_diff(diff(json.loads(oks[s_ok[0]]["summary"]), json.loads(oks[r_ok[0]]["summary"]))))
    return 0 if want <= set(oks) else 1


def cmd_keygen(args: list[str]) -> int:
    """``stepwatch profile keygen DIR``: a new Ed25519 key pair: ``DIR/profiling-signing-key.pem``
    (mode 0600: the processor's, never the nodes') and ``DIR/profiling-public-key.txt`` (base64: for
    agents and training processes, STEPWATCH_PROFILING_PUBLIC_KEY). Prints the public key only."""
    if len(args) != 1:
        print("usage: stepwatch profile keygen DIR", file=sys.stderr)
        return 2
    from stepwatch.agents.profiling import protocol
    d = args[0]
    os.makedirs(d, exist_ok=True)
    priv = os.path.join(d, "profiling-signing-key.pem")
    if os.path.exists(priv):
        print(f"stepwatch profile keygen: {priv} exists; not overwriting it", file=sys.stderr)
        return 1
    pem, pub = protocol.keygen()
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    with open(os.path.join(d, "profiling-public-key.txt"), "w") as f:
        f.write(pub + "\n")
    print(f"private key (processor only): {priv}\npublic key (agents, training pods): {pub}")
    return 0


def _watch(s):
    """A consumer of every ``profiles`` partition positioned at the end (before the command is sent)."""
    from kafka import KafkaConsumer, TopicPartition
    c = KafkaConsumer(**s.client_config(), group_id=None, enable_auto_commit=False, fetch_max_wait_ms=200)
    topic = s.topic("profiles")
    parts = c.partitions_for_topic(topic) or set()
    tps = [TopicPartition(topic, p) for p in sorted(parts)]
    c.assign(tps)
    c.seek_to_end(*tps)
    for tp in tps:
        c.position(tp)
    return c


def _poll(c, cmd_id: str) -> list[dict]:
    from stepwatch.wire.decode import WireError, decode
    out = []
    for msgs in c.poll(timeout_ms=500).values():
        for m in msgs:
            hdr = dict(m.headers or [])
            try:
                d = decode(m.value, hdr.get("content-type"), hdr.get("schema"))
            except WireError:
                continue
            t = d.table
            cols = [c_.cast("int64") if str(c_.type).startswith("timestamp") else c_ for c_ in t.columns]
            import pyarrow as pa
            for r in pa.Table.from_arrays(cols, names=t.column_names).to_pylist():
                if r.get("cmd_id") == cmd_id:
                    out.append(r)
    return out


def cmd_diff(cmd_id: str, data_dir: str) -> int:
    from stepwatch.agents.profiling.summary import diff, format_diff
    from stepwatch.storage.views import connect
    con = connect(data_dir)
    rows = con.execute("SELECT rank, role, status, summary, uri, reason, kind FROM profiles WHERE cmd_id = ? "
                       "ORDER BY rank", [cmd_id]).fetchall()
    con.close()
    if not rows:
        print(f"stepwatch profile diff: no profiles of command {cmd_id} under {data_dir}", file=sys.stderr)
        return 1
    ok = [r for r in rows if r[2] == "ok" and r[3]]
    sus = [r for r in ok if r[1] == "suspect"]
    ref = [r for r in ok if r[1] == "reference"]
    for r in rows:
        print(f"rank {r[0]} ({r[1] or '?'}): {r[2]} {r[4] or ''}".rstrip())
    if not sus or not ref:
        print("stepwatch profile diff: needs an ok profile of a suspect and of a reference rank", file=sys.stderr)
        return 1
    print(f"\ncommand {cmd_id} ({ok[0][6]}), alert {ok[0][5] or '-'}: suspect rank {sus[0][0]} vs reference rank "
          f"{ref[0][0]}\n")
    print(format_diff(diff(json.loads(sus[0][3]), json.loads(ref[0][3]))))
    return 0


def register(sub) -> None:
    """Add ``profile`` to a ``stepwatch`` subparsers object."""
    from stepwatch.kafkaio import add_kafka_args
    p = sub.add_parser("profile", help="fine-grained profile of some ranks (signed command), or 'profile diff CMD_ID'")
    p.add_argument("action", nargs="*", help="'diff CMD_ID' compares a command's suspect and reference profiles; "
                                               "'keygen DIR' makes the Ed25519 key pair that signs commands")
    p.add_argument("--job")
    p.add_argument("--rank", type=int, action="append", help="rank to profile (repeatable)")
    p.add_argument("--reference", type=int, action="append", help="healthy rank profiled alongside (repeatable)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kind", choices=["torch", "py-spy"], default="torch")
    p.add_argument("--node", help="node of the ranks (default: from the topology table under --data-dir)")
    p.add_argument("--ttl", type=float, default=120.0, help="seconds until the command expires (also the deadline)")
    p.add_argument("--reason", default="", help="what asked for it (an alert id)")
    from stepwatch.storage import DEFAULT_DATA
    p.add_argument("--data-dir", default=DEFAULT_DATA)
    p.add_argument("--no-wait", action="store_true", help="print the command id and return")
    add_kafka_args(p)
    p.set_defaults(func=cmd_profile)
