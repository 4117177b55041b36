"""``metalnn generate MODEL --prompt TEXT``: stream a completion to stdout, speeds to stderr."""

from __future__ import annotations

import dataclasses
import io
import sys

from .common import (CommandError, add_adapter, add_product_inputs, add_model, add_sampling, add_split, fit_context,
                     launch_group, load, sampling, shared_seed)


def add_parser(commands):
    p = commands.add_parser("generate", help="generate text after a prompt", description=(
        "Generate text after a prompt (or, with --chat, the answer to it through the chat template), "
        "streamed to stdout as it comes; prompt and generation speeds go to stderr. The prompt and the new tokens "
        "stay within the model's context length: a prompt that fills it is refused, and --max-tokens is lowered "
        "to the room the prompt leaves (with a note on stderr)."))
    add_model(p)
    add_product_inputs(p)
    add_adapter(p)
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt ('-' reads it from stdin)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", metavar="TEXT", help="a system message (with --chat)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the text before this string (repeatable)")
    add_sampling(p)
    add_split(p)
    p.set_defaults(run=run)


def prompt_ids(tokenizer, text: str, chat: bool, system: str | None) -> list[int]:
    if system is not None and not chat:
        raise CommandError("--system needs --chat")
    if not chat:
        return tokenizer.encode(text)
    if not tokenizer.chat_template:
        raise CommandError("the model's tokenizer has no chat template; leave out --chat for plain completion")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def run(args, out=None, err=None):
    from ..llm.text_generation import TextStream

    out, err = out or sys.stdout, err or sys.stderr
    sampling(args)  # bad options are refused before the model loads
    group = launch_group()
    if group is not None and group.rank() != 0:  # every rank generates; rank 0 alone writes
        out = err = io.StringIO()
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    model, tok = load(args.model, adapter=args.adapter, group=group, split=getattr(args, "split", "pipeline"),
                      quiet=group is not None and group.rank() != 0)
    options = sampling(args, getattr(model, "generation_config", None))
    if group is not None:
        options["sampling"] = dataclasses.replace(options["sampling"], seed=shared_seed(group, options["sampling"].seed))
    ids = prompt_ids(tok, text, args.chat, args.system)
    if not ids:
        raise CommandError("the prompt encodes to no tokens; give a non-empty --prompt")
    max_tokens = fit_context(model, len(ids), options.pop("max_tokens"), err.write)
    stream = TextStream(model, tok, ids, max_tokens, stop=args.stop, **options)
    for piece in stream:
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    ended = {"stop": "end of text", "length": "--max-tokens reached", "cancelled": "stopped"}[stream.finish_reason]
    err.write(f"prompt: {stream.prompt_tokens} tokens, {stream.prompt_tps:.1f} tokens/s\n"
              f"generation: {stream.completion_tokens} tokens, {stream.generation_tps:.1f} tokens/s ({ended})\n")
