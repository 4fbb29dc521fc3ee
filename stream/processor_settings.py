"""The stream processor's settings, declared once (:class:`~stepwatch.detectors.settings.Setting`).

:class:`~stepwatch.stream.processor.Processor` takes them as keyword arguments (these defaults), the
``[processor]`` table of the configuration file sets them (these ranges; :mod:`stepwatch.config`), and
``stepwatch config defaults`` and docs/configuration.md list them. ``live``: a reload applies it to the
running jobs; otherwise it applies to the jobs the processor starts after the reload (their alignment
ring and replay are made with it). Kept apart from the processor so that the configuration loader
does not import the processor.
"""
from __future__ import annotations

from stepwatch.detectors.settings import Setting

PROCESSOR = (
    Setting("flush_interval_s", 1.0, 0.05, 3600.0, "s", "seconds between store flushes"),
    Setting("max_buffer_rows", 1_000_000, 1000, 100_000_000, "rows", "rows buffered before a flush is forced"),
    Setting("lateness_s", 10.0, 0.0, 3600.0, "s", "seconds of event time before an incomplete step closes",
            live=False),
    Setting("window_steps", 128, 8, 65536, "steps", "steps x ranks kept per job in the alignment ring", live=False),
    Setting("replay_steps", 256, 0, 65536, "steps", "steps replayed from the store into a job's fresh detectors",
            live=False),
    Setting("idle_close_s", 5.0, 0.1, 3600.0, "s", "seconds without input after which open steps are closed"),
)
