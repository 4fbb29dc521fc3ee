"""``python -m stepwatch.devtools.gpubench``: the GPU check of MFU's FLOPs and of wrap's overhead.

A GPT of nanoGPT's GPT-2-124M shape (12 layers x 12 heads x 768, block 1,024, batch ``SW_BATCH`` 32,
vocabulary 50,304, tied embeddings, ``scaled_dot_product_attention``, bf16 autocast, fused AdamW) trains
on random tokens. It prints one JSON line: the device, its median step time (ms, the script's own clock
around a synchronised step), tokens per step, the FLOPs per token three ways (the probe's count of one real
step under ``FlopCounterMode``, :func:`stepwatch.agents.probe.flops.analytic_flops_per_token` — nanoGPT's
``6N + 12·L·H·Q·T`` with N the non-position-embedding parameters — and 6N alone) and the MFU each gives
against the device's bf16 peak from the probe's table. On a CPU it runs a tiny shape in fp32 (2 x 2 x 64, block
32, batch 1) so the script itself is tested here.

``stepwatch bench gpu`` (:mod:`stepwatch.devtools.bench_gpu`) runs it plain, wrapped, plain, wrapped: the wrap
overhead is the wrapped runs' mean against the plain ones'.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C: int, H: int):
        super().__init__()
        self.H = H
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.out = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, L: int, H: int, C: int, T: int, V: int = 50304):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.head = nn.Linear(C, V, bias=False)
        self.head.weight = self.wte.weight                      # tied, as nanoGPT

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def main() -> dict:
    from stepwatch.agents import probe as P
    from stepwatch.agents.probe.collectives import peak_tflops
    from stepwatch.agents.probe.flops import analytic_flops_per_token

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    # the CPU's tiny shape: 32 tokens a step (the vocabulary's 50,304-wide head is most of a step's FLOPs)
    L, H, C, T = (12, 12, 768, 1024) if cuda else (2, 2, 64, 32)
    B = int(os.environ.get("SW_BATCH", 32 if cuda else 1))
    steps = int(os.environ.get("SW_STEPS", 60 if cuda else 6))
    torch.manual_seed(0)
    model = GPT(L, H, C, T).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x = torch.randint(0, 50304, (B, T), device=dev)
    y = torch.randint(0, 50304, (B, T), device=dev)

    def step():
        # bf16 on a GPU; on a CPU (the suite's tiny shapes) fp32: most CPUs emulate bf16 matrix products, 3 s
        # a step of this 2-layer model against ~0.1 s, and the FLOPs counted are the same
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(model(x).view(-1, 50304).float(), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    sync()
    counted = None
    if os.environ.get("SW_COUNT", "1") == "1":
        P.get().count_flops(step, tokens=B * T)
        counted = P.get().counted_flops / (B * T)
        sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(times[len(times) // 5:])
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()      # nanoGPT's N
    analytic = analytic_flops_per_token(n, L, H, C, T)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak, src = peak_tflops(name, "bf16")
    tok_s = B * T / (med / 1e3)

    def mfu(f):
        return None if f is None or not peak else round(100.0 * f * tok_s / (peak * 1e12), 2)
    out = {"device": name, "peak_bf16_tflops": peak, "peak_source": src, "shape": [L, H, C, T, B],
           "step_ms_median": round(med, 3), "step_ms_p10_p90": [round(float(q), 3) for q in
                                                              statistics.quantiles(times, n=10)[::8]],
           "tokens_per_step": B * T, "params_N": n,
           "flops_per_token": {"counted": counted, "analytic": analytic, "six_n": 6.0 * n},
           "counted_vs_analytic_pct": None if counted is None else round(100.0 * (counted / analytic - 1), 2),
           "mfu_pct": {"counted": mfu(counted), "analytic": mfu(analytic), "six_n": mfu(6.0 * n)},
           "wrapped": bool(os.environ.get("STEPWATCH_SOCKET_DIR") or os.environ.get("STEPWATCH_JOB")),
           "torch": torch.__version__}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
