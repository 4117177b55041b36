"""The ``metalnn`` command (also ``python -m metalnn``).

    metalnn info MODEL                      what a checkpoint holds
    metalnn generate MODEL --prompt TEXT    stream a completion (or --chat: an answer)
    metalnn chat MODEL                      talk to a model in the terminal
    metalnn serve MODEL                     OpenAI-compatible HTTP server with a chat page
    metalnn quantize MODEL OUT              write a quantized copy
    metalnn export MODEL OUT.gguf           write a GGUF file for llama.cpp / Ollama (--type Q4_K_M)
    metalnn lora MODEL --train DATA.jsonl   train LoRA adapters (PEFT format)
    metalnn dpo|orpo|kto MODEL --train ...  preference fine-tuning (TRL's losses and data)
    metalnn grpo MODEL --train P.jsonl --reward mod:fn   GRPO with reward functions (as TRL)
    metalnn bench MODEL                     prompt and generation speed

MODEL is anything `metalnn.llm.models.load_pretrained` accepts: a Hugging Face folder (float or
MLX-quantized), a ``.gguf`` file or a Hub name ``org/name``. Errors a user can fix (a missing file,
an unsupported architecture, a bad option) print one line and exit with status 1.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, chat, export, generate, grpo, info, lora, preference, quantize, serve
from .common import EXPECTED_ERRORS, one_line, use_product_inputs

COMMANDS = (info, generate, chat, serve, quantize, export, lora, preference, grpo, bench)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="metalnn", description="Run, serve, quantize and fine-tune language models with metalnn.",
        epilog="MODEL: a Hugging Face folder (float or MLX-quantized), a .gguf file or a Hub name org/name. "
               "'metalnn COMMAND --help' describes a command.")
    parser.add_argument("--version", action="version", version=f"metalnn {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv=None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        with use_product_inputs(args):
            return args.run(args) or 0
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130
    except EXPECTED_ERRORS as e:
        sys.stderr.write(f"metalnn {args.command}: error: {one_line(e)}\n")
        return 1
