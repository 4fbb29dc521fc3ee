"""The probe's names: ops, process groups and phases get small ids that the agent learns from the hello;
phases get slots in the step's phase table, (op, group) pairs accumulator slots in the step's collectives.
:class:`Names` is a part the :class:`~.core.Probe` composes: the hooks, the fold, the hello and the
watchdog read it."""
from __future__ import annotations

from .collectives import traffic_factor
from .eventlog import KIND_PHASES
from stepwatch.wire.datagram import MAX_COMM, MAX_NAMES, MAX_PHASES

# phase slots with a fixed meaning; named phases get slots from 2 on
SLOT_DATA, SLOT_COMPUTE = 0, 1


def _default_group(dist):
    """The default process group, or None before ``init_process_group``."""
    try:
        return dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001 - not initialized
        return None


class Names:
    """Ids of names, phase slots and collective slots. ``hello_changed``: called when the hello must say
    more (a new name, a new group's size)."""

    def __init__(self, hello_changed):
        self.hello_changed = hello_changed
        self.ids: dict[str, int] = {}                      # name -> id (sent in the hello)
        self.phase_ids = [0] * MAX_PHASES                  # phase slot -> name id
        self.phase_slot: dict[str, int] = {}               # phase name -> slot (>= 2)
        self.comm_slot: dict[tuple[int, int], int] = {}    # (op id, group id) -> accumulator slot
        self.comm_key = [(0, 0)] * MAX_COMM                # accumulator slot -> (op id, group id)
        self.c_traffic = [1.0] * MAX_COMM                  # bytes on the wire per payload byte, per slot
        self.groups: dict[int, tuple[int, int]] = {}       # id(group) -> (name id, size)
        self.group_sizes: dict[str, int] = {}              # group name -> ranks (sent in the hello)
        self.group_refs: list = []                         # the groups, kept alive: their id() are keys

    def intern(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            if len(self.ids) >= MAX_NAMES:
                return self.intern("other") if name != "other" else 0
            i = self.ids[name] = len(self.ids) + 1
            self.hello_changed()
        return i

    def slot_for_phase(self, name: str) -> int:
        if name == "data":
            return SLOT_DATA
        if name == "compute":
            return SLOT_COMPUTE
        s = self.phase_slot.get(name)
        if s is None:
            if len(self.phase_slot) >= MAX_PHASES - 2:
                return -1
            s = self.phase_slot[name] = len(self.phase_slot) + 2
            self.phase_ids[s] = self.intern(name)
        return s

    def kind_slots(self) -> dict[int, str]:
        """Phase slot -> step kind, for the kinds that have a slot."""
        return {s: KIND_PHASES[n] for n, s in self.phase_slot.items() if n in KIND_PHASES}

    def group(self, dist, group) -> tuple[int, int]:
        """(name id, size) of a process group (``None``: the default one, "world"), cached per group object."""
        key = id(group)
        g = self.groups.get(key)
        if g is None:
            try:
                size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            except Exception:  # noqa: BLE001
                size = 1
            if group is None or group is _default_group(dist):
                name = "world"          # one name for the default group, whoever passes it (None, FSDP2's pg)
            else:
                name = getattr(group, "group_desc", None) or getattr(group, "group_name", None) or f"pg{len(self.groups)}"
                if name in ("default_pg", "undefined"):
                    name = getattr(group, "group_name", None) or name
            g = self.groups[key] = (self.intern(str(name)), int(size))
            self.group_refs.append(group)          # keep it alive: its id() is our cache key
            self.group_sizes[str(name)] = int(size)
            self.hello_changed()
        return g

    def comm_slot_for(self, op: str, op_id: int, grp_id: int, size: int) -> int:
        """The accumulator slot of (op, group), created on first use (-1 when all are taken)."""
        key = (op_id, grp_id)
        s = self.comm_slot.get(key)
        if s is None:
            if len(self.comm_slot) >= MAX_COMM:
                return -1
            s = self.comm_slot[key] = len(self.comm_slot)
            self.comm_key[s] = key
            self.c_traffic[s] = traffic_factor(op, size)
        return s
