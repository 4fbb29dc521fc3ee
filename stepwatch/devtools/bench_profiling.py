"""``stepwatch bench profiling``: what targeted profiling costs and how fast it answers.

A real run on this machine: the embedded broker, a node agent and a processor (threads of this
process, profiling enabled with a random key), and ``--prof-ranks`` gloo ranks of
``tests/profile_train.py`` under ``stepwatch wrap`` (step padded to ``--prof-step-ms``; from step 150 (a
baseline first) rank 1 does ``--prof-extra-ms`` more inside ``record_function("slow_op")``). The processor's slow_rank alert makes it
profile rank 1 and a reference for ``--prof-steps`` steps. Reported:

- time from the alert (processor callback) to the command being published, the profile starting in
  the probe (its first profiled step boundary), the suspect's trace written (file mtime) and the diff
  available in the processor;
- the profiled rank's step time (wall time between its step ends, median) before the profile, while
  the profiler warms up (``torch._inductor`` import on a helper thread), during the N profiled steps,
  the first steps after (trace export on a helper thread, summary in a child process) and later: it must return to
  the baseline.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SLOW_FROM = 150           # the slow rank's extra work starts here: a healthy baseline first


def add_profiling_args(p) -> None:
    """Options of ``stepwatch bench profiling`` (the ``--prof-`` names are those it had when every bench
    shared one list of options; both spellings work)."""
    p.add_argument("--ranks", "--prof-ranks", dest="prof_ranks", type=int, default=4,
                   help="gloo ranks (default %(default)s)")
    p.add_argument("--steps", "--prof-steps", dest="prof_steps", type=int, default=10,
                   help="steps profiled (default %(default)s)")
    p.add_argument("--step-ms", "--prof-step-ms", dest="prof_step_ms", type=float, default=50.0,
                   help="padded step time, ms (default %(default)s)")
    p.add_argument("--extra-ms", "--prof-extra-ms", dest="prof_extra_ms", type=float, default=20.0,
                   help="extra work in slow_op on rank 1 from step %d, ms (default %%(default)s)" % SLOW_FROM)


def _med(x) -> float:
    return float(np.median(x)) if len(x) else float("nan")


def run_profiling_bench(a) -> int:
    from stepwatch.agents.agent import Agent
    from stepwatch.agents.wrap import wrap_env
    from stepwatch.storage.views import connect
    from stepwatch.devtools.broker import EmbeddedBroker
    from stepwatch.kafkaio import KafkaSettings, ensure_topics
    from stepwatch.stream.processor import Processor
    from stepwatch.stream.profiling import ProfilingSettings

    train = Path(__file__).resolve().parents[2] / "tests" / "profile_train.py"
    if not train.exists():
        print(f"stepwatch bench profiling: needs the repository's {train} (run it from a source checkout)",
              file=sys.stderr)
        return 2
    base = Path(a.data_dir or tempfile.mkdtemp(prefix="stepwatch-bench-prof-"))
    base.mkdir(parents=True, exist_ok=True)
    sock = tempfile.mkdtemp(prefix="sw-bp-", dir="/tmp")
    from stepwatch.agents import profiling as prof
    from stepwatch.agents.profiling import protocol
    pem, pub = protocol.keygen()                              # a fresh key pair: the processor signs, probes verify
    key = prof.load_private_key(env={protocol.ENV_PRIVATE: pem.decode()})
    keys = prof.load_public_keys(env={protocol.ENV_PUBLIC: pub})
    slow, n = 1, a.prof_steps
    print(f"stepwatch bench profiling: {a.prof_ranks} gloo ranks, step {a.prof_step_ms:.0f} ms, rank {slow} "
          f"+{a.prof_extra_ms:.0f} ms in slow_op; {n} steps of torch.profiler; {os.cpu_count()} CPUs; data in {base}")
    t_alert: dict[str, float] = {}
    with EmbeddedBroker(log_path=base / "broker.log") as broker:
        s = KafkaSettings(bootstrap=broker.bootstrap, prefix="bprof.", partitions=2)
        ensure_topics(s)
        agent = Agent(s, socket_dir=sock, node="node-a", interval_s=0.3, spool_dir=base / "_spool",
                      plugins=["cpu"]).enable_profiling(keys, str(base / "traces"), cooldown_s=0.0).start()

        def on_alert(al):
            if al.kind == "slow_rank" and al.status == "firing":
                t_alert.setdefault(al.alert_id, (time.time(), time.monotonic()))

        proc = Processor(s, base / "data", group="bench-prof", flush_interval_s=0.3, on_alert=on_alert,
                         profiling=ProfilingSettings(key=key, steps=n, ttl_s=60.0, max_in_flight=2,
                                                     alert_kinds={"slow_rank": "torch"}))
        stop_a, stop_p = threading.Event(), threading.Event()
        ta = threading.Thread(target=agent.run, args=(stop_a,), daemon=True)
        tp = threading.Thread(target=proc.run, kwargs={"stop_event": stop_p}, daemon=True)
        ta.start()
        tp.start()
        out = tempfile.mkdtemp(prefix="sw-bp-out-")
        stop_file = os.path.join(out, "STOP")
        env = wrap_env(job="bench-prof", socket_dir=sock)
        env[protocol.ENV_PUBLIC] = pub
        env["STEPWATCH_PROFILE_DIR"] = str(base / "traces")
        env.update(SW_NPROC=str(a.prof_ranks), SW_STEP_MS=str(a.prof_step_ms), SW_SLOW_RANK=str(slow),
                   SW_SLOW_EXTRA_MS=str(a.prof_extra_ms), SW_SLOW_FROM=str(SLOW_FROM), SW_STOP=stop_file, SW_STEPS="100000", SW_OUT=out)
        p = subprocess.Popen([sys.executable, "-m", "stepwatch.agents.wrap", "--", sys.executable, str(train)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t_diff = None
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and p.poll() is None:
                if proc.profiling is not None and proc.profiling.diffs and t_diff is None:
                    t_diff = time.time()
                if t_diff is not None and time.time() - t_diff > 6.0:     # steps after the profile
                    break
                time.sleep(0.05)
            Path(stop_file).touch()
            _, err = p.communicate(timeout=120)
            time.sleep(1.5)
        finally:
            stop_a.set()
            ta.join(30)
            stop_p.set()
            tp.join(30)
        if p.returncode != 0 or proc.profiling is None or not proc.profiling.diffs:
            print(f"no profile diff (training rc {p.returncode}): {err[-2000:]}", file=sys.stderr)
            return 1
        pend, d = proc.profiling.diffs[0]
        con = connect(base / "data")
        rows = {r[0]: r for r in con.execute(
            "SELECT rank, uri, epoch_ns(started_at), epoch_ns(finished_at), summary, bytes FROM profiles "
            "WHERE cmd_id = ? AND status = 'ok'", [pend.cmd_id]).fetchall()}
        ends = {int(f.stem[4:]): json.loads(f.read_text())["ends"] for f in Path(out).glob("rank*.json")}
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
    ta_, tm_ = t_alert[pend.alert.alert_id]
    issued = ta_ + (pend.t_issued - tm_)
    sus = rows[slow]
    started, finished = sus[2] / 1e9, sus[3] / 1e9
    written = os.path.getmtime(sus[1][len("file://"):])
    summ = json.loads(sus[4])
    print("\nlatency from the alert (processor callback):")
    print(f"  command published        {issued - ta_:6.2f} s ")
    print(f"  profile started (probe)  {started - ta_:6.2f} s   (next flush poll + profiler warm-up + step boundary)")
    print(f"  {n} steps profiled until  {finished - ta_:6.2f} s")
    print(f"  trace written            {written - ta_:6.2f} s   ({sus[5] / 1024:.0f} KiB gz, export+summary "
          f"{summ.get('export_s', float('nan')):.2f} s on a helper thread)")
    print(f"  diff in the processor    {t_diff - ta_:6.2f} s")
    e = np.array(ends[slow])
    dt = np.diff(e) * 1e3                 # dt[i]: step i+1 (its end is e[i+1])
    t_end = e[1:]
    idx = np.arange(1, len(e))
    healthy = dt[(idx >= SLOW_FROM - 40) & (idx < SLOW_FROM)]
    before = dt[(idx >= SLOW_FROM + 2) & (t_end < ta_)]
    warm = dt[(t_end > ta_) & (t_end <= started)]
    during = dt[(t_end > started) & (t_end <= finished + 1e-3)]
    after1 = dt[t_end > finished + 1e-3][:5]
    after2 = dt[t_end > finished + 1e-3][5:45]
    print(f"\nprofiled rank {slow}: step time (wall between step ends, median ms)")
    for name, x in (("before slow_op was injected (40 steps)", healthy),
                    ("slow, not profiled yet (before the alert)", before), ("warm-up (alert -> start)", warm),
                    (f"during ({len(during)} profiled steps)", during), ("first 5 steps after", after1),
                    ("steps 6-45 after", after2)):
        print(f"  {name:<44} {_med(x):8.1f}   (n={len(x)}, max {np.max(x) if len(x) else float('nan'):.1f})")
    base_ms = _med(np.concatenate([before, after2]))
    print(f"  vs the unprofiled slow rank ({base_ms:.1f} ms, before + steps 6-45 after): during "
          f"{(_med(during) / base_ms - 1) * 100:+.1f}%, first 5 after {(_med(after1) / base_ms - 1) * 100:+.1f}%, "
          f"steps 6-45 after {(_med(after2) / base_ms - 1) * 100:+.1f}%")
    print(f"\ndiff (suspect {d['suspect_rank']} vs reference {d['reference_rank']}): " +
          ", ".join(f"{x['name']} +{x['delta_ms']:.2f} ms/step" for x in d["slower"][:3]))
    return 0
