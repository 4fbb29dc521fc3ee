"""The probe's collective traffic model: bytes on the wire per payload byte, by op and group size (ring
algorithms), and the transfer-time estimate that splits a collective's time into transfer and waiting."""
from __future__ import annotations

DEFAULT_COMM_GBPS = 25.0              # nominal link bandwidth for the transfer estimate (GB/s)

_TRAFFIC = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_reduce_coalesced": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: float(n - 1),
    "all_gather_into_tensor": lambda n: float(n - 1),
    "all_gather_single": lambda n: float(n - 1),
    "reduce_scatter": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_single": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "gather": lambda n: 1.0,
    "scatter": lambda n: 1.0, "send": lambda n: 1.0, "recv": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}
# *_object collectives: payload size unknown (pickled inside), so no transfer part is estimated



def transfer_ms(op: str, nbytes: int, group_size: int, gbps: float) -> float:
    """Estimated pure transfer time of one collective (ms): bytes on the wire / link bandwidth.

    The probe splits a synchronous collective's wall time ``t`` into ``comm_ms = min(t, transfer)``
    and ``comm_wait_ms = t - comm_ms`` (time blocked waiting for peers). On CPU/gloo a rank cannot see
    when its peers arrived, so the transfer part comes from a bandwidth model; an error in it shifts
    every rank of a data-parallel group by the same amount (same bytes, same model), so it never
    hides a straggler: the slow rank arrives last, waits least and keeps the highest busy time
    (step - comm wait). A per-rank minimum of observed times would not do: a rank that always waits
    for the same straggler never sees a wait-free call.
    """
    if gbps <= 0 or nbytes <= 0:
        return 0.0
    f = _TRAFFIC.get(op)
    moved = nbytes * (f(max(group_size, 1)) if f else 1.0)
    return moved / (gbps * 1e9) * 1e3


def traffic_factor(op: str, group_size: int) -> float:
    """Bytes moved per payload byte of ``op`` in a group of ``group_size`` (1 for an op the model does not
    know; 0 for the ``*_object`` collectives, whose payload is pickled inside and never counted)."""
    f = _TRAFFIC.get(op)
    if f is not None:
        return f(max(group_size, 1))
    return 0.0 if op.endswith(("_object", "_object_list")) else 1.0
