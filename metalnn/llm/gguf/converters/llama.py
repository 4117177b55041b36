"""``llama`` GGUF files (Llama 1-3, and Mistral, which llama.cpp writes as ``llama``).

llama.cpp's ``LlamaModel`` converter reorders the rows of the query and key projections (so that its
rotary embedding can rotate adjacent pairs); `LlamaConverter` puts them back, row by row, so the
tensors equal the original checkpoint's and metalnn's (half-split) RoPE applies. Llama 3's rope
scaling arrives as a ``rope_freqs`` tensor of per-frequency factors; it becomes the config's
``rope_freq_factors``.
"""

from __future__ import annotations

import mlx.core as mx

from ..convert import Converter, Misfit


def unpermute_rows(a, n_heads: int):
    """Undo llama.cpp's Q/K row order: within each head, rows ``[x0, x1, ..., y0, y1, ...]`` were
    stored interleaved ``[x0, y0, x1, y1, ...]``. Works on any array whose rows are the projection's
    outputs (packed weights ``[rows, packed cols]``, scales, biases, bias vectors ``[rows]``)."""
    rows = a.shape[0]
    half = rows // n_heads // 2
    return a.reshape(n_heads, half, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


class LlamaConverter(Converter):
    """``llama`` files: gguf-py's standard names, Q/K rows restored, ``rope_freqs`` to config."""

    architecture = "llama"

    def convert(self, arrays: dict, config: dict) -> dict:
        factors = arrays.pop("rope_freqs.weight", None)  # Llama 3 rope scaling, one factor per frequency
        if factors is not None:
            config["rope_freq_factors"] = [float(f) for f in factors.astype(mx.float32).tolist()]
        return super().convert(arrays, config)

    def transform(self, name: str, array, config: dict):
        if ".self_attn.q_proj." not in name and ".self_attn.k_proj." not in name:
            return array
        n = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
        if array.shape[0] % (2 * n):
            raise Misfit(f"rows divisible by 2 x {n} heads")
        return unpermute_rows(array, n)
