"""Send a :class:`~stepwatch.devtools.simulate.Simulation` to Kafka the way node agents would.

Topology first (and flushed), then each chunk of steps as Arrow IPC messages on the ``steps``,
``host`` and ``gc`` topics, keyed by job. ``pace`` sends each step when the wall clock reaches its
``t_end`` (a live cluster); without it the stream is sent as fast as the broker takes it (replay).
"""
from __future__ import annotations

import time
from typing import Callable

from stepwatch.devtools.simulate import Simulation
from stepwatch.stream.kafkaio import KafkaSettings, send_table


def send_simulation(sim: Simulation, producer, settings: KafkaSettings, start: int = 0, stop: int | None = None,
                    chunk: int = 4, rows_per_message: int = 4096, pace: bool = False,
                    on_chunk: Callable[[int, dict], None] | None = None) -> dict[str, int]:
    """Returns rows sent per table."""
    stop = sim.steps if stop is None else stop
    sent = {"topology": 0, "steps": 0, "host": 0, "gc": 0, "comm": 0}
    if start == 0:
        topo = sim.topology()
        for f in send_table(producer, settings, "topology", topo, max_rows=rows_per_message):
            f.get(30)
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
                send_table(producer, settings, kind, t, max_rows=rows_per_message)
                sent[kind] += t.num_rows
        step += n
        if on_chunk:
            on_chunk(step, sent)
    producer.flush(60)
    return sent
