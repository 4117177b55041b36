"""Tiny ``gpt-oss`` GGUF files written from transformers models (or released-style MXFP4 folders' tensors) the
way llama.cpp's converter writes them.

The transforms follow ggml-org/llama.cpp ``convert_hf_to_gguf.py``'s ``GptOssModel``
(``conversion/gpt_oss.py``): ``sinks`` get ``.weight``; ``gate_up_proj`` ``[E, W, 2*I]`` is transposed and
split into its even (gate) and odd (up) rows, its bias likewise; ``down_proj`` ``[E, I, W]`` is transposed;
MXFP4 ``*_blocks`` / ``*_scales`` pairs become GGML MXFP4 tensors (``repack_mxfp4``: nibbles re-laid from
transformers' pairs of neighbours to ggml's halves, the exponent byte first); ``set_gguf_parameters``:
the common keys, YaRN's, ``attention.sliding_window`` and ``expert_feed_forward_length``. With ``--outtype
q8_0`` the 2-D and 3-D weights but the router are Q8_0 (biases, the experts' 2-D ones too, norms, sinks and the
router F32).
Names come from gguf-py's own table (``gguf.get_tensor_name_map``). Nothing here uses metalnn.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q


def repack_mxfp4(blocks, scales):
    """The converter's ``repack_mxfp4``: transformers' ``[E, R, G, 16]`` blocks (element ``2j`` in byte ``j``'s
    low nibble, ``2j + 1`` in its high one) and ``[E, R, G]`` exponents -> GGML MXFP4 bytes ``[E, R, G * 17]``
    (the exponent, then byte ``j`` holding element ``j`` low and ``j + 16`` high)."""
    blocks = np.asarray(blocks, np.uint8)
    codes = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    data = np.concatenate([np.asarray(scales, np.uint8)[..., None], qs], axis=-1)
    return data.reshape(data.shape[0], data.shape[1], -1)


def write(path, config, tensors: dict, qtype=Q.F32):
    """A ``gpt-oss`` file from a transformers ``GptOssConfig`` and its checkpoint tensors ``{name: numpy}``
    (float experts, or MXFP4 ``*_blocks`` / ``*_scales`` pairs); ``qtype`` F32 or Q8_0 for the float weights."""
    c = config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    w.add_expert_feed_forward_length(c.intermediate_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c.num_hidden_layers)

    def name_of(hf_name):
        return names.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    def add(hf_name, a):
        name = name_of(hf_name)
        a = np.ascontiguousarray(a, dtype=np.float32)
        if qtype != Q.F32 and a.ndim >= 2 and ".mlp.router." not in hf_name and not name.endswith(".bias"):
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    for hf_name in list(tensors):
        a = tensors[hf_name]
        if hf_name.endswith("_scales"):
            continue
        if hf_name.endswith("_blocks"):
            stem = hf_name[: -len("_blocks")]
            scales = tensors[stem + "_scales"]
            base = stem.rpartition(".")[0]
            if stem.endswith("gate_up_proj"):
                for part, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                    data = repack_mxfp4(a[:, rows], scales[:, rows])
                    w.add_tensor(name_of(f"{base}.{part}.weight"), data, raw_dtype=Q.MXFP4)
            else:
                w.add_tensor(name_of(f"{base}.down_proj.weight"), repack_mxfp4(a, scales), raw_dtype=Q.MXFP4)
            continue
        if hf_name.endswith(".sinks"):
            add(hf_name + ".weight", a)
        elif hf_name.endswith("experts.gate_up_proj_bias"):
            base = hf_name.rpartition(".")[0]
            add(f"{base}.gate_proj.bias", a[..., ::2])
            add(f"{base}.up_proj.bias", a[..., 1::2])
        elif hf_name.endswith("experts.gate_up_proj"):
            base, t = hf_name.rpartition(".")[0], np.swapaxes(a, -1, -2)
            add(f"{base}.gate_proj.weight", t[:, ::2, :])
            add(f"{base}.up_proj.weight", t[:, 1::2, :])
        elif hf_name.endswith("experts.down_proj_bias"):
            add(hf_name.rpartition(".")[0] + ".down_proj.bias", a)
        elif hf_name.endswith("experts.down_proj"):
            add(hf_name + ".weight", np.swapaxes(a, -1, -2))
        else:
            add(hf_name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
