"""One model of collectives and the hardware they run on, for the probe, the simulator and the detectors
(standard library only: the probe imports it in training processes).

- Traffic: bytes on the wire per payload byte, by op and group size (ring algorithms), and the transfer-time
  estimate the probe uses to split a collective's time into transfer and waiting (:func:`transfer_ms`).
  It is the nccl-tests size factor x bus factor (:func:`size_factor`, :func:`bus_factor`), which the
  efficiency detector uses to turn the probe's payload and time into algorithm and bus bandwidth.
- Device peaks (:data:`PEAK_TFLOPS`, :func:`device_family`, :func:`peak_tflops`) and link peaks
  (:data:`LINK_GBPS`, :data:`SATURATE_BYTES`, :func:`link_type`).

``bus_factor`` and ``size_factor`` use arithmetic only, so they take a number or a numpy array of group sizes
(``detectors/busbw.py`` wraps them for arrays). The probe's C fast path receives the traffic factor per
(op, group) slot from :func:`traffic_factor` (``hooks.py``), so it has no model of its own.
"""
from __future__ import annotations

DEFAULT_COMM_GBPS = 25.0              # nominal link bandwidth for the transfer estimate (GB/s): LINK_GBPS loopback

#: The ``torch.distributed`` functions the probe wraps (``hooks.py``), each a collective kind of ``comm`` rows.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "barrier", "all_to_all", "all_to_all_single", "gather", "scatter",
               "all_reduce_coalesced", "send", "recv", "isend", "irecv", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list", "all_gather_single",
               "reduce_scatter_single")

_RING2 = ("all_reduce",)                                        # 2(n-1)/n bus factor
_RING1 = ("all_gather", "reduce_scatter", "all_to_all")         # (n-1)/n
# *_object collectives: payload size unknown (pickled inside), so no transfer part is estimated
_NO_PAYLOAD = ("_object", "_object_list")


# --------------------------------------------------------------------------- traffic and bus factors

def bus_factor(op: str, n):
    """nccl-tests bus-bandwidth factor (busbw = algbw x factor) for ``n`` >= 1 ranks: all_reduce 2(n-1)/n;
    all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce, send/recv, gather, scatter 1."""
    o = str(op)
    if o.startswith(_RING2):
        return 2.0 * (n - 1.0) / n
    if o.startswith(_RING1):
        return (n - 1.0) / n
    return 1.0


def size_factor(op: str, n):
    """nccl-tests size S (the algbw numerator) per payload byte the probe records: all_gather's payload
    is the rank's input shard (S = n x shard); reduce_scatter's and all_to_all's is the whole input
    (S); all_reduce, broadcast, reduce: the buffer (S)."""
    return n if str(op).startswith("all_gather") else 1.0


def traffic_factor(op: str, group_size: int) -> float:
    """Bytes moved per payload byte of ``op`` in a group of ``group_size``: size factor x bus factor
    (all_reduce 2(n-1)/n, all_gather n-1, reduce_scatter and all_to_all (n-1)/n, others 1); 0 for
    ``barrier`` and the ``*_object`` collectives, whose payload is pickled inside and never counted."""
    if op == "barrier" or op.endswith(_NO_PAYLOAD):
        return 0.0
    n = float(max(group_size, 1))
    return float(size_factor(op, n) * bus_factor(op, n))


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
    return nbytes * traffic_factor(op, group_size) / (gbps * 1e9) * 1e3


# --------------------------------------------------------------------------- device peaks

#: Dense peak TFLOPS per device, by (family, dtype): the vendors' datasheets, dense (without 2:4 sparsity:
#: half the "with sparsity" figures NVIDIA prints):
#:
#: - NVIDIA H100 Tensor Core GPU datasheet (2023): H100 SXM bf16/fp16 989, fp8 1,979, tf32 495 (494.5), fp32 67;
#:   H100 PCIe bf16/fp16 756, fp8 1,513, tf32 378, fp32 51; H100 NVL bf16/fp16 835, fp8 1,671, tf32 418, fp32 60.
#: - NVIDIA H200 Tensor Core GPU datasheet (2024): H200 SXM the H100 SXM's compute (989 / 1,979 / 495 / 67);
#:   H200 NVL (PCIe card) 835 / 1,671 / 418 / 60.
#: - NVIDIA A100 Tensor Core GPU datasheet: SXM and PCIe bf16/fp16 312, tf32 156, fp32 19.5 (no fp8).
#: - NVIDIA HGX B200 (per GPU, dense): bf16/fp16 2,250, fp8 4,500, tf32 1,100, fp32 75.
#: - AMD Instinct MI300X datasheet: bf16/fp16 1,307.4, fp8 2,614.9, tf32 653.7, fp32 163.4 (MI325X: the same
#:   compute).
#: - Huawei Ascend 910B (910B3 SKU, the common training part: ~313 fp16/bf16; 910B1/B2 are higher —
#:   override); Ascend 910C (two 910B-class dies, ~780 bf16, as reported; no public datasheet).
#: - Google Cloud TPU documentation: v5e 197 bf16, v5p 459 bf16, v6e (Trillium) 918 bf16, v7x (Ironwood)
#:   2,307 bf16 / 4,614 fp8.
#: - ``cpu`` is a nominal 1 TFLOPS so CPU test jobs get a value; it is not a measurement of anything.
#:
#: The dtype is the topology's ``dtype``: the user's, else the one the probe saw the model's matrix products
#: run in (autocast's or the parameters': agents/probe/flops.py), else bf16. Override with the ``mfu``
#: detector's ``peak_tflops`` setting (``family/dtype``, ``family`` or ``*`` -> TFLOPS).
PEAK_TFLOPS: dict[tuple[str, str], float] = {
    ("h100", "bf16"): 989.0, ("h100", "fp16"): 989.0, ("h100", "fp8"): 1979.0, ("h100", "tf32"): 495.0,
    ("h100", "fp32"): 67.0,
    ("h100pcie", "bf16"): 756.0, ("h100pcie", "fp16"): 756.0, ("h100pcie", "fp8"): 1513.0,
    ("h100pcie", "tf32"): 378.0, ("h100pcie", "fp32"): 51.0,
    ("h100nvl", "bf16"): 835.0, ("h100nvl", "fp16"): 835.0, ("h100nvl", "fp8"): 1671.0, ("h100nvl", "tf32"): 418.0,
    ("h100nvl", "fp32"): 60.0,
    ("h200", "bf16"): 989.0, ("h200", "fp16"): 989.0, ("h200", "fp8"): 1979.0, ("h200", "tf32"): 495.0,
    ("h200", "fp32"): 67.0,
    ("h200nvl", "bf16"): 835.0, ("h200nvl", "fp16"): 835.0, ("h200nvl", "fp8"): 1671.0, ("h200nvl", "tf32"): 418.0,
    ("h200nvl", "fp32"): 60.0,
    ("b200", "bf16"): 2250.0, ("b200", "fp16"): 2250.0, ("b200", "fp8"): 4500.0, ("b200", "tf32"): 1100.0,
    ("b200", "fp32"): 75.0,
    ("a100", "bf16"): 312.0, ("a100", "fp16"): 312.0, ("a100", "tf32"): 156.0, ("a100", "fp32"): 19.5,
    ("mi300x", "bf16"): 1307.4, ("mi300x", "fp16"): 1307.4, ("mi300x", "fp8"): 2614.9, ("mi300x", "tf32"): 653.7,
    ("mi300x", "fp32"): 163.4,
    ("ascend910b", "bf16"): 313.0, ("ascend910b", "fp16"): 313.0, ("ascend910b", "fp32"): 78.0,
    ("ascend910c", "bf16"): 780.0, ("ascend910c", "fp16"): 780.0,
    ("tpu-v5e", "bf16"): 197.0, ("tpu-v5p", "bf16"): 459.0, ("tpu-v6e", "bf16"): 918.0,
    ("tpu-v7x", "bf16"): 2307.0, ("tpu-v7x", "fp8"): 4614.0,
    ("cpu", "bf16"): 1.0, ("cpu", "fp16"): 1.0, ("cpu", "fp32"): 1.0,
}

#: substrings of a lower-cased, space/dash-free ``device_type`` -> family, first match wins
_FAMILY_PATTERNS = (("h100pcie", "h100pcie"), ("h100nvl", "h100nvl"), ("h200nvl", "h200nvl"), ("h200", "h200"), ("h100", "h100"), ("h800", "h100"), ("gh200", "h200"), ("b200", "b200"),
                    ("a100", "a100"), ("a800", "a100"), ("910c", "ascend910c"), ("910b", "ascend910b"),
                    ("ascend910", "ascend910b"), ("v7x", "tpu-v7x"), ("ironwood", "tpu-v7x"),
                    ("v6e", "tpu-v6e"), ("trillium", "tpu-v6e"), ("v5p", "tpu-v5p"), ("v5e", "tpu-v5e"),
                    ("v5litepod", "tpu-v5e"), ("mi300x", "mi300x"), ("mi325x", "mi300x"), ("cpu", "cpu"))
_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
           "half": "fp16", "torch.float16": "fp16", "fp32": "fp32", "float32": "fp32", "float": "fp32",
           "torch.float32": "fp32", "tf32": "tf32", "fp8": "fp8", "float8": "fp8", "e4m3": "fp8", "e5m2": "fp8"}


def device_family(device_type) -> str | None:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``, ``"Ascend910B3"`` -> ``"ascend910b"``; None if unknown."""
    if not device_type:
        return None
    s = str(device_type).lower().replace(" ", "").replace("-", "").replace("_", "")
    for pat, fam in _FAMILY_PATTERNS:
        if pat in s:
            return fam
    return None


def norm_dtype(dtype) -> str:
    """Normalised dtype name (default ``bf16`` when unknown: what LLM training uses)."""
    s = str(dtype or "").lower().strip()
    if s.startswith("float8") or s.startswith("torch.float8"):
        return "fp8"
    return _DTYPES.get(s, "bf16")


def peak_tflops(device_type, dtype, table: dict[str, float] | None = None) -> tuple[float | None, str]:
    """(peak TFLOPS per device, how it was found) for a device type and dtype. ``table`` (from
    ``detectors/mfu.py:load_peak_table``) overrides the built-in :data:`PEAK_TFLOPS`."""
    fam, dt = device_family(device_type), norm_dtype(dtype)
    table = table or {}
    for key in (f"{fam}/{dt}", str(fam), "*"):
        if key in table:
            return table[key], f"override {key}"
    if fam is None:
        return None, f"unknown device type {device_type!r}"
    v = PEAK_TFLOPS.get((fam, dt))
    if v is None:
        v = PEAK_TFLOPS.get((fam, "bf16"))
        return v, f"{fam} bf16 (no {dt} entry)" if v else f"no peak for {fam}"
    return v, f"{fam} {dt}"


# --------------------------------------------------------------------------- links

#: Nominal peak bus bandwidth per device and direction (GB/s), by link type: NVLink 4 (H100/H200) 450
#: (900 GB/s bidirectional), NVLink 3 (A100) 300, NVLink 5 (B200) 900, Ascend HCCS 196 (910B: 7 links x
#: 28 GB/s per direction), TPU ICI 300 (nominal), RDMA 50 (one 400 Gb/s NIC per device; Ascend 200 Gb/s
#: RoCE: override to 25), PCIe 32 (Gen4 x16), ``loopback`` 25 (gloo on one host; the probe's default
#: transfer model). Override per type with the ``link_gbps`` setting.
LINK_GBPS: dict[str, float] = {"nvlink": 450.0, "nvlink3": 300.0, "nvlink5": 900.0, "hccs": 196.0,
                               "ici": 300.0, "rdma": 50.0, "pcie": 32.0, "loopback": DEFAULT_COMM_GBPS}
#: Payload per call from which a collective reaches most of the link's bus bandwidth (nccl-tests curves);
#: calls below 1/``small_div`` of it are "small messages".
SATURATE_BYTES: dict[str, float] = {"nvlink": 64 * 2**20, "nvlink3": 64 * 2**20, "nvlink5": 128 * 2**20,
                                    "hccs": 64 * 2**20, "ici": 64 * 2**20, "rdma": 32 * 2**20,
                                    "pcie": 8 * 2**20, "loopback": 4 * 2**20}


def intra_link(family: str | None) -> str:
    if family in ("h100", "h200"):
        return "nvlink"
    if family == "a100":
        return "nvlink3"
    if family == "b200":
        return "nvlink5"
    if family and family.startswith("ascend"):
        return "hccs"
    if family and family.startswith("tpu"):
        return "ici"
    return "loopback"


def link_type(family: str | None, nodes_in_group: int) -> str:
    """The link a group's collectives run over: within one node the device's own fabric (NVLink, HCCS,
    ICI; ``loopback`` for CPU/unknown devices), across nodes RDMA (TPU: ICI)."""
    if nodes_in_group <= 1 or family is None or family == "cpu" or (family or "").startswith("tpu"):
        return intra_link(family)
    return "rdma"
