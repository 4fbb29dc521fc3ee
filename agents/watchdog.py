"""Moved to :mod:`stepwatch.agents.probe.watchdog` (the probe's own package); this name stays an alias."""
import sys

from stepwatch.agents.probe import watchdog as _watchdog

sys.modules[__name__] = _watchdog
