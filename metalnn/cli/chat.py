"""``metalnn chat MODEL``: a conversation in the terminal.

Each answer streams as it is generated; the history goes through the chat template at every turn.
``/reset`` starts over, ``/exit`` (or Ctrl-D) leaves, Ctrl-C stops the current answer (and, at the
prompt, clears the line) without leaving. When the conversation outgrows the model's context length,
the oldest turns are dropped (with a note; the system message stays), and a message too long on its
own is refused without ending the chat (`metalnn.llm.chat.ChatSession`).
"""

from __future__ import annotations

import sys

from .common import add_adapter, add_product_inputs, add_model, add_sampling, load, sampling

HELP = "[/reset starts over, /exit or Ctrl-D leaves, Ctrl-C stops an answer]\n"


def add_parser(commands):
    p = commands.add_parser("chat", help="chat with a model in the terminal", description=(
        "Chat with a model through its chat template. /reset starts over, /exit or Ctrl-D leaves, "
        "Ctrl-C stops the current answer. When the conversation and --max-tokens no longer fit the model's "
        "context length, the oldest turns are dropped (the system message stays) and a note says so; an answer "
        "may get fewer tokens than --max-tokens when the message leaves less room; a message too long on its "
        "own is refused and the chat goes on."))
    add_model(p)
    add_product_inputs(p)
    add_adapter(p)
    p.add_argument("--system", metavar="TEXT", help="a system message at the start of the conversation")
    add_sampling(p, max_tokens=512)
    p.set_defaults(run=run)


def _stdout(text):
    sys.stdout.write(text)
    sys.stdout.flush()


def _stderr(text):
    sys.stderr.write(text)
    sys.stderr.flush()


def chat_loop(session, read=input, write=_stdout, status=_stderr) -> int:
    """Talk through ``session`` (a `metalnn.llm.chat.ChatSession`): lines from ``read(prompt)``, answers
    to ``write``, notes and speeds to ``status``. Returns 0 at ``/exit`` or end of input."""
    from ..llm.chat import ContextFull

    status(HELP)
    while True:
        try:
            line = read("> ")
        except EOFError:
            write("\n")
            return 0
        except KeyboardInterrupt:
            write("\n")
            status("[/exit or Ctrl-D leaves]\n")
            continue
        line = line.strip()
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            session.reset()
            status("[conversation cleared]\n")
            continue
        if line in ("/help", "/?"):
            status(HELP)
            continue
        if not line:
            continue
        try:
            stream = session.ask(line)
        except ContextFull as e:
            status(f"[not sent: {e}]\n")
            continue
        context = getattr(session.model, "context_length", None)
        if session.dropped:
            status(f"[the {session.dropped} oldest message{'s' if session.dropped > 1 else ''} dropped to fit the "
                   f"model's context length of {context} tokens]\n")
        if stream.max_tokens < session.options["max_tokens"]:
            status(f"[this answer has room for {stream.max_tokens} tokens in the context length of {context}]\n")
        try:
            for piece in stream:
                write(piece)
        except KeyboardInterrupt:
            stream.close()
        write("\n")
        note = ", stopped" if stream.finish_reason == "cancelled" else ""
        status(f"[{stream.completion_tokens} tokens, {stream.generation_tps:.1f} tokens/s{note}]\n")


def run(args):
    from ..llm.chat import ChatSession

    sampling(args)  # bad options are refused before the model loads
    model, tok = load(args.model, adapter=args.adapter)
    options = sampling(args, getattr(model, "generation_config", None))
    session = ChatSession(model, tok, system=args.system, **options)
    return chat_loop(session)
