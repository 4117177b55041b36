"""ZeRO-sharded training runs for tests/llm/tuner/test_zero.py, started by ``mlx.launch`` (one launch
runs every case, so the test file pays for one start of N processes).

    mlx.launch -n N --backend ring -- python zero_train.py OUT_DIR [--crash-at STEP]

Each case trains with `metalnn.Trainer(..., zero=stage)` on the same batches in every rank (the Trainer
gives each rank its 1/N of every batch); each rank writes ``<case>.rank<r>.safetensors`` (its trainable
parameters after the run) and ``rank<r>.json`` (per case: the losses, this rank's optimizer-state bytes
from `ZeroSharding.state_nbytes` and from the optimizer's own arrays). The `CASES` builders are also
what the test runs in one process, unsharded, as the reference. ``--crash-at`` runs only the first case
and SIGKILLs rank 1 at that loss evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import metalnn as mn

STEPS, BATCH = 5, 6  # 6 rows split evenly over 2 and over 3 ranks
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False)
TARGETS = ("q_proj", "v_proj", "down_proj")


def mlp():
    # 5*16 + 16 + 16*3 + 3 = 147 trainable elements: 1 element of padding over 2 ranks, none over 3
    with mn.init.seeded(0):
        return mn.Layers(mn.Linear(16, in_features=5), mn.Tanh(), mn.Linear(3, in_features=16))


def mlp_batch(step):
    rng = np.random.default_rng(step)
    return mx.array(rng.normal(size=(BATCH, 5)).astype(np.float32)), mx.array(rng.integers(0, 3, BATCH))


def mlp_loss(model, b, device):
    return mn.losses.cross_entropy(model(b[0], device=device), b[1])


def llama(bits=None):
    """A tiny random Llama with LoRA adapters (rank 4) on TARGETS; ``bits``: QLoRA on a quantized base."""
    from metalnn.llm.tuner import lora

    model = mn.models.from_config(LLAMA, seed=0)
    if bits:
        mn.quantize(model, bits=bits, group_size=32)
    mx.random.seed(0)  # the adapters' initial values
    lora.apply(model, rank=4, alpha=8.0, targets=TARGETS)
    # PEFT starts lora_B at zero; move it so every adapter matrix has a gradient from the first step
    for path, m in model.named_modules():
        if hasattr(m, "lora_B"):
            m.lora_B.weight = mx.random.normal(m.lora_B.weight.shape, key=mx.random.key(len(path))) * 0.05
    return model


def llama_batch(step):
    return mx.array(np.random.default_rng(100 + step).integers(0, LLAMA["vocab_size"], (BATCH, 9)))


def llama_loss(model, batch, device):
    return mn.losses.cross_entropy(model(batch[:, :-1], device=device), batch[:, 1:])


def adamw():
    return optim.AdamW(0.05, weight_decay=0.1)


def adamw_lora():
    # a smaller step for the adapters: Adam divides each gradient by its own scale, so an element whose
    # gradient is near zero turns the float32 rounding of a split batch into a visible update; at
    # 0.01 the data-parallel runs (sharded or not) stay within 1e-5 of one process
    return optim.AdamW(0.01, weight_decay=0.1)


def scheduled():
    warm = optim.linear_schedule(0.0, 0.08, 2)
    return optim.AdamW(optim.join_schedules([warm, optim.cosine_decay(0.08, 10)], [2]), weight_decay=0.05)


# name -> (model builder, loss, data, optimizer builder, Trainer keywords)
CASES = {
    "mlp_z1": (mlp, mlp_loss, mlp_batch, adamw, dict(zero=1)),
    "mlp_z2": (mlp, mlp_loss, mlp_batch, adamw, dict(zero=2)),
    "mlp_z2_clip_schedule": (mlp, mlp_loss, mlp_batch, scheduled, dict(zero=2, clip_grad_norm=0.05)),
    "lora_dp": (llama, llama_loss, llama_batch, adamw_lora, dict(zero=0)),  # data parallel, unsharded: the baseline
    "lora_z1_ckpt": (llama, llama_loss, llama_batch, adamw_lora, dict(zero=1, grad_checkpoint=True)),
    "lora_z2": (llama, llama_loss, llama_batch, adamw_lora, dict(zero=2)),
    "qlora_z2_ckpt": (lambda: llama(bits=4), llama_loss, llama_batch, adamw_lora, dict(zero=2, grad_checkpoint=True)),
}
RESUME_CASE, RESUME_AT = "mlp_z2_clip_schedule", 3


def trainer(case, group, **override):
    build, loss, _data, opt, kw = CASES[case]
    kw = dict(kw, **override)
    model = build()
    return mn.Trainer(model, opt(), loss, mn.Device(seed=0), progress=False, group=group, **kw)


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer's per-element state arrays (scalars such as step and learning_rate left out)."""
    return sum(a.nbytes for _, a in tree_flatten(optimizer.state) if a.ndim > 0)


def trainable(model) -> dict:
    return dict(tree_flatten(model.trainable_parameters()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--crash-at", type=int, default=None)
    args = p.parse_args()
    group = mx.distributed.init()
    rank = group.rank()
    log = {"rank": rank, "size": group.size(), "cases": {}}

    if args.crash_at is not None:
        seen = []

        def crashing(model, b, device):
            seen.append(1)
            if rank == 1 and len(seen) >= args.crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return mlp_loss(model, b, device)

        t = mn.Trainer(mlp(), adamw(), crashing, mn.Device(seed=0), compile=False, progress=False, group=group,
                       zero=2)  # eager: the loss function runs (and counts) every step
        t.fit(mlp_batch, STEPS)
        (args.out / f"rank{rank}.json").write_text(json.dumps(log))
        return 0

    for case in CASES:
        t = trainer(case, group)
        t.fit(CASES[case][2], STEPS)
        log["cases"][case] = {"loss": t.history["loss"], "zero_bytes": t.zero.state_nbytes() if t.zero else None,
                              "state_bytes": state_bytes(t.optimizer)}
        mn.save_safetensors(args.out / f"{case}.rank{rank}.safetensors", trainable(t.model))

    # a checkpoint at step RESUME_AT (gathered: every rank calls fit, rank 0 writes, every rank returns
    # once it is written), then a fresh Trainer in every rank resumes from it and runs to STEPS
    ckpt = args.out / "ckpt"
    t = trainer(RESUME_CASE, group, checkpoint_dir=ckpt, checkpoint_every=RESUME_AT)
    t.fit(CASES[RESUME_CASE][2], RESUME_AT)
    resumed = trainer(RESUME_CASE, group, checkpoint_dir=ckpt)
    assert resumed.resume() == RESUME_AT
    resumed.fit(CASES[RESUME_CASE][2], STEPS)
    log["resumed_loss"] = resumed.history["loss"]
    mn.save_safetensors(args.out / f"resumed.rank{rank}.safetensors", trainable(resumed.model))
    (args.out / f"rank{rank}.json").write_text(json.dumps(log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
