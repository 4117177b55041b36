"""Pipeline- or tensor-parallel inference for tests/llm/distributed/, started by ``mlx.launch``.

    mlx.launch -n N --backend ring -- python distributed_infer.py KIND OUT_DIR MODEL... [--die-at CALL]

``KIND`` is ``pipeline`` or ``tensor``; each ``MODEL`` a checkpoint (folder or ``.gguf`` file). Every rank
loads each model's part (``load_pretrained(path, KIND=group)``) and runs the same checks: the logits of
`TOKENS`, greedy generation of `NEW` tokens from `PROMPT` (batch of 1), from `PROMPTS` (batch of 3) and
of `NEW_LONG` tokens from `LONG` (a prompt a pipeline runs as micro-batches: ``"spans"``), and writes ``OUT_DIR/rank<r>.json`` (per model: the greedy tokens, its parameter bytes, the checkpoint
tensors it read, its blocks) and ``OUT_DIR/rank<r>_<i>.npy`` (model ``i``'s logits).

``--new N``: generate N tokens from `PROMPT` and `PROMPTS` instead of `NEW` (greedy tokens are a prefix
of the longer run's).

``--die-at CALL``: rank 1 kills itself (SIGKILL) at its CALL-th call of the first model, in the middle
of the generation; the other ranks must stop with an error naming it (`watch_peers`).
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import metalnn as mn
from metalnn.llm.distributed import parameter_bytes, watch_peers
from metalnn.llm.models import load_pretrained

VOCAB = 120
TOKENS = np.random.default_rng(1).integers(0, VOCAB, (2, 9)).tolist()
PROMPT = np.random.default_rng(2).integers(0, VOCAB, 7).tolist()
PROMPTS = np.random.default_rng(3).integers(0, VOCAB, (3, 5)).tolist()
NEW = 24
LONG = np.random.default_rng(4).integers(0, VOCAB, 200).tolist()
NEW_LONG = 8


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=("pipeline", "tensor"))
    p.add_argument("out", type=Path)
    p.add_argument("models", nargs="+")
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--new", type=int, default=NEW, help="tokens generated from PROMPT and PROMPTS")
    args = p.parse_args()
    group = mx.distributed.init()
    rank = group.rank()
    watch_peers(group, interval=0.5)
    report = {"rank": rank, "size": group.size(), "models": []}
    for i, path in enumerate(args.models):
        model = load_pretrained(path, **{args.kind: group})
        if args.die_at is not None and i == 0 and rank == 1:
            calls = [0]
            forward = model.forward

            def dying(device, data, cache=None):
                calls[0] += 1
                if calls[0] >= args.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return forward(device, data, cache=cache)

            object.__setattr__(model, "forward", dying)
        logits = model(mx.array(TOKENS))
        mx.eval(logits)
        np.save(args.out / f"rank{rank}_{i}.npy", np.array(logits))
        one = mn.generate(model, PROMPT, max_new_tokens=args.new)
        three = mn.generate(model, mx.array(PROMPTS), max_new_tokens=args.new)
        long = mn.generate(model, LONG, max_new_tokens=NEW_LONG)
        report["models"].append({"greedy1": [int(t) for t in one], "greedy3": np.array(three).tolist(),
                                 "long": [int(t) for t in long], "spans": model.prefill_spans(len(LONG) - 1),
                                 "bytes": parameter_bytes(model), "reads": list(model.weight_reads),
                                 "blocks": list(model._shard.blocks), "class": type(model).__name__})
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
