"""``metalnn export MODEL OUT.gguf --type Q4_K_M``: write a model as a GGUF file llama.cpp loads."""

from __future__ import annotations

from pathlib import Path

from .common import CommandError, add_model


def add_parser(commands):
    from ..llm.gguf.export import EXPORT_TYPES

    p = commands.add_parser("export", help="write a model as a GGUF file (llama.cpp, Ollama, LM Studio)", description=(
        "Write a llama / mistral / qwen2 / qwen3 model (float, MLX-quantized, GGUF or fine-tuned with its adapters "
        "fused) as a GGUF file with llama.cpp's tensor names, metadata, tokenizer and chat template, its tensors "
        "typed as llama.cpp's mix of the same name types them."))
    add_model(p)
    p.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write")
    p.add_argument("--type", default="Q4_K_M", metavar="T",
                   help=f"the mix: {', '.join(EXPORT_TYPES)} (default Q4_K_M)")
    p.add_argument("--force", action="store_true", help="overwrite OUT.gguf if it exists")
    p.add_argument("--name", default=None, help="general.name written in the file (default: the model's name)")
    p.set_defaults(run=run)


def run(args):
    from ..llm.gguf.export import normalize_type, save_gguf
    from ..llm.gguf.reader import find_gguf
    from ..llm.hub import TOKENIZER_FILES, local_path
    from ..llm.models import load_tokenizer
    from .common import load

    try:
        export_type = normalize_type(args.type)
    except ValueError as e:
        raise CommandError(str(e)) from None
    out = Path(args.out)
    if out.exists() and not args.force:
        raise CommandError(f"{out}: already exists; give a new file or pass --force")
    if out.is_dir():
        raise CommandError(f"{out}: is a folder; give the .gguf file to write")
    model, _ = load(args.model, tokenizer=False)
    source = local_path(args.model, TOKENIZER_FILES)
    gguf_file = find_gguf(source)
    if gguf_file is not None:
        tokenizer = gguf_file  # its tokenizer.* metadata is copied as llama.cpp wrote it
    else:
        try:
            tokenizer = load_tokenizer(source)
        except (FileNotFoundError, OSError, ValueError) as e:
            raise CommandError(f"{args.model}: no tokenizer found ({e}); a GGUF file needs one") from None
    name = args.name or (Path(str(args.model)).stem if gguf_file is not None else Path(str(args.model)).name)
    save_gguf(model, out, type=export_type, tokenizer=tokenizer, name=name, force=args.force)
    print(f"wrote {out} ({export_type}, {out.stat().st_size / 1e6:.1f} MB)")
