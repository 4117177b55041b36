"""Shared helpers of the model tests: tiny random transformers models with perturbed gains, loading
them in metalnn, and the comparisons (logits, greedy generation, loss and gradients)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
import transformers
from mlx.utils import tree_flatten

import metalnn as mn
from metalnn.llm.models import load_pretrained

transformers.logging.set_verbosity_error()

#: transformers' zero-centred RMSNorm classes (gain 1 + weight)
ZERO_CENTRED = ("Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


def hf_model(config_cls, model_cls, seed=0, **config):
    """A tiny random transformers model in eval mode, eager attention, no BOS/EOS/PAD (so greedy
    generation is never steered by end-of-sequence handling), with its gains, decay biases and
    decay rates moved off their initial values (so ones and zeros cannot hide a wrong formula)."""
    torch.manual_seed(seed)
    cfg = config_cls(**config, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                     attn_implementation="eager")
    model = model_cls(cfg).eval()
    perturb(model, seed)
    return model


def perturb(model, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            name = type(module).__name__
            if name.endswith(("RMSNorm", "RMSNormGated")) and getattr(module, "weight", None) is not None:
                w = module.weight
                low = -0.5 if name in ZERO_CENTRED else 0.5          # gains between 0.5 and 1.5
                w.copy_(low + torch.rand(w.shape, generator=g))
            if hasattr(module, "dt_bias"):
                module.dt_bias.copy_(torch.rand(module.dt_bias.shape, generator=g) * 2 - 1)
                module.A_log.copy_(torch.log(0.2 + 2 * torch.rand(module.A_log.shape, generator=g)))


def save_and_load(hf, folder):
    hf.save_pretrained(folder)
    return load_pretrained(folder)


def tokens(vocab, shape, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def hf_logits(hf, toks):
    with torch.no_grad():
        return hf(torch.tensor(toks)).logits.float().numpy()


def max_error(got, want):
    return float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())


def hf_greedy(hf, prompt, n):
    """transformers' greedy continuation of ``prompt`` ``[B, T]`` by ``n`` tokens."""
    prompt = torch.tensor(prompt)
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False)
    return out[:, prompt.shape[1]:].numpy()


def hf_loss_and_grads(hf, toks, **kwargs):
    """Next-token cross-entropy (mean) and ``{parameter name: gradient}`` by torch autograd."""
    hf.zero_grad()
    out = hf(torch.tensor(toks), labels=torch.tensor(toks), **kwargs)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.numpy().copy() for n, p in hf.named_parameters() if p.grad is not None}


def lm_loss(model, toks, device=None):
    logits = model(toks, device=device)
    return mn.losses.cross_entropy(logits[:, :-1], toks[:, 1:])


def mn_loss_and_grads(model, toks, loss_fn=lm_loss, device=None):
    toks = mx.array(toks)
    loss, grads = nn.value_and_grad(model, lambda t: loss_fn(model, t, device))(toks)
    return loss.item(), {k: np.array(v) for k, v in tree_flatten(grads)}


def relative_error(got, want):
    """``max |got - want| / max |want|``."""
    want = np.asarray(want, np.float64)
    return max_error(got, want) / max(float(np.abs(want).max()), 1e-30)


def small_chunks(model, size=8):
    """Run the chunked gated delta rule of every Gated DeltaNet block over ``size``-token chunks, so
    short test prompts span several chunks."""
    for block in model.model.layers:
        if "linear_attn" in block:
            block.linear_attn.chunk_size = size
    return model


def saved_checkpoints(tmp_path_factory, models, prepare=None):
    """``{name: (transformers model, metalnn model, folder)}`` for ``{name: transformers model}``: each
    saved with save_pretrained into its own temporary folder and loaded back with metalnn (then passed
    through ``prepare``, e.g. `small_chunks`, when given); for a module-scoped ``checkpoints`` fixture."""
    out = {}
    for name, hf in models.items():
        folder = tmp_path_factory.mktemp(name)
        model = save_and_load(hf, folder)
        out[name] = (hf, prepare(model) if prepare else model, folder)
    return out
