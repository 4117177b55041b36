"""Tiny ``deepseek2`` GGUF files written from transformers' ``DeepseekV3ForCausalLM`` the way llama.cpp's
converter writes them.

The transforms follow ggml-org/llama.cpp ``conversion/deepseek.py`` ``DeepseekV2Model`` (with
``TextModel.set_gguf_parameters``): ``head_count_kv`` 1, ``key_length`` / ``value_length`` of the latent and
the per-head ``key_length_mla`` / ``value_length_mla``, ``rope.dimension_count``, the expert and group
counts, ``expert_weights_scale`` / ``expert_weights_norm``, ``expert_gating_func`` (from the config's
``scoring_func``), ``leading_dense_block_count``; ``kv_b_proj`` split per head into ``attn_k_b`` (transposed,
``[H, kv_lora_rank, nope]``) and ``attn_v_b`` (``[H, v, kv_lora_rank]``); experts stacked per layer (the
transformers 5 in-memory ``gate_up_proj`` split into gate and up); ``e_score_correction_bias`` as
``exp_probs_b.bias``; a tied ``lm_head`` left out. Names come from gguf-py's own table
(``gguf.get_tensor_name_map``). Nothing here uses metalnn.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from gguf_writing import add_tensor, expert_projections, finish

#: tensors llama.cpp's converter keeps in float32 whatever the output type (1-D ones, and the router)
KEEP_F32 = (".ffn_gate_inp.",)


def write_gguf(path, hf, qtype=Q.F32):
    """``hf`` (a transformers ``DeepseekV3ForCausalLM``) as a ``deepseek2`` file; 2-D and 3-D matrices in
    ``qtype`` (rows whose width is no multiple of 32 stay F32 as the converter leaves them), the rest F32."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c.num_hidden_layers)

    def add(name, a):
        quantized = a.ndim >= 2 and not any(k in name for k in KEEP_F32) and a.shape[-1] % 32 == 0
        add_tensor(w, name, a, qtype if quantized else Q.F32)

    h = c.num_attention_heads
    for hf_name, p in hf.state_dict().items():
        if c.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        a = p.detach().numpy().astype(np.float32)
        if hf_name.endswith("self_attn.kv_b_proj.weight"):
            kv = a.reshape(h, c.qk_nope_head_dim + c.v_head_dim, -1)
            k_b = np.ascontiguousarray(kv[:, :c.qk_nope_head_dim].transpose(0, 2, 1))
            v_b = np.ascontiguousarray(kv[:, c.qk_nope_head_dim:])
            add(names.get_name(hf_name.replace("kv_b_proj", "k_b_proj"), try_suffixes=(".weight",)), k_b)
            add(names.get_name(hf_name.replace("kv_b_proj", "v_b_proj"), try_suffixes=(".weight",)), v_b)
            continue
        if hf_name.endswith("e_score_correction_bias"):
            hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        for name, part in expert_projections(hf_name, a):
            add(names.get_name(name, try_suffixes=(".weight", ".bias")), part)
    return finish(w, path)
