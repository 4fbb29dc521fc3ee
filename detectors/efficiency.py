"""Efficiency analytics beyond jitter: how far from the hardware a job runs, and what wastes it.

Three detectors (registered as ``mfu``, ``comm_bw`` and ``dataloader``) computed live from the telemetry
the agents send, each writing rows the processor stores (:meth:`drain_rows`) and alerting like the rest:

* :class:`Mfu` — per closed step the model FLOPs, **MFU** (model FLOPs / (step time x devices x peak
  FLOPS per device)) and the productive share of the wall time (**goodput**), stored in the
  ``efficiency`` table; a change point on the work-normalised step time alerts ``mfu_regression``.
* :class:`CommBandwidth` — per window of steps and (collective kind, group): payload per call, achieved
  algorithm and bus bandwidth (nccl-tests conventions) against the link's peak, stored in ``comm_bw``;
  diagnoses ``comm_small_messages``, ``comm_slow_link``, ``comm_sync_bound``.
* :class:`DataLoader` — the distribution of the DataLoader's ready-batch queue per rank; mostly empty
  with a material data wait alerts ``dataloader_starved`` (cause ``io``) with the concrete remedy.

The tables of device peaks (:data:`PEAK_TFLOPS`) and link peaks (:data:`LINK_GBPS`), and the collectives'
bus and size factors, live in ``agents/probe/collectives.py`` (shared with the probe and the simulator) and
are documented in
``docs/efficiency.md`` with their sources; both can be overridden (settings, ``STEPWATCH_PEAK_TFLOPS``).
Everything is columnar (numpy / pyarrow group-by); nothing loops per rank or per record.

The code lives one part per module: :mod:`.mfu`, :mod:`.commbw` and :mod:`.dataloader` (the detectors),
:mod:`.busbw` (bus-bandwidth maths over arrays and the reference :func:`comm_analysis`), :mod:`.commagg`
(the columnar comm aggregator), :mod:`.effcommon` (shared helpers). This module re-exports their names for
the importers of the former single module. The offline replay (``efficiency_tables``) is
:mod:`stepwatch.stream.offline`: it aligns through the stream layer, which detectors never import.
"""
from __future__ import annotations

from stepwatch.agents.probe import collectives  # noqa: F401
from stepwatch.agents.probe.collectives import (LINK_GBPS, PEAK_TFLOPS, SATURATE_BYTES, device_family,  # noqa: F401
                                                intra_link, link_type, norm_dtype, peak_tflops)

from .busbw import bus_bandwidth, bus_factor, comm_analysis, size_factor  # noqa: F401
from .commagg import (_HIST_EDGES, _HIST_NAMES, _LOC_SHIFT, _MAX_KEYS, _MAX_SLOTS, _RANK_BITS,  # noqa: F401
                      _col_f64, _col_i64, _CommAggregate, _Names, _sorted_unique)
from .commbw import CommBandwidth, _peer_medians  # noqa: F401
from .dataloader import DataLoader, _median_at_least, _nanmedian_axis0  # noqa: F401
from .effcommon import _Episodes, _pending_add, _r  # noqa: F401
from .mfu import Mfu, load_peak_table, model_flops_per_token  # noqa: F401

__all__ = ["Mfu", "CommBandwidth", "DataLoader", "bus_factor", "size_factor", "bus_bandwidth", "comm_analysis",
           "load_peak_table", "model_flops_per_token", "LINK_GBPS", "PEAK_TFLOPS", "SATURATE_BYTES",
           "device_family", "intra_link", "link_type", "norm_dtype", "peak_tflops"]
