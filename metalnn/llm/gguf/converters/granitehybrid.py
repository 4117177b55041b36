"""``granitehybrid`` GGUF files (Granite 4 hybrid: Mamba2 and attention layers, experts plus a
shared MLP), as llama.cpp's ``GraniteHybridModel`` (a ``Mamba2Model`` and a ``GraniteMoeModel``)
writes them, undone into `GraniteMoeHybridForCausalLM`'s names:

* the layer kinds come from ``attention.head_count_kv``, one entry per layer (0 for a Mamba2 layer);
* Mamba2 tensors: ``ssm_in`` / ``ssm_out`` (``in_proj`` / ``out_proj``), ``ssm_conv1d`` squeezed to
  ``[C, K]`` (``conv1d.weight`` ``[C, 1, K]``), ``ssm_dt.bias`` (``dt_bias``), ``ssm_a`` ``[H, 1]``
  stored as ``-exp(A_log)`` (``A_log = log(-ssm_a)``), ``ssm_d`` ``[H, 1]`` (``D``), ``ssm_norm``
  ``[G, I / G]`` (``norm.weight`` ``[I]``);
* attention: Llama's Q/K row order (llama.cpp permutes them for its rotary embedding whether or
  not the model rotates) restored;
* experts: ``ffn_gate_exps`` / ``ffn_up_exps`` stacked back into ``block_sparse_moe.experts.gate_up_proj``,
  ``ffn_down_exps`` into ``experts.down_proj`` (decoded to float32: metalnn keeps experts in float),
  the router ``ffn_gate_inp`` into ``block_sparse_moe.gate``; the shared MLP's gate and up
  (``ffn_{gate,up}_shexp``, or ``ffn_{gate,up}`` in a file without experts) stacked back into
  ``shared_mlp.input_linear``, its down projection into ``shared_mlp.output_linear``;
* the multipliers: ``attention.scale``, ``embedding_scale``, ``residual_scale``, ``logit_scale``;
  the rotary embedding only when ``rope.scaling.finetuned`` is true (llama.cpp's rule: a hybrid
  Granite 4 has none).

The shared MLP's stacked matrix and ``ssm_norm`` / ``ssm_a`` need arithmetic, so the converter reads
Q4_0 ... Q8_0 matrices as MLX's affine groups (no GGML blocks kept).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ....errors import UnsupportedConfigError
from ..convert import BLOCK_NAMES, Converter, Misfit
from .hybrid import Parts, cat_rows, dense, put, quantization_of_tensors
from .llama import unpermute_rows

#: tensors renamed as they are (GGUF stem inside the block -> Hugging Face name inside the layer)
NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ssm_in": "mamba.in_proj", "ssm_out": "mamba.out_proj",
         "ffn_gate_inp": "block_sparse_moe.gate"}


class GraniteHybridConverter(Converter):
    """``granitehybrid`` files (see the module docstring)."""

    architecture = "granitehybrid"
    block_names = {**BLOCK_NAMES, **NAMES}
    keeps_ggml_blocks = False

    def __init__(self, header):
        # per-layer head_count_kv (0 on Mamba2 layers) -> the layer kinds and one count for the common keys
        key = f"{header.architecture}.attention.head_count_kv"
        kv = header.metadata.get(key)
        self.kv_per_layer = list(kv) if isinstance(kv, list) else None
        if self.kv_per_layer is not None:
            live = {int(n) for n in self.kv_per_layer if n}
            if len(live) > 1:
                raise UnsupportedConfigError(f"{header.path}: {key} = {kv}; expected one count for every attention "
                                             "layer")
            meta = dict(header.metadata)
            meta[key] = live.pop() if live else int(header.metadata.get(f"{header.architecture}.attention.head_count"))
            header = dataclasses.replace(header, metadata=meta)
        super().__init__(header)

    def _float(self, key: str, default: float) -> float:
        return float(self.header.metadata.get(self.prefix + key, default))

    def extra_config(self, config: dict) -> dict:
        layers = config["num_hidden_layers"]
        kv = self.kv_per_layer or [config["num_key_value_heads"]] * layers
        if len(kv) != layers:
            raise UnsupportedConfigError(f"{self.header.path}: {self.prefix}attention.head_count_kv lists {len(kv)} "
                                         f"layers, the file has {layers}")
        tensors = self.header.tensors
        experts = self.meta_int("expert_count", 0)
        shared = self.meta_int("expert_shared_feed_forward_length", 0)
        out = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
               "layer_types": ["attention" if n else "mamba" for n in kv], "num_local_experts": experts,
               "attention_multiplier": self._float("attention.scale", 1.0),
               "embedding_multiplier": self._float("embedding_scale", 1.0),
               "residual_multiplier": self._float("residual_scale", 1.0),
               "logits_scaling": self._float("logit_scale", 1.0),
               "position_embedding_type": "rope" if self.header.metadata.get(
                   self.prefix + "rope.scaling.finetuned", False) else None}
        emb = tensors.get("token_embd.weight")
        if emb is not None:
            out["vocab_size"] = int(emb.shape[0])  # the converter may pad the metadata's count
        if experts:
            out["num_experts_per_tok"] = self.meta_int("expert_used_count")
        else:  # the shared MLP is the file's ffn_gate / ffn_up / ffn_down
            up = next((tensors[f"blk.{i}.ffn_up.weight"] for i in range(layers) if f"blk.{i}.ffn_up.weight" in tensors),
                      None)
            shared = shared or (int(up.shape[0]) if up is not None else 0)
            out["intermediate_size"] = shared
        out["shared_intermediate_size"] = shared
        if "mamba" in out["layer_types"]:
            heads = self.meta_int("ssm.time_step_rank")
            inner = self.meta_int("ssm.inner_size")
            if heads <= 0 or inner % heads:
                raise UnsupportedConfigError(f"{self.header.path}: {self.prefix}ssm.inner_size = {inner} is not a "
                                             f"multiple of {self.prefix}ssm.time_step_rank (heads) = {heads}")
            out.update(mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_expand=inner / config["hidden_size"],
                       mamba_d_state=self.meta_int("ssm.state_size"), mamba_n_groups=self.meta_int("ssm.group_count"),
                       mamba_d_conv=self.meta_int("ssm.conv_kernel"),
                       mamba_conv_bias="blk.{}.ssm_conv1d.bias".format(out["layer_types"].index("mamba")) in tensors,
                       mamba_proj_bias="blk.{}.ssm_in.bias".format(out["layer_types"].index("mamba")) in tensors)
        return out

    def convert(self, arrays: dict, config: dict) -> dict:
        parts = Parts(arrays)
        arrays.clear()
        out = {}
        experts = bool(config.get("num_local_experts"))
        for i in range(config["num_hidden_layers"]):
            blk, pre = f"blk.{i}.", f"model.layers.{i}."
            dt = parts.take(blk + "ssm_dt", optional=True)
            if dt is not None:
                out[pre + "mamba.dt_bias"] = dt.get("bias", dt.get("weight"))
            for stem in ("ssm_a", "ssm_d", "ssm_norm", "ssm_conv1d"):
                p = parts.take(blk + stem, optional=True)
                if p is None:
                    continue
                w = dense(p)
                if stem == "ssm_a":
                    out[pre + "mamba.A_log"] = mx.log(-w.reshape(-1))
                elif stem == "ssm_d":
                    out[pre + "mamba.D"] = w.reshape(-1)
                elif stem == "ssm_norm":
                    out[pre + "mamba.norm.weight"] = w.reshape(-1)
                else:
                    out[pre + "mamba.conv1d.weight"] = w.reshape(w.shape[0], 1, w.shape[-1])
                    if "bias" in p:
                        out[pre + "mamba.conv1d.bias"] = p["bias"]
            sfx = "_shexp" if experts else ""
            gate, up = parts.take(blk + "ffn_gate" + sfx, optional=True), parts.take(blk + "ffn_up" + sfx, optional=True)
            if gate is not None and up is not None:
                put(out, pre + "shared_mlp.input_linear", cat_rows(gate, up))
            down = parts.take(blk + "ffn_down" + sfx, optional=True)
            if down is not None:
                put(out, pre + "shared_mlp.output_linear", down)
            if experts:
                stacked = [parts.take(blk + f"ffn_{k}_exps", optional=True) for k in ("gate", "up", "down")]
                if stacked[0] is not None and stacked[1] is not None:
                    out[pre + "block_sparse_moe.experts.gate_up_proj"] = mx.concatenate(
                        [dense(stacked[0]), dense(stacked[1])], axis=1)
                if stacked[2] is not None:
                    out[pre + "block_sparse_moe.experts.down_proj"] = dense(stacked[2])
        mx.eval(list(out.values()))
        return {**super().convert(parts.rest(), config), **out}

    def quantization(self, tensors: dict) -> dict | None:
        """MLX's affine settings of the matrices stored Q4_0 ... Q8_0 (the shared MLP's restacked one included)."""
        return quantization_of_tensors(tensors)

    def transform(self, name: str, array, config: dict):
        if ".self_attn.q_proj." not in name and ".self_attn.k_proj." not in name:
            return array
        n = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
        if array.shape[0] % (2 * n):
            raise Misfit(f"rows divisible by 2 x {n} heads")
        return unpermute_rows(array, n)
