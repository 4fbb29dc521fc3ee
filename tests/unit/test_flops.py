"""FLOPs for MFU from the model itself (issue 27): the probe counts one real training step with
``FlopCounterMode`` (or takes the analytic ``6N + 12 L H Q T``, or the user's figure, which wins), says
which in the hello, and the count reaches the ``efficiency`` rows through the agent's identity, the
alignment and the ``mfu`` detector; the compute dtype it saw picks the device peak."""
from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch", reason="counts a real PyTorch model (pip install torch==2.13.0)")
import torch.nn.functional as F  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from probe_helpers import Rx, split  # noqa: E402
from stepwatch.agents.agent import identity_from_hello  # noqa: E402
from stepwatch.agents.socket_trust import IngressLimits, check_hello  # noqa: E402
from stepwatch.agents.probe import Probe, analytic_flops_per_token  # noqa: E402
from stepwatch.detectors.base import StepBlock  # noqa: E402
from stepwatch.agents.probe.collectives import peak_tflops  # noqa: E402
from stepwatch.detectors.mfu import Mfu  # noqa: E402
from stepwatch.stream.align import JobState  # noqa: E402
import pyarrow as pa  # noqa: E402

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform

torch.set_num_threads(1)
T, D, L, H, V = 1024, 64, 2, 4, 1024          # block 1,024; tiny in width, depth and vocabulary
FUSED = [True]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.fc, self.out = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        if FUSED[0]:                                        # one fused kernel (what a GPU run uses)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:                                               # nanoGPT's explicit path: two counted bmm
            att = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, t, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """nanoGPT's shape: token and position embeddings, L blocks, a final norm, an output layer tied to
    the token embedding."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(V, D), torch.nn.Embedding(T, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(L))
        self.ln = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def gpt_step(model, opt, autocast=False):
    idx = torch.randint(0, V, (1, T))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = F.cross_entropy(model(idx).view(-1, V).float(), idx.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def mlp_and_step():
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        F.cross_entropy(model(torch.randn(32, 128)), torch.randint(0, 10, (32,))).backward()
        opt.step()
        opt.zero_grad()
    return step


def independent_count(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def hello_of(p: Probe, rx: Rx) -> dict:
    with p.step():
        pass
    p.flush()
    hello = split(rx.read())[0]
    assert hello is not None
    return hello


def efficiency_row(hello: dict, tokens=None, samples=None, step_ms=100.0) -> dict:
    """The hello through the agent's identity (topology row), the alignment's job facts and the mfu
    detector: the efficiency row of one step of one rank."""
    row = identity_from_hello(hello, "n0", None).topology_row()
    st = JobState("flops", capacity=16)
    st.set_topology(conform(pa.Table.from_pylist([row]), wire.TOPOLOGY))   # as stored
    n = lambda v: None if v is None else np.array([float(v)])  # noqa: E731
    b = StepBlock(steps=np.array([1]), t_end=np.array([10**9]), step_ms=np.array([[step_ms]]),
                  data_ms=np.zeros((1, 1)), compute_ms=np.zeros((1, 1)), comm_ms=np.zeros((1, 1)),
                  comm_wait_ms=np.zeros((1, 1)), gc_ms=np.zeros((1, 1)), tokens=n(tokens),
                  tokens_ranks=None if tokens is None else np.array([1]), samples=n(samples),
                  samples_ranks=None if samples is None else np.array([1]))
    det = Mfu()
    det.update(st.context(), b)
    return det.drain_rows()["efficiency"].to_pylist()[0]


@pytest.fixture
def live(tmp_path):
    rx = Rx(str(tmp_path))
    p = Probe().init(job="flops", rank=0, world_size=1, socket_dir=str(tmp_path), auto=False)
    yield p, rx
    p.shutdown()
    rx.close()


def test_counted_gpt_flops_reach_the_efficiency_row_and_the_analytic_is_close(live):
    p, rx = live
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the reference: torch's FlopCounterMode as is over the explicit attention (bmm: model FLOPs exactly)
    FUSED[0] = False
    try:
        ref = independent_count(lambda: gpt_step(model, opt))
    finally:
        FUSED[0] = True
    p.count_flops(gpt_step, model, opt, tokens=T)               # the probe's count, over the fused kernel
    hello = hello_of(p, rx)
    assert hello["flops_source"] == "counted" and hello["dtype"] == "fp32"
    row = efficiency_row(hello, tokens=T)
    assert row["flops_source"] == "counted" and row["dtype"] == "fp32"
    assert row["model_flops"] == pytest.approx(ref, rel=0.02)
    # torch's own count of the fused kernel: no attention at all on the CPU (no formula for its kernel)
    assert independent_count(lambda: gpt_step(model, opt)) < 0.5 * ref
    # the analytic fallback (6N + 12 L H Q T, N without the position embedding) within 5 % of the count
    ana = p.set_model_shape(layers=L, heads=H, hidden=D, seq_len=T, model=model)
    assert ana * T == pytest.approx(ref, rel=0.05)
    assert p.extra["flops_source"] == "counted"                # a count beats the shape
    # 6 x parameters alone (what MFU used before) misses the attention: > 10 % low at 1,024 tokens
    n_all = sum(q.numel() for q in model.parameters())
    assert 6 * (n_all - T * D) * T < 0.9 * ref


def test_analytic_shape_alone_is_used_with_its_source(live):
    p, rx = live
    model = GPT()
    f = p.set_model_shape(layers=L, heads=H, hidden=D, seq_len=T, model=model)
    n = sum(q.numel() for q in model.parameters()) - T * D     # wpe left out, tied wte counted once
    assert f == analytic_flops_per_token(n, L, H, D, T) == 6 * n + 12 * L * D * T
    row = efficiency_row(hello_of(p, rx), tokens=4 * T)
    assert row["flops_source"] == "analytic" and row["model_flops"] == pytest.approx(4 * T * f)
    with pytest.raises(ValueError, match="hidden .* heads"):
        analytic_flops_per_token(1e6, 2, 3, 64, 1024)
    with pytest.raises(ValueError, match="seq_len"):
        analytic_flops_per_token(1e6, 2, 4, 64, 0)


def test_counted_mlp_per_sample_and_autocast_dtype_picks_the_peak(live):
    p, rx = live
    step = mlp_and_step()
    ref = independent_count(step)
    with pytest.raises(ValueError, match="tokens= or samples="):
        p.count_flops(step)
    p.count_flops(step, samples=32)
    assert p.counted_flops == ref
    hello = hello_of(p, rx)
    assert hello["model_flops_per_sample"] == pytest.approx(ref / 32) and "model_flops_per_token" not in hello
    row = efficiency_row(dict(hello, device_type="NVIDIA H100 PCIe"), samples=32)
    assert row["flops_source"] == "counted" and row["model_flops"] == pytest.approx(ref, rel=0.02)
    assert row["dtype"] == "fp32" and row["peak_tflops"] == 51.0
    # under bf16 autocast the dtype seen is bf16: the bf16 peak applies
    q = Probe().init(job="flops2", rank=0, world_size=1, socket_dir="/nonexistent", auto=False)
    try:
        model = GPT()
        q.count_flops(gpt_step, model, torch.optim.SGD(model.parameters(), lr=0.1), autocast=True, tokens=T)
        assert q.extra["dtype"] == "bf16"
        row = efficiency_row(dict(q.hello_payload(), device_type="NVIDIA H100 PCIe"), tokens=T)
        assert row["dtype"] == "bf16" and row["peak_tflops"] == 756.0
    finally:
        q.shutdown()


def test_the_users_figure_wins_over_count_and_shape(live, tmp_path):
    p, rx = live
    step = mlp_and_step()
    p.set_flops_per_token(1234.0)
    p.count_flops(step, tokens=32)
    p.set_model_shape(layers=1, heads=1, hidden=8, seq_len=8, params=100)
    hello = hello_of(p, rx)
    assert hello["model_flops_per_token"] == 1234.0 and hello["flops_source"] == "user"
    assert p.counted_flops > 0                                   # counted all the same
    row = efficiency_row(hello, tokens=10)
    assert row["flops_source"] == "user" and row["model_flops"] == 12340.0
    # the figure given to init is the user's too
    q = Probe().init(job="f", rank=0, world_size=1, socket_dir=str(tmp_path), auto=False, model_flops_per_token=7.0)
    try:
        q.count_flops(step, tokens=32)
        assert q.extra["model_flops_per_token"] == 7.0 and q.extra["flops_source"] == "user"
    finally:
        q.shutdown()
    with pytest.raises(ValueError, match="flops must be a positive number"):
        p.set_flops_per_token(math.inf)
    # without any figure: 6 x parameters, source params; a made-up source is dropped at the agent
    hello = {"job": "j", "rank": 0, "world_size": 1, "names": {}, "model_params": 1000,
             "flops_source": "guessed"}
    assert "flops_source" not in check_hello(hello, IngressLimits())
    row = efficiency_row(hello, tokens=10)
    assert row["flops_source"] == "params" and row["model_flops"] == 60000.0


def test_peak_table_by_device_and_dtype():
    assert peak_tflops("NVIDIA H100 PCIe", "bf16")[0] == 756.0 and peak_tflops("NVIDIA H100 PCIe", "fp8")[0] == 1513.0
    assert peak_tflops("NVIDIA H100 NVL", "tf32")[0] == 418.0 and peak_tflops("NVIDIA H200 NVL", "bf16")[0] == 835.0
    assert peak_tflops("NVIDIA H200", "bf16")[0] == 989.0 and peak_tflops("NVIDIA H100 80GB HBM3", "tf32")[0] == 495.0
    assert peak_tflops("AMD Instinct MI300X", "bf16")[0] == 1307.4 and peak_tflops("AMD Instinct MI300X", "fp8")[0] == 2614.9
    assert peak_tflops("NVIDIA A100 80GB PCIe", "bf16")[0] == 312.0 and peak_tflops("NVIDIA B200", "fp8")[0] == 4500.0
    assert peak_tflops("Ascend910B3", "bf16")[0] == 313.0 and peak_tflops("Ascend910C", "bf16")[0] == 780.0
