"""Generate text from a checkpoint folder with metalnn.

    python examples/generate.py PATH --prompt "And God said" --max-new-tokens 200 --temperature 0.8

PATH is a Hugging Face style folder (``config.json`` + ``model.safetensors`` or a sharded index) of
a supported architecture (Llama, GPT-2), e.g. the ``model/`` folder that examples/char_lm.py
writes. With a ``tokenizer.json`` in the folder the prompt is text and the output is decoded as it
streams; without one, the prompt is a list of token ids (``--prompt "1 2 3"``) and ids are printed.
"""

from __future__ import annotations

import argparse
import sys
import time

import metalnn as mn
import mlx.core as mx


def main(argv=None):
    p = argparse.ArgumentParser(description="Generate from a metalnn / Hugging Face checkpoint folder.")
    p.add_argument("path")
    p.add_argument("--prompt", default="", help="text (with tokenizer.json) or space-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: the checkpoint's)")
    p.add_argument("--max-context", type=int, default=None,
                   help="most positions the model sees (default: the config's max_position_embeddings / "
                        "n_positions); longer outputs continue from the most recent tokens")
    p.add_argument("--no-eos", action="store_true", help="do not stop at the end-of-sequence token")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    model = mn.models.load_pretrained(args.path, dtype=args.dtype)
    try:
        tok = mn.models.load_tokenizer(args.path)
    except FileNotFoundError:
        tok = None
    print(f"[{type(model).__name__}, {model.num_parameters():,} parameters, loaded in "
          f"{time.perf_counter() - t0:.2f} s; tokenizer: {'tokenizer.json' if tok else 'none (token ids)'}]",
          file=sys.stderr)

    if tok is not None:
        prompt = tok.encode(args.prompt) if args.prompt else []
        if not prompt:
            prompt = [tok.bos_token_id if tok.bos_token_id is not None else 0]
        eos = tok.eos_token_ids
    else:
        try:
            prompt = [int(t) for t in args.prompt.replace(",", " ").split()] or [0]
        except ValueError:
            p.error("this checkpoint has no tokenizer.json: give --prompt as token ids, e.g. --prompt '1 2 3'")
        eos = model.eos_token_id
    if args.no_eos:
        eos = ()  # never stop early

    ctx = args.max_context or model.config.get("max_position_embeddings") or model.config.get("n_positions")

    sys.stdout.write(args.prompt if tok is not None else " ".join(map(str, prompt)))
    sys.stdout.flush()
    new, shown = [], ""
    t0 = time.perf_counter()
    for token in mn.stream_generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=eos,
                                    max_context=ctx):
        new.append(token)
        if tok is not None:
            text = tok.decode(new)  # decode the whole continuation: multi-token characters come out whole
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                shown = text
        else:
            sys.stdout.write(f" {token}")
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    print()
    print(f"[{len(new)} tokens in {dt:.2f} s, {len(new) / max(dt, 1e-9):.1f} tokens/s]", file=sys.stderr)
    mx.clear_cache()
    return new


if __name__ == "__main__":
    main()
