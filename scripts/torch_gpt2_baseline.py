#!/usr/bin/env python3
"""The PyTorch baseline for issue 11's GPU comparison: a GPT-2-124M-shaped model (12 layers,
hidden 768, 12 heads, sequence 1024, vocabulary 50304; learned positions, LayerNorm, GELU, tied
head, no dropout, as `ptdp run` trains it) timed in eager mode and with torch.compile on the
same GPU. Prints one JSON line per mode: tokens/s, median step time, peak memory and MFU
(6 * parameters * tokens + attention FLOPs, over the GPU's bf16 dense peak given by --peak-tflops).
The attention FLOPs count every s x s pair, as `ptdp run` and SC'21's eq. 3 count model FLOPs,
though the causal kernel computes half of them (until 2026-11-27 this script counted the half,
so its MFU was not comparable with ptdp's).

  python3 scripts/torch_gpt2_baseline.py --dtype fp32 --batch 8 --micro 4 --steps 10

--dtype fp32 matches what ptdp's CUDA backend runs today; bf16 (autocast, fp32 master weights)
is what Megatron runs and what the bf16 backend will be measured against.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj = torch.nn.Linear(h, h)
        self.ln2 = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, 4 * h)
        self.fc2 = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        shape = (b, s, self.heads, h // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Gpt(torch.nn.Module):
    def __init__(self, layers, h, heads, seq, vocab):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, h)
        self.wpe = torch.nn.Embedding(seq, h)
        self.blocks = torch.nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.lnf = torch.nn.LayerNorm(h)

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def run(mode, a):
    torch.manual_seed(1)
    dev = torch.device("cuda")
    model = Gpt(a.layers, a.hidden, a.heads, a.seq, a.vocab).to(dev)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    step_fn = torch.compile(model) if mode == "compile" else model
    micro = a.batch // a.micro
    data = torch.randint(0, a.vocab, (a.steps + 2, a.batch, a.seq + 1), device=dev)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(a.steps + 2):  # two warm-up steps (compilation, autotuning)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(micro):
            seq = data[step, m * a.micro:(m + 1) * a.micro]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                loss = step_fn(seq[:, :-1], seq[:, 1:]) / micro
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - t0)
            losses.append(float(total))
    t = statistics.median(times)
    tokens = a.batch * a.seq
    # Model FLOPs: attention's QK^T and AV over all s x s pairs, forward and backward.
    flops = 6 * params * tokens + 12 * a.layers * a.hidden * a.seq * tokens
    return {"mode": mode, "dtype": a.dtype, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "parameters": params, "median_step_s": t,
            "tokens_per_s": tokens / t, "mfu": flops / t / (a.peak_tflops * 1e12),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "losses": [round(l, 4) for l in losses]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--micro", type=int, default=4, help="micro-batch (sequences)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="H100 SXM bf16 dense")
    p.add_argument("--modes", default="eager,compile")
    a = p.parse_args()
    if a.batch % a.micro:
        p.error("--batch must be a multiple of --micro")
    if not torch.cuda.is_available():
        p.error("no CUDA device visible")
    for mode in a.modes.split(","):
        print(json.dumps(run(mode, a)), flush=True)


if __name__ == "__main__":
    main()
