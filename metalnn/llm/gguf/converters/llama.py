"""``llama`` GGUF files (Llama 1-3, and Mistral, which llama.cpp writes as ``llama``).

llama.cpp's ``LlamaModel`` converter reorders the rows of the query and key projections (so that its
rotary embedding can rotate adjacent pairs); `LlamaConverter` puts them back, row by row, so the
tensors equal the original checkpoint's and metalnn's (half-split) RoPE applies. Llama 3's rope
scaling arrives as a ``rope_freqs`` tensor of per-frequency factors; it becomes the config's
``rope_freq_factors``.

Mixtral files are ``llama`` files too, with ``<arch>.expert_count`` / ``expert_used_count`` metadata,
the router ``blk.N.ffn_gate_inp`` and the experts stacked per layer (``ffn_gate_exps``,
``ffn_up_exps`` ``[E, I, W]``, ``ffn_down_exps`` ``[E, W, I]``, from Mixtral's ``w1``, ``w3``, ``w2``).
When a file has them, the config names ``MixtralForCausalLM`` and the experts become its stacked
``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``, decoded to float32 (metalnn keeps experts
in float). A file without experts is read as before.
"""

from __future__ import annotations

import mlx.core as mx

from ..convert import BLOCK_NAMES, Converter, Misfit

#: a Mixtral block's router (GGUF stem inside ``blk.N.`` -> Hugging Face name inside ``model.layers.N.``)
ROUTER = {"ffn_gate_inp": "mlp.gate"}


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
    block_names = {**BLOCK_NAMES, **ROUTER}

    def extra_config(self, config: dict) -> dict:
        """Mixtral's keys when the file has experts (``expert_count`` > 0), none otherwise."""
        experts = self.meta_int("expert_count", 0)
        if experts <= 0:
            return {}
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
                "num_experts_per_tok": self.meta_int("expert_used_count")}

    def convert(self, arrays: dict, config: dict) -> dict:
        factors = arrays.pop("rope_freqs.weight", None)  # Llama 3 rope scaling, one factor per frequency
        if factors is not None:
            config["rope_freq_factors"] = [float(f) for f in factors.astype(mx.float32).tolist()]
        experts = self.experts(arrays) if config.get("num_local_experts") else {}
        return {**super().convert(arrays, config), **experts}

    def experts(self, arrays: dict) -> dict:
        """The stacked experts of every block (taken out of ``arrays``) as float32
        ``model.layers.N.mlp.experts.gate_up_proj`` ``[E, 2*I, W]`` (gate rows, then up rows) and
        ``.down_proj`` ``[E, W, I]``."""
        out = {}
        for i in range(self.meta_int("block_count")):
            gate, up, down = (self.dense(arrays, f"blk.{i}.ffn_{kind}_exps.weight") for kind in ("gate", "up", "down"))
            pre = f"model.layers.{i}.mlp.experts."
            if gate is not None and up is not None:
                out[pre + "gate_up_proj"] = mx.concatenate([gate, up], axis=1)
                mx.eval(out[pre + "gate_up_proj"])
            if down is not None:
                out[pre + "down_proj"] = down
        return out

    def transform(self, name: str, array, config: dict):
        if ".self_attn.q_proj." not in name and ".self_attn.k_proj." not in name:
            return array
        n = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
        if array.shape[0] % (2 * n):
            raise Misfit(f"rows divisible by 2 x {n} heads")
        return unpermute_rows(array, n)
