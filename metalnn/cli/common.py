"""What the commands share: the MODEL argument, sampling options, loading, error messages."""

from __future__ import annotations

import os
import sys
import time

from ..errors import MetalnnError

MODEL_HELP = "a Hugging Face folder (float or MLX-quantized), a .gguf file or a Hub name org/name"


class CommandError(Exception):
    """A problem with what the user asked for; the command prints its message and exits with 1."""


#: exceptions that describe a problem with the input: one line, no traceback
EXPECTED_ERRORS = (CommandError, MetalnnError, OSError, ValueError, ImportError)


def one_line(error: BaseException) -> str:
    """The error's message on one line (its type name when it has none)."""
    text = " ".join(str(error).split())
    if isinstance(error, KeyError) and not isinstance(error, MetalnnError) and text.startswith("'"):
        text = f"missing key {text}"
    return text or type(error).__name__


def add_model(parser):
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)


def add_product_inputs(parser):
    """``--int8-products`` / ``--exact-products``: the GGUF products' inputs (see `use_product_inputs`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--int8-products", action="store_true", help=(
        "decode GGUF models with the products' inputs quantized to int8 per 32 values (256 for Q4_K, Q5_K, "
        "Q6_K), as llama.cpp does: "
        "1.1-1.3x faster decoding on the CPU, a little less exact (default: float32 inputs, the products of "
        "the dequantized weights, or as two int8 levels for the common types, within ~3e-6 of them)"))
    group.add_argument("--exact-products", action="store_true", help=(
        "take every GGUF product's input in float32 (by default decoding steps of the common types take it as "
        "two int8 levels: 1.04-1.3x faster decoding, within ~3e-6 of the float products)"))


def use_product_inputs(args):
    """The context in which a command runs: `metalnn.functional.ggml_int8_inputs` when the command
    has ``--int8-products`` and it was given, `metalnn.functional.ggml_exact_inputs` for
    ``--exact-products``."""
    from ..functional import ggml_exact_inputs, ggml_int8_inputs

    if getattr(args, "exact_products", False):
        return ggml_exact_inputs()
    return ggml_int8_inputs(bool(getattr(args, "int8_products", False)))


def add_adapter(parser):
    parser.add_argument("--adapter", metavar="DIR",
                        help="a LoRA adapter folder (PEFT's adapter_config.json + adapter_model.safetensors, from "
                             "'metalnn lora' or PEFT) applied to the model")


def add_sampling(parser, max_tokens: int = 256):
    """``--max-tokens`` and the sampling options (``--temperature``, ``--top-p``, ``--top-k``,
    ``--min-p``, ``--repetition-penalty``, ``--seed``); an option left out takes the model's
    ``generation_config.json`` value, else `metalnn.llm.sampling.DEFAULT_TEMPERATURE` (as the server)."""
    from ..llm.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_P

    group = parser.add_argument_group("sampling (default: the model's generation_config.json, else temperature "
                                      f"{DEFAULT_TEMPERATURE} with top-p {DEFAULT_TOP_P})")
    group.add_argument("--max-tokens", type=positive_int, default=max_tokens, metavar="N",
                       help=f"the most tokens to generate (default {max_tokens})")
    group.add_argument("--temperature", type=float, default=None, metavar="T",
                       help="sampling temperature; 0 picks the most likely token")
    group.add_argument("--top-p", type=float, default=None, metavar="P",
                       help="sample among the most likely tokens whose probabilities add up to P")
    group.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                       help="sample among the K most likely tokens")
    group.add_argument("--min-p", type=float, default=None, metavar="P",
                       help="leave out tokens less than P times as likely as the most likely one")
    group.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                       help="divide the logits of tokens already seen by R (> 1 discourages repeats)")
    group.add_argument("--seed", type=int, default=None, metavar="S", help="seed of the sampling (reproducible)")


#: `add_sampling` options -> `SamplingParams` fields
_SAMPLING_OPTIONS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                     "repetition_penalty": "--repetition-penalty", "seed": "--seed"}


def sampling(args, generation_config: dict | None = None) -> dict:
    """`TextStream` keywords from the `add_sampling` options: ``max_tokens`` and ``sampling`` (the
    `SamplingParams` of ``generation_config``, the model's, with the options given on top)."""
    from ..llm.sampling import SamplingParams

    options = {field: getattr(args, field) for field in _SAMPLING_OPTIONS}
    try:
        params = SamplingParams.from_generation_config(generation_config, **options)
    except ValueError as e:
        message = str(e)
        for field, flag in _SAMPLING_OPTIONS.items():
            message = message.replace(f"SamplingParams.{field}:", f"{flag}:")
        raise CommandError(message) from None
    return {"max_tokens": args.max_tokens, "sampling": params}


def fit_context(model, prompt_tokens: int, max_tokens: int, note=None) -> int:
    """``max_tokens`` within the model's context length: a prompt that leaves no room is refused
    (`CommandError`); when the prompt and ``max_tokens`` would run past the context, the room left
    (and ``note(text)`` says so). A model that does not state its context length is not limited."""
    context = model.context_length
    if context is None:
        return max_tokens
    room = context - prompt_tokens
    if room < 1:
        raise CommandError(f"the prompt has {prompt_tokens} tokens and the model's context length is {context} "
                           "tokens: no room is left to generate; shorten the prompt")
    if max_tokens > room:
        if note is not None:
            note(f"[--max-tokens {max_tokens} lowered to {room}: the prompt has {prompt_tokens} tokens and the "
                 f"model's context length is {context}]\n")
        return room
    return max_tokens


def positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def add_split(parser):
    """``--split``: how a run started by ``mlx.launch`` splits the model over its ranks."""
    parser.add_argument("--split", choices=("pipeline", "tensor"), default="pipeline",
                        help="under mlx.launch (several ranks, one model too large for one machine): 'pipeline' "
                             "gives each rank a run of the blocks, 'tensor' a share of every block's heads and "
                             "columns (default pipeline). Every rank reads only its part of the checkpoint and "
                             "runs the same generation; rank 0 alone writes (serve: rank 0 alone listens, the others "
                             "follow its batch). A rank that dies stops the others with an error naming it. Outside "
                             "mlx.launch the option has no effect. Example, two ranks on this machine: mlx.launch "
                             "-n 2 --backend ring -- metalnn generate MODEL --prompt TEXT; over two Macs: mlx.launch "
                             "--hostfile hosts.json --backend ring -- metalnn serve MODEL --host 0.0.0.0")


def launch_group():
    """The group of a run started by ``mlx.launch`` (None outside one)."""
    from ..llm.distributed import launch_group as group

    return group()


def shared_seed(group, seed):
    """``seed``, or (None) one drawn on rank 0 and given to every rank, so that all ranks sample alike."""
    import mlx.core as mx

    if seed is not None:
        return seed
    mine = mx.array([int.from_bytes(os.urandom(3), "little") if group.rank() == 0 else 0], dtype=mx.int32)
    return int(mx.distributed.all_sum(mine, group=group).item())


def load(path, *, tokenizer: bool = True, quiet: bool = False, adapter=None, group=None, split: str = "pipeline"):
    """``(model, tokenizer)`` of a checkpoint (tokenizer None when not asked for), with the LoRA
    adapter folder ``adapter`` applied (`metalnn.llm.tuner.adapters.use_adapter`); says on stderr
    what was loaded and how long it took. With an ``mx.distributed`` ``group``, this rank's part
    (``split``: pipeline or tensor) is loaded and `watch_peers` ends this rank when another dies."""
    from ..llm.models import load_pretrained, load_tokenizer

    start = time.perf_counter()
    if group is not None:
        from ..llm.distributed import watch_peers

        watch_peers(group)
        if adapter is not None:
            raise CommandError("--adapter is not supported with a model split over ranks")
        model = load_pretrained(path, **{split: group})
    else:
        model = load_pretrained(path)
    tok = None
    if tokenizer:
        try:
            tok = load_tokenizer(path)
        except FileNotFoundError:
            raise CommandError(f"{path}: the model has no tokenizer (tokenizer.json, or a .gguf file's "
                               "vocabulary), so text cannot be encoded") from None
    how = ""
    if adapter is not None:
        from ..llm.tuner.adapters import use_adapter

        how = f", adapter {adapter} {use_adapter(model, adapter)}"
    if not quiet:
        sys.stderr.write(f"[{model.architecture}, {model.num_layers} layers{how}, loaded in "
                         f"{time.perf_counter() - start:.1f} s]\n")
    return model, tok

