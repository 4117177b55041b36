"""Training throughput (tokens/s) of a tiny Llama: metalnn vs PyTorch CPU eager vs plain mlx.nn.

The same model in all three (RoPE, causal attention, SwiGLU, RMSNorm, untied head), one AdamW
step on [batch 8, T 256] tokens per iteration. Shapes (``--shape``):

* ``mha`` (default): vocab 256, width 256, 4 layers, 4 heads (head_dim 64), SwiGLU 688;
* ``gqa``: vocab 256, width 384, 4 layers, 6 query heads sharing 2 key/value heads (3:1,
  head_dim 64), SwiGLU 1024.

* metalnn: `metalnn.llm.models.LlamaForCausalLM` trained by `metalnn.Trainer` (compiled step) with
  `metalnn.optimizers.AdamW` (mlx's AdamW with a fused CPU update);
* PyTorch: ``transformers.LlamaForCausalLM`` (SDPA attention), eager, ``torch.optim.AdamW``;
* mlx.nn: the model written directly with ``mlx.nn`` layers, ``nn.value_and_grad`` and
  ``mlx.optimizers.AdamW`` in an ``mx.compile``-d step (as MLX's own examples do).

All run in one process, mlx.core imported first as users do (metalnn's startup hook gives MLX
OpenBLAS whatever the import order). The timed steps are interleaved (one step of each framework
per round), so load from other processes on a shared machine hits all of them alike. Prints
tokens/s for each (median of the timed steps) and metalnn's ratio to the others.

    python scripts/bench_train.py [--shape mha|gqa] [--steps 10] [--warmup 3] [--threads N]

Any other Llama shape: ``--width``, ``--layers``, ``--heads``, ``--kv-heads``, ``--head-dim``,
``--hidden`` (SwiGLU width), ``--batch``, ``--seq`` and ``--vocab`` override the chosen
``--shape``'s entries (``--head-dim`` defaults to width / heads, ``--hidden`` to the multiple of 8
nearest ``8/3`` of the width), e.g. ``--width 192 --layers 3 --heads 6 --kv-heads 2 --batch 6 --seq 192``.

``--cpu-time`` times each step by the process's CPU time instead of the wall clock: with every
library on one thread (``OPENBLAS_NUM_THREADS=1 METALNN_NUM_THREADS=1 python
scripts/bench_train.py --threads 1 --cpu-time``) that compares the work each framework does,
whatever else runs on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx  # first, as users do
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

import metalnn as mn

SHAPES = {
    "mha": dict(vocab=256, dim=256, layers=4, heads=4, kv_heads=4, head_dim=64, hidden=688, seq=256, batch=8),
    "gqa": dict(vocab=256, dim=384, layers=4, heads=6, kv_heads=2, head_dim=64, hidden=1024, seq=256, batch=8),
}
CFG = dict(SHAPES["mha"])
OVERRIDES = {"--width": "dim", "--layers": "layers", "--heads": "heads", "--kv-heads": "kv_heads",
             "--head-dim": "head_dim", "--hidden": "hidden", "--batch": "batch", "--seq": "seq",
             "--vocab": "vocab"}


def custom_shape(args) -> dict:
    """``SHAPES[args.shape]`` with the command line's overrides (``--width`` ... ``--vocab``)."""
    cfg = dict(SHAPES[args.shape])
    given = {key: getattr(args, flag[2:].replace("-", "_")) for flag, key in OVERRIDES.items()}
    given = {key: val for key, val in given.items() if val is not None}
    if "dim" in given and "hidden" not in given:
        given["hidden"] = 8 * round(given["dim"] * 8 / 3 / 8)
    if ("dim" in given or "heads" in given) and "head_dim" not in given:
        given["head_dim"] = given.get("dim", cfg["dim"]) // given.get("heads", cfg["heads"])
    cfg.update(given)
    if cfg["heads"] % cfg["kv_heads"]:
        raise SystemExit(f"--heads ({cfg['heads']}) must be a multiple of --kv-heads ({cfg['kv_heads']})")
    return cfg


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG["vocab"], (CFG["batch"], CFG["seq"] + 1)).astype(np.int32) for _ in range(n)]


def timed_rounds(steps: dict, data, warmup, clock=time.perf_counter):
    """Run one step of each framework per batch, round after round; per framework: (tokens/s of
    the median timed step, the timed step durations)."""
    times = {name: [] for name in steps}
    for i, b in enumerate(data):
        for name, step in steps.items():
            t0 = clock()
            step(b)
            if i >= warmup:
                times[name].append(clock() - t0)
    tokens = CFG["batch"] * CFG["seq"]
    return {name: (tokens / statistics.median(t), t) for name, t in times.items()}


# -- metalnn ---------------------------------------------------------------------------------
def bench_metalnn():
    config = mn.models.llama_config(vocab_size=CFG["vocab"], hidden_size=CFG["dim"], num_hidden_layers=CFG["layers"],
                                    num_attention_heads=CFG["heads"], num_key_value_heads=CFG["kv_heads"],
                                    intermediate_size=CFG["hidden"], head_dim=CFG["head_dim"])
    model = mn.models.from_config(config, seed=0)
    device = mn.Device(seed=0)

    def loss_fn(model, batch, device):
        x, y = batch
        return mn.losses.cross_entropy(model.compile(device, mn.Data(x)).array, y)

    trainer = mn.Trainer(model, mn.optimizers.AdamW(1e-3), loss_fn, device=device, progress=False)
    return lambda b: trainer.step((mx.array(b[:, :-1]), mx.array(b[:, 1:])))


# -- plain mlx.nn ----------------------------------------------------------------------------
class MlxAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        self.rope = nn.RoPE(head_dim, traditional=False, base=10000.0)

    def __call__(self, x):
        b, t, d = x.shape
        q = self.q_proj(x).reshape(b, t, self.heads, -1).transpose(0, 2, 1, 3)
        k, v = (p(x).reshape(b, t, self.kv_heads, -1).transpose(0, 2, 1, 3) for p in (self.k_proj, self.v_proj))
        q, k = self.rope(q), self.rope(k)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5, mask="causal")
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MlxBlock(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim, eps=1e-5)
        self.self_attn = MlxAttention(dim, heads, CFG["kv_heads"], CFG["head_dim"])
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=1e-5)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.silu(self.gate_proj(h)) * self.up_proj(h))


class MlxLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(CFG["vocab"], CFG["dim"])
        self.layers = [MlxBlock(CFG["dim"], CFG["heads"], CFG["hidden"]) for _ in range(CFG["layers"])]
        self.norm = nn.RMSNorm(CFG["dim"], eps=1e-5)
        self.lm_head = nn.Linear(CFG["dim"], CFG["vocab"], bias=False)

    def __call__(self, x):
        h = self.embed_tokens(x)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def bench_mlx():
    mx.random.seed(0)
    model = MlxLlama()
    opt = optim.AdamW(1e-3)
    mx.eval(model.parameters())

    def loss_fn(x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step(x, y):
        loss, grads = loss_and_grad(x, y)
        opt.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)

    def run(b):
        loss = step(mx.array(b[:, :-1]), mx.array(b[:, 1:]))
        mx.eval(loss, model.parameters(), opt.state)
        loss.item()

    return run


# -- PyTorch ---------------------------------------------------------------------------------
def bench_torch():
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=CFG["vocab"], hidden_size=CFG["dim"], intermediate_size=CFG["hidden"],
                                   num_hidden_layers=CFG["layers"], num_attention_heads=CFG["heads"],
                                   num_key_value_heads=CFG["kv_heads"], head_dim=CFG["head_dim"],
                                   max_position_embeddings=CFG["seq"],
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run(b):
        t = torch.from_numpy(b.astype(np.int64))
        logits = model(t[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CFG["vocab"]), t[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()

    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="mha")
    p.add_argument("--steps", type=int, default=10, help="timed steps per framework")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="PyTorch intra-op threads (default: all cores)")
    p.add_argument("--only", choices=["metalnn", "torch", "mlx"], nargs="*", default=None)
    p.add_argument("--cpu-time", action="store_true", help="time steps by process CPU time (see above)")
    for flag, key in OVERRIDES.items():
        p.add_argument(flag, type=int, default=None, help=f"override the shape's {key}")
    args = p.parse_args(argv)
    CFG.clear()
    CFG.update(custom_shape(args))
    import torch

    torch.set_num_threads(args.threads or os.cpu_count())
    data = batches(args.steps + args.warmup)
    which = args.only or ["metalnn", "torch", "mlx"]
    print(f"load average {os.getloadavg()[0]:.2f}; tiny Llama: width {CFG['dim']}, {CFG['layers']} layers, {CFG['heads']} heads "
          f"({CFG['kv_heads']} kv heads, head_dim {CFG['head_dim']}), SwiGLU {CFG['hidden']}, T={CFG['seq']}, "
          f"batch {CFG['batch']}, vocab {CFG['vocab']}; {args.warmup} warm-up + {args.steps} timed AdamW steps; "
          f"{os.cpu_count()} cores; MLX {mx.__version__}, torch {torch.__version__}")
    steps = {name: {"metalnn": bench_metalnn, "torch": bench_torch, "mlx": bench_mlx}[name]() for name in which}
    results = {}
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.cpu_time:
        print("  (CPU time per step, not wall time)")
    for name, (rate, times) in timed_rounds(steps, data, args.warmup, clock).items():
        results[name] = rate
        print(f"  {name:8s} {rate:10,.0f} tokens/s   (median step {CFG['batch'] * CFG['seq'] / rate * 1e3:.0f} ms, "
              f"min {min(times) * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms)")
    if "metalnn" in results:
        for other, label in (("torch", "PyTorch CPU eager"), ("mlx", "plain mlx.nn")):
            if other in results:
                print(f"  metalnn / {label}: {results['metalnn'] / results[other]:.2f}x")
    return results


if __name__ == "__main__":
    main()
