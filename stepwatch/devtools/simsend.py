"""Send a :class:`~stepwatch.devtools.simulate.Simulation` to Kafka the way node agents would.

Topology first (and flushed), then each chunk of steps as Arrow IPC messages on the ``steps``,
``host`` and ``gc`` topics, keyed by job. ``pace`` sends each step when the wall clock reaches its
``t_end`` (a live cluster); without it the stream is sent as fast as the broker takes it (replay).
"""
from __future__ import annotations

import time
from typing import Callable

from stepwatch.devtools.simulate import Simulation
from stepwatch.kafkaio import KafkaSettings, send_table


def send_simulation(sim: Simulation, producer, settings: KafkaSettings, start: int = 0, stop: int | None = None,
                    chunk: int = 4, rows_per_message: int = 4096, pace: bool = False,
                    on_chunk: Callable[[int, dict], None] | None = None) -> dict[str, int]:
    """Returns rows sent per table: rows the broker acknowledged. A message the producer could not
    deliver (after the client's own retries) raises :class:`DeliveryFailed` once the rest is flushed,
    so a caller never counts rows the broker does not hold."""
    stop = sim.steps if stop is None else stop
    futs: list = []
    sent = {"topology": 0, "steps": 0, "host": 0, "gc": 0, "comm": 0}
    if start == 0:
        topo = sim.topology()
        for f in send_table(producer, settings, "topology", topo, max_rows=rows_per_message):
            f.get(150)
        sent["topology"] = topo.num_rows
    step = start
    while step < stop:
        n = 1 if pace else min(chunk, stop - step)
        tables = sim.generate(step, step + n)
        if pace:
            t_end = tables["steps"].column("t_end")[0].value / 1e9
            delay = t_end - time.time()
            if delay > 0:
                time.sleep(delay)
        for kind, t in tables.items():             # generate()'s kinds: steps, host, gc (+ comm)
            if t is not None and t.num_rows:
                futs.extend((kind, f) for f in send_table(producer, settings, kind, t, max_rows=rows_per_message))
                sent[kind] += t.num_rows
        step += n
        if on_chunk:
            on_chunk(step, sent)
        futs = _check(futs, done_only=True)
    producer.flush(150)
    _check(futs, done_only=False)
    return sent


class DeliveryFailed(RuntimeError):
    """The producer gave up on a message (its retries and ``delivery_timeout_ms`` spent)."""


def _check(futs: list, done_only: bool) -> list:
    """Raise on the first failed send; return the sends still in flight."""
    pending = []
    for kind, f in futs:
        if not f.is_done:
            if done_only:
                pending.append((kind, f))
                continue
            raise DeliveryFailed(f"a {kind} message was not acknowledged after the producer's flush")
        if f.failed():
            raise DeliveryFailed(f"the broker did not take a {kind} message: {f.exception!r}")
    return pending
