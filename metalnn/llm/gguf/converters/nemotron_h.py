"""``nemotron_h`` and ``nemotron_h_moe`` GGUF files (Nemotron-H: one mixer a layer, Mamba2, attention,
squared-ReLU MLP or experts), as llama.cpp's ``NemotronHModel`` (``conversion/nemotron.py``, a
``GraniteHybridModel``) writes them, undone into `NemotronHForCausalLM`'s names.

The converter picks ``nemotron_h_moe`` whenever the config it reads has ``num_experts_per_tok``, which
transformers 5's ``AutoConfig`` always fills in: dense models arrive under either name. Its per-layer
metadata (``attention.head_count_kv``, ``feed_forward_length``) is only right when the config spells the
layers as the Hub's ``hybrid_override_pattern`` string (with transformers 5's ``layers_block_type`` list
every entry is 0), so the layers are read off the tensors here:

* a block with ``ssm_in`` is Mamba2 (``ssm_in`` / ``ssm_out`` -> ``in_proj`` / ``out_proj``,
  ``ssm_conv1d`` ``[C, K]`` -> ``conv1d.weight`` ``[C, 1, K]``, ``ssm_dt.bias`` -> ``dt_bias``,
  ``ssm_a`` ``[H, 1]`` = ``-exp(A_log)``, ``ssm_d`` ``[H, 1]`` -> ``D``, ``ssm_norm`` ``[G, I / G]``
  -> ``norm.weight`` ``[I]``);
* with ``attn_q``, attention (``attn_{q,k,v,output}`` -> ``{q,k,v,o}_proj``): llama.cpp permutes the
  Q/K rows (Llama's rotary order) on exactly the layers it lists in ``head_count_kv`` (nonzero
  entries); those are put back;
* with ``ffn_gate_inp``, experts (``ffn_gate_inp`` -> ``gate.weight``, ``exp_probs_b.bias`` ->
  ``gate.e_score_correction_bias``, ``ffn_{up,down}_exps`` -> ``experts.{up,down}_proj``,
  ``ffn_latent_{down,up}`` -> ``fc{1,2}_latent_proj``, ``ffn_{up,down}_shexp`` -> ``shared_experts``);
* with ``ffn_up`` alone, the MLP (``ffn_{up,down}`` -> ``{up,down}_proj``);
* ``attn_norm`` is every layer's ``norm``.

The sizes come from the tensors where the metadata may be 0 (key/value heads, the MLP width) and
from the ``ssm.*`` / ``expert_*`` keys otherwise. GGUF keeps no ``time_step_min``: llama.cpp does not
clamp dt, and neither does a model read from a GGUF file. Matrices stored Q4_0 ... Q8_0 are read as
MLX's affine groups (the experts and the ``ssm_*`` tensors dequantized).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ....errors import UnsupportedConfigError, WeightLoadError
from ..convert import Converter
from .hybrid import Parts, dense, put, quantization_of_tensors
from .llama import unpermute_rows

#: GGUF stem inside a block -> the mixer's module, moved as they are
MIXER_NAMES = {"ssm_in": "in_proj", "ssm_out": "out_proj", "attn_q": "q_proj", "attn_k": "k_proj",
               "attn_v": "v_proj", "attn_output": "o_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
               "ffn_gate_inp": "gate", "ffn_latent_down": "fc1_latent_proj", "ffn_latent_up": "fc2_latent_proj",
               "ffn_up_shexp": "shared_experts.up_proj", "ffn_down_shexp": "shared_experts.down_proj"}


def block_kinds(tensors, layers: int) -> list:
    """``mamba`` / ``attention`` / ``moe`` / ``mlp`` per block from its tensor names."""
    out = []
    for i in range(layers):
        blk = f"blk.{i}."
        if blk + "ssm_in.weight" in tensors:
            out.append("mamba")
        elif blk + "attn_q.weight" in tensors:
            out.append("attention")
        elif blk + "ffn_gate_inp.weight" in tensors:
            out.append("moe")
        elif blk + "ffn_up.weight" in tensors:
            out.append("mlp")
        else:
            raise UnsupportedConfigError(f"block {i} holds none of ssm_in, attn_q, ffn_gate_inp, ffn_up: not a "
                                         "Nemotron-H layer")
    return out


class NemotronHConverter(Converter):
    """``nemotron_h`` files (see the module docstring)."""

    architecture = "nemotron_h"
    has_feed_forward_length = False  # per layer, 0 on most
    keeps_ggml_blocks = False

    def __init__(self, header):
        key = f"{header.architecture}.attention.head_count_kv"
        kv = header.metadata.get(key)
        #: the layers whose Q/K rows llama.cpp permuted (nonzero head_count_kv entries)
        self.permuted = {i for i, n in enumerate(kv) if n} if isinstance(kv, list) else None
        if isinstance(kv, list):  # one count for the common keys (the tensors decide below)
            meta = dict(header.metadata)
            meta[key] = max([int(n) for n in kv] + [1])
            header = dataclasses.replace(header, metadata=meta)
        super().__init__(header)

    def _meta(self, key: str, default=None):
        return self.header.metadata.get(self.prefix + key, default)

    def extra_config(self, config: dict) -> dict:
        tensors, layers = self.header.tensors, config["num_hidden_layers"]
        try:
            kinds = block_kinds(tensors, layers)
        except UnsupportedConfigError as e:
            raise UnsupportedConfigError(f"{self.header.path}: {e}") from None
        pattern = "".join({"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}[k] for k in kinds)
        out = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
               "hybrid_override_pattern": pattern, "layer_norm_epsilon": float(self._meta(
                   "attention.layer_norm_epsilon", self._meta("attention.layer_norm_rms_epsilon", 1e-5))),
               "time_step_min": 0.0, "tie_word_embeddings": False,
               "mlp_bias": any(f"blk.{i}.{s}.bias" in tensors for i in range(layers) for s in ("ffn_up", "ffn_up_shexp"))}
        emb = tensors.get("token_embd.weight")
        if emb is not None:
            out["vocab_size"] = int(emb.shape[0])
        if "attention" in kinds:
            k = tensors[f"blk.{kinds.index('attention')}.attn_k.weight"]
            out["num_key_value_heads"] = int(k.shape[0]) // config["head_dim"]
        if "mlp" in kinds:
            out["intermediate_size"] = int(tensors[f"blk.{kinds.index('mlp')}.ffn_up.weight"].shape[0])
        if "mamba" in kinds:
            i = kinds.index("mamba")
            heads, inner = self.meta_int("ssm.time_step_rank"), self.meta_int("ssm.inner_size")
            if heads <= 0 or inner % heads:
                raise UnsupportedConfigError(f"{self.header.path}: {self.prefix}ssm.inner_size = {inner} is not a "
                                             f"multiple of {self.prefix}ssm.time_step_rank (heads) = {heads}")
            out.update(mamba_num_heads=heads, mamba_head_dim=inner // heads, ssm_state_size=self.meta_int(
                "ssm.state_size"), n_groups=self.meta_int("ssm.group_count"), conv_kernel=self.meta_int(
                "ssm.conv_kernel"), use_conv_bias=f"blk.{i}.ssm_conv1d.bias" in tensors,
                use_bias=f"blk.{i}.ssm_in.bias" in tensors)
        if "moe" in kinds:
            i = kinds.index("moe")
            up = tensors[f"blk.{i}.ffn_up_exps.weight"]             # [E, I, L]
            shared = tensors.get(f"blk.{i}.ffn_up_shexp.weight")
            latent = tensors.get(f"blk.{i}.ffn_latent_down.weight")
            out.update(n_routed_experts=int(up.shape[0]), moe_intermediate_size=int(up.shape[1]),
                       num_experts_per_tok=self.meta_int("expert_used_count"),
                       n_group=self.meta_int("expert_group_count", 1),
                       topk_group=self.meta_int("expert_group_used_count", 1),
                       norm_topk_prob=bool(self._meta("expert_weights_norm", True)),
                       routed_scaling_factor=float(self._meta("expert_weights_scale", 1.0)),
                       moe_shared_expert_intermediate_size=int(shared.shape[0]) if shared is not None else 0,
                       moe_latent_size=int(latent.shape[0]) if latent is not None else None)
        return out

    def convert(self, arrays: dict, config: dict) -> dict:
        parts = Parts(arrays)
        arrays.clear()
        kinds = block_kinds(self.header.tensors, config["num_hidden_layers"])
        out = {}
        for name, stem in (("model.embed_tokens", "token_embd"), ("model.norm", "output_norm"), ("lm_head", "output")):
            p = parts.take(stem, optional=True)
            if p is not None:
                put(out, name, p)
        if "lm_head.weight" not in out:  # (llama.cpp reuses the embedding when a file has no output head)
            put(out, "lm_head", {k[len("model.embed_tokens."):]: a for k, a in out.items()
                                 if k.startswith("model.embed_tokens.")})
        for i, kind in enumerate(kinds):
            blk, pre = f"blk.{i}.", f"model.layers.{i}."
            put(out, pre + "norm", parts.take(blk + "attn_norm"))
            mixer = pre + "mixer."
            if kind == "mamba":
                out[mixer + "dt_bias"] = parts.take(blk + "ssm_dt")["bias"]
                out[mixer + "A_log"] = mx.log(-dense(parts.take(blk + "ssm_a")).reshape(-1))
                out[mixer + "D"] = dense(parts.take(blk + "ssm_d")).reshape(-1)
                out[mixer + "norm.weight"] = dense(parts.take(blk + "ssm_norm")).reshape(-1)
                conv = parts.take(blk + "ssm_conv1d")
                w = dense(conv)
                out[mixer + "conv1d.weight"] = w.reshape(w.shape[0], 1, w.shape[-1])
                if "bias" in conv:
                    out[mixer + "conv1d.bias"] = conv["bias"]
            elif kind == "moe":
                bias = parts.take(blk + "exp_probs_b", optional=True)
                if bias is not None:
                    out[mixer + "gate.e_score_correction_bias"] = bias["bias"].astype(mx.float32)
                for k in ("up", "down"):
                    out[mixer + f"experts.{k}_proj"] = dense(parts.take(blk + f"ffn_{k}_exps"))
            for stem, module in MIXER_NAMES.items():
                p = parts.take(blk + stem, optional=True)
                if p is None:
                    continue
                if kind == "attention" and stem in ("attn_q", "attn_k") and i in (self.permuted or ()):
                    heads = config["num_attention_heads"] if stem == "attn_q" else config["num_key_value_heads"]
                    p = {k: unpermute_rows(a, heads) for k, a in p.items()}
                put(out, mixer + module, p)
        if parts.missing:
            raise WeightLoadError(missing=parts.missing, source=str(self.header.path))
        mx.eval(list(out.values()))
        return {**parts.rest(), **out}

    def quantization(self, tensors: dict) -> dict | None:
        """MLX's affine settings of the matrices stored Q4_0 ... Q8_0."""
        return quantization_of_tensors(tensors)


class NemotronHMoEConverter(NemotronHConverter):
    """``nemotron_h_moe`` files: the same layout (llama.cpp's converter picks this name for any config
    with ``num_experts_per_tok``)."""

    architecture = "nemotron_h_moe"
