"""``metalnn quantize MODEL OUT --bits 4 --group-size 64``: write a quantized copy of a model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .common import CommandError, add_model, load


def add_parser(commands):
    p = commands.add_parser("quantize", help="write a quantized copy of a model", description=(
        "Quantize a float model's linear and embedding layers (MLX's affine format) and write the result as a "
        "Hugging Face folder (config.json with its 'quantization', model.safetensors, the tokenizer files) that "
        "metalnn and MLX load."))
    add_model(p)
    p.add_argument("out", metavar="OUT", help="the folder to write (must not exist, or be empty)")
    p.add_argument("--bits", type=int, default=4, help="bits per weight (default 4; affine mode: 1-6 or 8)")
    p.add_argument("--group-size", type=int, default=64, help="weights per scale and bias (32, 64 or 128; default 64)")
    p.set_defaults(run=run)


def copy_tokenizer(source, folder: Path) -> bool:
    """Put the tokenizer of ``source`` (a model folder, .gguf file or Hub name) into ``folder``:
    a folder's tokenizer files are copied as they are; a GGUF file's vocabulary is written as a
    ``tokenizer.json``. Returns False when the model has no tokenizer."""
    from ..llm.gguf.reader import find_gguf
    from ..llm.hub import TOKENIZER_FILES, local_path
    from ..llm.models import load_tokenizer

    path = local_path(source, TOKENIZER_FILES)
    if path.is_dir() and (path / "tokenizer.json").exists():
        for name in TOKENIZER_FILES:
            if name != "config.json" and (path / name).exists():
                shutil.copy2(path / name, folder / name)
        return True
    if find_gguf(path) is not None:
        load_tokenizer(path).save(folder)
        return True
    return False


def run(args):
    from ..quantization import quantize, quantized_layers

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CommandError(f"{out}: already exists and is not an empty folder; give a new folder")
    model, _ = load(args.model, tokenizer=False)
    if quantized_layers(model):
        raise CommandError(f"{args.model}: the model is already quantized; quantize a float checkpoint")
    summary = quantize(model, bits=args.bits, group_size=args.group_size)
    if not summary.quantized:
        raise CommandError(f"no layer could be quantized with group size {args.group_size}: "
                           + "; ".join(f"{k}: {v}" for k, v in list(summary.skipped.items())[:4]))
    # write next to OUT, then move into place: a failure leaves no half-written folder
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        has_tokenizer = copy_tokenizer(args.model, tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{summary}\nwrote {out}" + ("" if has_tokenizer else " (the model has no tokenizer to copy)"))
