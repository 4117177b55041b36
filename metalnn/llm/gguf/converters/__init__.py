"""One `metalnn.llm.gguf.convert.Converter` per llama.cpp architecture (as llama.cpp's
``convert_hf_to_gguf.py`` has one class per model): ``llama``, ``qwen2``, ``qwen3``, ``smollm3`` (renamed
by the tables, Llama's Q/K rows and rope factors restored) and the hybrid Gated DeltaNet layouts
``qwen3next``, ``qwen35`` and ``qwen35moe`` (`hybrid`: norm offsets, ``ssm_a``, split projections, head orders
undone), ``gemma2`` / ``gemma3`` (norm gains stored as ``1 + weight``), ``deepseek2`` (DeepSeek-V3: the split
``kv_b_proj`` rejoined, experts regrouped) and ``lfm2`` (LFM2's names, the squeezed short-convolution kernels
restored, layer kinds from the per-layer key/value head counts), ``granitehybrid`` (Granite 4 hybrid: Mamba2
tensors, experts and shared MLP regrouped, Q/K rows restored), ``nemotron_h`` / ``nemotron_h_moe`` (Nemotron-H:
layer kinds read off the tensors, Mamba2 tensors and experts restored, Q/K rows restored where llama.cpp permuted
them). A model declares the converter (or converters) of its files when it registers (`metalnn.llm.models.registry.register`); there is no second table here.
"""
