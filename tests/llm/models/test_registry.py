"""The registry of architectures (one, keyed by Hugging Face architecture, model_type and GGUF architecture)
and the typed ModelArgs of each architecture (unknown keys ignored, defaults declared once, unsupported values
refused naming the field, the value and what is supported)."""

import dataclasses

import pytest

import metalnn as mn
from metalnn.errors import UnsupportedConfigError
from metalnn.llm.models import (ARCHITECTURES, CausalLM, deepseek_v3, gemma2, gemma3, gpt2, gpt_oss,
                                granitemoehybrid, lfm2, llama, mistral, mixtral, nemotron_h, phi3, qwen2, qwen3, qwen3_5,
                                qwen3_5_moe, qwen3_moe, qwen3_next, smollm3)
from metalnn.llm.models.registry import Registry, register

LLAMA = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
HYBRID = dict(LLAMA, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
              layer_types=["linear_attention", "full_attention", "linear_attention"], num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12)


def _config(module) -> dict:
    """A valid config for ``module``'s ModelArgs."""
    if module is gpt2:
        return dict(vocab_size=40, n_embd=32, n_layer=2, n_head=4)
    if module in (qwen3_next, qwen3_5, qwen3_5_moe):
        return dict(HYBRID)
    if module is lfm2:
        return dict(LLAMA, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    if module is granitemoehybrid:
        return dict(LLAMA, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_state=8)
    if module is nemotron_h:
        return dict(LLAMA, hybrid_override_pattern="M*-E", num_key_value_heads=2, mamba_num_heads=4, n_groups=2,
                    n_routed_experts=4)
    return dict(LLAMA, sliding_window=4)


def test_one_registry_keyed_three_ways():
    names = {"LlamaForCausalLM": mn.models.LlamaForCausalLM, "GPT2LMHeadModel": mn.models.GPT2LMHeadModel,
             "Qwen2ForCausalLM": mn.models.Qwen2ForCausalLM, "Qwen3ForCausalLM": mn.models.Qwen3ForCausalLM,
             "MistralForCausalLM": mn.models.MistralForCausalLM, "Phi3ForCausalLM": mn.models.Phi3ForCausalLM,
             "Qwen3NextForCausalLM": mn.models.Qwen3NextForCausalLM,
             "Qwen3MoeForCausalLM": mn.models.Qwen3MoeForCausalLM,
             "Qwen3_5ForCausalLM": mn.models.Qwen3_5ForCausalLM,
             "Qwen3_5ForConditionalGeneration": mn.models.Qwen3_5ForCausalLM,
             "Gemma2ForCausalLM": mn.models.Gemma2ForCausalLM, "Gemma3ForCausalLM": mn.models.Gemma3ForCausalLM,
             "Gemma3ForConditionalGeneration": mn.models.Gemma3ForCausalLM,
             "SmolLM3ForCausalLM": mn.models.SmolLM3ForCausalLM, "MixtralForCausalLM": mn.models.MixtralForCausalLM,
             "Qwen3_5MoeForCausalLM": mn.models.Qwen3_5MoeForCausalLM,
             "Qwen3_5MoeForConditionalGeneration": mn.models.Qwen3_5MoeForCausalLM,
             "DeepseekV3ForCausalLM": mn.models.DeepseekV3ForCausalLM,
             "Lfm2ForCausalLM": mn.models.Lfm2ForCausalLM, "LFM2ForCausalLM": mn.models.Lfm2ForCausalLM,
             "GptOssForCausalLM": mn.models.GptOssForCausalLM,
             "GraniteMoeHybridForCausalLM": mn.models.GraniteMoeHybridForCausalLM,
             "NemotronHForCausalLM": mn.models.NemotronHForCausalLM}
    assert dict(ARCHITECTURES) == names
    types = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
             "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "phi3": "Phi3ForCausalLM",
             "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
             "smollm3": "SmolLM3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
             "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
             "deepseek_v3": "DeepseekV3ForCausalLM", "lfm2": "Lfm2ForCausalLM",
             "gpt_oss": "GptOssForCausalLM", "granitemoehybrid": "GraniteMoeHybridForCausalLM",
             "nemotron_h": "NemotronHForCausalLM"}
    for model_type, name in types.items():
        assert ARCHITECTURES.for_model_type(model_type).model is names[name]
        assert mn.models.model_class({"model_type": model_type}) is names[name]
    ggufs = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "qwen3next": "Qwen3NextForCausalLM", "qwen35": "Qwen3_5ForCausalLM", "phi3": "Phi3ForCausalLM",
             "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
             "qwen3moe": "Qwen3MoeForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
             "deepseek2": "DeepseekV3ForCausalLM", "lfm2": "Lfm2ForCausalLM",
             "gpt-oss": "GptOssForCausalLM", "granitehybrid": "GraniteMoeHybridForCausalLM",
             "nemotron_h": "NemotronHForCausalLM", "nemotron_h_moe": "NemotronHForCausalLM"}
    assert set(ARCHITECTURES.gguf_converters()) == set(ggufs)
    for arch, name in ggufs.items():
        entry = ARCHITECTURES.for_gguf(arch)
        assert entry.model is names[name] and entry.gguf.architecture == arch
    # the first name and model type are what save_pretrained writes
    assert (mn.models.Qwen3_5ForCausalLM.architecture, mn.models.Qwen3_5ForCausalLM.model_type) == \
        ("Qwen3_5ForCausalLM", "qwen3_5_text")
    assert (mn.models.Qwen3_5MoeForCausalLM.architecture, mn.models.Qwen3_5MoeForCausalLM.model_type) == \
        ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")
    with pytest.raises(UnsupportedConfigError, match="unsupported architecture BertModel; metalnn supports .*GPT2"):
        mn.models.model_class({"architectures": ["BertModel"]})


def test_register_refuses_a_taken_key_and_a_class_without_model_args():
    registry = Registry()

    @dataclasses.dataclass
    class ModelArgs(mn.models.BaseModelArgs):
        vocab_size: int

    class Foo(CausalLM):
        args_class = ModelArgs

    register("FooForCausalLM", model_types=("foo",), registry=registry)(Foo)
    assert registry["FooForCausalLM"] is Foo and Foo.architecture == "FooForCausalLM"

    class Bar(CausalLM):
        args_class = ModelArgs

    with pytest.raises(ValueError, match="already registered: model_type 'foo'"):
        register("BarForCausalLM", model_types=("foo",), registry=registry)(Bar)
    with pytest.raises(ValueError, match="already registered: class Foo"):
        register("Foo2ForCausalLM", model_types=("foo2",), registry=registry)(Foo)

    class NoArgs(CausalLM):
        pass

    with pytest.raises(TypeError, match="args_class"):
        register("NoArgsForCausalLM", model_types=("none",), registry=registry)(NoArgs)
    assert list(registry) == ["FooForCausalLM"]


@pytest.mark.parametrize("module", [llama, gpt2, qwen2, qwen3, mistral, qwen3_next, qwen3_5, phi3, gemma2, gemma3,
                                    smollm3, mixtral, qwen3_moe, qwen3_5_moe, deepseek_v3, lfm2, gpt_oss,
                                    granitemoehybrid])
def test_model_args_ignore_unknown_keys_and_name_missing_ones(module):
    required = [f.name for f in dataclasses.fields(module.ModelArgs)
                if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    config = _config(module)
    args = module.ModelArgs.from_dict(dict(config, some_key_nobody_reads=1, architectures=["X"]))
    assert not hasattr(args, "some_key_nobody_reads")
    with pytest.raises(UnsupportedConfigError, match=f"lacks {required[1]}, {required[2]} \\(required\\)"):
        module.ModelArgs.from_dict({k: v for k, v in config.items() if k not in required[1:3]})


def test_defaults_are_declared_once_and_taken_for_absent_or_null_keys():
    args = llama.ModelArgs.from_dict(dict(LLAMA, head_dim=None, rms_norm_eps=None, rope_theta=500000))
    assert args.head_dim == 8 and args.num_key_value_heads == 4  # derived from the widths
    assert args.rms_norm_eps == 1e-6 and args.rope_theta == 500000.0 and isinstance(args.rope_theta, float)
    assert args.rope["rope_base"] == 500000.0
    assert qwen3.ModelArgs.from_dict(LLAMA).head_dim == 128
    s = smollm3.ModelArgs.from_dict(LLAMA)  # transformers' SmolLM3Config defaults
    assert (s.num_key_value_heads, s.rope["rope_base"], s.tie_word_embeddings) == (4, 2e6, True)
    assert s.uses_rope == [True, True] and s.windows == [None, None]
    assert qwen3_next.ModelArgs.from_dict(HYBRID).rope["rope_dims"] == 4  # partial_rotary_factor 0.25 of 16
    q = qwen3_next.ModelArgs.from_dict(dict(HYBRID, mlp_only_layers=[2]))
    assert [q.is_sparse(i) for i in range(3)] == [True, True, False]
    m = qwen3_moe.ModelArgs.from_dict(LLAMA)  # transformers' Qwen3MoeConfig defaults
    assert (m.num_experts, m.num_experts_per_tok, m.norm_topk_prob, m.head_dim) == (128, 8, False, 128)
    assert qwen3_moe.ModelArgs.from_dict(dict(LLAMA, num_local_experts=6, num_experts_per_tok=2)).num_experts == 6
    model = mn.models.from_config(dict(LLAMA, architectures=["LlamaForCausalLM"]))
    assert model.args.vocab_size == model.vocab_size == 40 and model.context_length is None


@pytest.mark.parametrize("module, key, value, words", [
    (llama, "hidden_act", "swiglu7", "hidden_act = 'swiglu7' is not supported (supported: "),
    (llama, "num_hidden_layers", 2.5, "num_hidden_layers = 2.5 is not supported (supported: an integer)"),
    (llama, "rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported (supported: "
                                                                      "default, linear, llama3, yarn)"),
    (gpt2, "activation_function", "mish", "activation_function = 'mish' is not supported (supported: gelu_new"),
    (gpt2, "add_cross_attention", True, "add_cross_attention = True is not supported"),
    (mistral, "sliding_window", -4, "sliding_window = -4 is not supported (supported: a positive integer or null)"),
    (qwen2, "layer_types", ["full_attention", "chunked_attention"],
     "layer_types[1] = 'chunked_attention' is not supported (supported: full_attention, sliding_attention)"),
    (qwen3_next, "linear_num_value_heads", 3,
     "linear_num_value_heads = 3 is not supported (supported: a positive multiple of linear_num_key_heads = 2)"),
    (qwen3_next, "decoder_sparse_step", 0, "decoder_sparse_step = 0 is not supported (supported: a positive"),
    (qwen3_moe, "decoder_sparse_step", 0, "decoder_sparse_step = 0 is not supported (supported: a positive"),
    (qwen3_moe, "num_experts_per_tok", 0, "num_experts_per_tok = 0 is not supported (supported: 1 to num_experts"),
    (qwen3_5_moe, "num_experts_per_tok", 9,
     "num_experts_per_tok = 9 is not supported (supported: 1 to num_experts (4))"),
    (qwen3_5, "layer_types", None, "full_attention_interval = 0 is not supported (supported: a positive"),
    (smollm3, "no_rope_layers", [1, -1], "no_rope_layers[1] = -1 is not supported (supported: 1 (RoPE), 0 (no RoPE))"),
    (mixtral, "num_experts_per_tok", 9,
     "num_experts_per_tok = 9 is not supported (supported: an integer in [1, num_local_experts=8])"),
    (gpt_oss, "num_local_experts", 0, "num_local_experts = 0 is not supported (supported: a positive integer)"),
    (gpt_oss, "layer_types", ["full_attention"], "layer_types must list one entry per layer (num_hidden_layers=2)"),
    (mixtral, "router_jitter_noise", 0.1, "router_jitter_noise = 0.1 is not supported (supported: 0 (router noise"),
    (deepseek_v3, "scoring_func", "softmax", "scoring_func = 'softmax' is not supported (supported: sigmoid)"),
    (smollm3, "sliding_window", 0, "sliding_window = 0 is not supported (supported: a positive integer or null)"),
    (lfm2, "layer_types", ["conv", "linear_attention"],
     "layer_types[1] = 'linear_attention' is not supported (supported: conv, full_attention)"),
    (lfm2, "num_key_value_heads", 3, "num_key_value_heads = 3 is not supported (supported: a positive divisor of "
                                     "num_attention_heads = 4)"),
    (granitemoehybrid, "mamba_n_groups", 3, "mamba_n_groups = 3 is not supported (supported: a divisor of mamba_n_heads"),
    (granitemoehybrid, "layer_types", ["mamba", "sliding_attention"],
     "layer_types[1] = 'sliding_attention' is not supported (supported: linear_attention, mamba, full_attention"),
    (nemotron_h, "n_groups", 3, "n_groups = 3 is not supported (supported: a divisor of mamba_num_heads = 4)"),
    (nemotron_h, "hybrid_override_pattern", "M*X", "layers_block_type[2] = 'X' is not supported (supported: "
                                                  "linear_attention, mamba, M, full_attention"),
])
def test_unsupported_values_name_the_field_the_value_and_what_is_supported(module, key, value, words):
    config = _config(module)
    config[key] = value
    if module is qwen3_5:
        config["full_attention_interval"] = 0
    with pytest.raises(UnsupportedConfigError) as e:
        module.ModelArgs.from_dict(config)
    assert words in str(e.value)
    # through the model, the message starts with the architecture
    cls = ARCHITECTURES.entries()[[e.model.__module__ for e in ARCHITECTURES.entries()].index(module.__name__)].model
    with pytest.raises(UnsupportedConfigError, match=f"^{cls.architecture}: "):
        cls(config)
