"""Who the probe reports as: :class:`Identity`, a part the :class:`~.core.Probe` composes (``init`` fills
it from its arguments and the environment; the hello carries it; every frame carries the rank)."""
from __future__ import annotations

import sys


class Identity:
    """Job, rank, world size, local rank, node, and the topology fields of the hello (``extra``). A rank or
    world size not given is resolved at the first frame (:meth:`resolve`: from ``torch.distributed``, else
    0/1). ``hello_changed``: called when resolving changed what the hello says."""

    def __init__(self, hello_changed):
        self.hello_changed = hello_changed
        self.job: str | None = None
        self.rank: int | None = None
        self.world_size: int | None = None
        self.local_rank: int | None = None
        self.node: str | None = None
        self.extra: dict = {}                 # hello fields (topology); refilled in place (the flops part holds it)
        self.ready = False                    # rank and world size known
        self.rank_given = self.world_given = False

    def resolve(self) -> None:
        if self.rank is None or self.world_size is None:
            try:
                dist = sys.modules.get("torch.distributed")
                if dist is not None and dist.is_available() and dist.is_initialized():
                    if self.rank is None:
                        self.rank = dist.get_rank()
                    if self.world_size is None:
                        self.world_size = dist.get_world_size()
            except Exception:  # noqa: BLE001
                pass
            if self.rank is None:
                self.rank = 0
            if self.world_size is None:
                self.world_size = max(1, self.rank + 1)
        self.ready = True
        self.hello_changed()

    def after_fork(self) -> None:
        """In a forked child: what was resolved lazily is resolved again (a launcher that forks its ranks)."""
        if not self.rank_given:
            self.rank = None
        if not self.world_given:
            self.world_size = None
        self.ready = self.rank is not None and self.world_size is not None
