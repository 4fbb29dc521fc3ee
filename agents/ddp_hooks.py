"""Moved to :mod:`stepwatch.agents.probe.ddp_hooks` (the probe's own package); this name stays an alias."""
import sys

from stepwatch.agents.probe import ddp_hooks as _ddp_hooks

sys.modules[__name__] = _ddp_hooks
