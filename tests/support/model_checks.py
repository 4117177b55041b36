"""The checks every model-family test makes against transformers and torch, one function each.

Each function takes the transformers model ``hf`` (built with `hf_models.hf_model`: eval mode, eager
attention, no BOS/EOS/PAD, gains moved off their initial values), the metalnn model loaded from the
same weights, and the vocabulary size; keyword options cover what differs between families (token
shapes and seeds, the tensors that must have gradients, the loss). Each asserts, naming what differs
and by how much, and returns what a test may check further (family-specific assertions stay in the
test files).

Tolerances (the defaults; a test passes others only with its own reason):

* ``LOGITS_TOL`` = 2e-4, absolute, for logits: two float32 implementations of a few-layer model whose
  logits are O(1) agree to ~1e-6 (~1e-5 with experts or recurrent layers), so 2e-4 leaves room for
  summation order only, far below what a wrong formula moves;
* ``GRAD_TOL`` = 1e-3 for the loss (relative to the loss) and for the gradient of every parameter,
  relative to the largest entry of that gradient (float32 backward through a few layers: entries
  near zero carry absolute rounding noise, so a per-entry relative bound would be meaningless);
* ``AUX_TOL`` = 1e-5 relative for an MoE model's load-balancing loss (one float32 reduction);
* bfloat16 logits within 1.5x transformers' own bfloat16 error against float32 on the rounded weights
  (the margin is for a different summation order in bfloat16);
* greedy tokens identical: the tiny random models' top logits are far enough apart that summation
  order never changes an argmax in these runs;
* ``KERNELS_TOL`` = 1e-4, absolute, for logits and gradients on the emulated Metal kernels against the
  reference path (the kernels sum in another order).

A test module's ``checkpoints`` fixture comes from `hf_models.saved_checkpoints`
(``{name: (hf, model, folder)}``); the examples below take one of its entries.

    from model_checks import assert_logits_match, assert_greedy_matches, assert_batched_rows_match

    assert_logits_match(hf, model, VOCAB)                       # [2, 13] tokens, seed 1
    assert_greedy_matches(hf, model, VOCAB, n=24)               # batch 1 and 3, prompts [3, 7], seed 2
    assert_batched_rows_match(hf, model, VOCAB)                 # BatchGenerator rows joining late
    assert_loss_and_gradients_match(hf, model, VOCAB, must_include=["model.embed_tokens.weight"])
    assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB)
    assert_aux_loss_matches(hf, model, VOCAB, ["model.layers.0.mlp.gate.weight"])  # MoE families
    assert_bfloat16_as_close_as_transformers(folder, VOCAB)
    assert_lora_trains(folder, VOCAB, PROJECTIONS, want_paths)  # LoRA on the family's projections
    assert_info_features(folder, "FooForCausalLM", ["q/k RMSNorm", ...])  # `metalnn info`
    assert_emulated_kernels_match(model, VOCAB, monkeypatch, {"ssd_forward", "ssd_backward"})
"""

import json
import re

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
import torch
import transformers
from mlx.utils import tree_flatten

import metalnn as mn
from metalnn.llm.batching import BatchGenerator
from metalnn.llm.models import load_pretrained

from commands import metalnn_cmd
from hf_models import (hf_greedy, hf_logits, hf_loss_and_grads, lm_loss, max_error, mn_loss_and_grads,
                       relative_error, tokens)

LOGITS_TOL = 2e-4
GRAD_TOL = 1e-3
#: the load-balancing loss of MoE models: one float32 reduction on both sides
AUX_TOL = 1e-5
#: the emulated Metal kernels against the reference path: the kernels sum in another order
KERNELS_TOL = 1e-4


def _prefix(label):
    return f"{label}: " if label else ""


def assert_logits_match(hf, model, vocab, shape=(2, 13), seed=1, *, toks=None, tol=LOGITS_TOL, label=""):
    """metalnn's logits on ``tokens(vocab, shape, seed)`` (or on ``toks`` ``[B, T]`` when given) are
    within ``tol`` (absolute) of transformers'. Returns the largest difference."""
    toks = tokens(vocab, shape, seed=seed) if toks is None else np.asarray(toks)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < tol, f"{_prefix(label)}logits differ by {err:.3g} (tolerance {tol:g})"
    return err


def assert_greedy_matches(hf, model, vocab, n=24, shape=(3, 7), seed=2, *, label=""):
    """Greedy generation of ``n`` tokens through the caches equals transformers' ``generate`` for the
    first prompt of ``tokens(vocab, shape, seed)`` alone (a token list) and for all of them as one
    batch ``[B, T]``; the first continuation holds more than 3 distinct tokens (the random model does
    not just repeat one token). Returns transformers' tokens ``[B, n]``."""
    prompt = tokens(vocab, shape, seed=seed)
    want = hf_greedy(hf, prompt, n)
    assert len(set(want[0].tolist())) > 3, f"{_prefix(label)}transformers repeats itself: {want[0].tolist()}"
    assert mn.generate(model, prompt[0].tolist(), n) == want[0].tolist(), f"{_prefix(label)}batch of 1"
    np.testing.assert_array_equal(np.array(mn.generate(model, mx.array(prompt), n)), want,
                                  err_msg=f"{_prefix(label)}batch of {shape[0]}")
    return want


def assert_batched_rows_match(hf, model, vocab, *, seed=9, prompt_lengths=(3, 11, 6, 1), limits=(20, 9, 14, 21),
                              first=2, join_after=2, prefill_chunk=4, lone=None, max_steps=200):
    """`BatchGenerator` rows (chunked prefill of ``prefill_chunk`` tokens, left-aligned rows at their
    own positions) each get the greedy tokens of their prompt alone.

    Prompts of ``prompt_lengths`` tokens are drawn from ``np.random.default_rng(seed)``; row ``i``
    generates ``limits[i]`` tokens. The first ``first`` rows are added at once, the others join after
    ``join_after`` steps, while those decode. ``lone(prompt, n)`` gives a row's expected tokens (a
    list); by default transformers' greedy continuation of that prompt alone. Returns the sequences."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, n).tolist() for n in prompt_lengths]
    gen = BatchGenerator(model, prefill_chunk=prefill_chunk)
    seqs = [gen.add(p, n) for p, n in zip(prompts[:first], limits[:first])]
    steps = 0
    while gen:
        gen.step()
        steps += 1
        if steps == join_after:
            seqs += [gen.add(p, n) for p, n in zip(prompts[first:], limits[first:])]
        assert steps < max_steps
    assert len(seqs) == len(prompts), f"the generator finished before step {join_after}"
    if lone is None:
        def lone(p, n):
            return hf_greedy(hf, np.array([p]), n)[0].tolist()
    for i, (seq, p, n) in enumerate(zip(seqs, prompts, limits)):
        assert seq.tokens == lone(p, n), f"row {i} (prompt of {len(p)} tokens)"
    return seqs


def assert_loss_and_gradients_match(hf, model, vocab, shape=(2, 11), seed=3, *, must_include=(), nonzero=False,
                                    skip=(), loss_fn=lm_loss, hf_kwargs=None, tol=GRAD_TOL, label="", rename=None,
                                    metalnn_only=()):
    """The loss (``loss_fn(model, tokens, device)``, next-token cross-entropy by default) and the
    gradient of every parameter on ``tokens(vocab, shape, seed)`` match torch autograd through
    transformers (called with ``labels`` and ``hf_kwargs``): the loss within ``tol`` of it, each
    gradient within ``tol`` of its largest entry. Both sides have gradients for the same parameters,
    ``must_include`` among them; with ``nonzero`` every reference gradient has a nonzero entry (the
    test's tokens reach every parameter). Parameters in ``skip`` are left to the caller.
    ``rename(name)`` gives metalnn's name of a torch parameter where a family names one otherwise;
    ``metalnn_only`` names metalnn parameters that torch holds as buffers: they must be there, with
    all-zero gradients. Returns ``(loss, gradients, reference loss, reference gradients)`` (gradients
    by name, the reference ones under metalnn's names)."""
    toks = tokens(vocab, shape, seed=seed)
    ref_loss, ref = hf_loss_and_grads(hf, toks, **(hf_kwargs or {}))
    if rename is not None:
        ref = {rename(k): v for k, v in ref.items()}
    loss, got = mn_loss_and_grads(model, toks, loss_fn)
    assert abs(loss - ref_loss) < tol * abs(ref_loss), f"{_prefix(label)}loss {loss} != {ref_loss}"
    extra = set(metalnn_only)
    assert extra <= set(got), f"{_prefix(label)}no gradient for {sorted(extra - set(got))}"
    assert not any(np.any(got[k]) for k in extra), f"{_prefix(label)}a buffer of torch's gets a gradient"
    mine = set(got) - extra
    assert mine == set(ref), \
        f"{_prefix(label)}only metalnn: {sorted(mine - set(ref))}, only torch: {sorted(set(ref) - mine)}"
    missing = set(must_include) - set(got)
    assert not missing, f"{_prefix(label)}no gradient for {sorted(missing)}"
    for k in ref:
        if k in skip:
            continue
        if nonzero:
            assert np.abs(ref[k]).max() > 0, f"{_prefix(label)}the reference gradient of {k} is zero"
        err = relative_error(got[k], ref[k])
        assert err < tol, f"{_prefix(label)}gradient of {k} differs by {err:.3g} of its largest entry"
    return loss, got, ref_loss, ref


def assert_aux_loss_matches(hf, model, vocab, gate_keys, shape=(2, 9), seed=4, *, tol=AUX_TOL):
    """An MoE model's load-balancing loss equals transformers' ``aux_loss`` (within ``tol`` relative),
    `aux_loss` releases the router logits it used, and the loss plus ``router_aux_loss_coef`` times
    it has transformers' value and gradients for the routers named in ``gate_keys`` (`GRAD_TOL`);
    without ``output_router_logits``, `aux_loss` raises a ValueError naming it."""
    toks = tokens(vocab, shape, seed=seed)
    with torch.no_grad():
        want_aux = hf(torch.tensor(toks), output_router_logits=True).aux_loss.item()
    ref_loss, ref = hf_loss_and_grads(hf, toks, output_router_logits=True)
    coef = model.config["router_aux_loss_coef"]

    def total(m, t, device):
        return lm_loss(m, t, device) + coef * m.aux_loss()

    model.output_router_logits = True
    try:
        model(mx.array(toks))
        aux = model.aux_loss().item()
        assert abs(aux - want_aux) < tol * want_aux, f"aux loss {aux} != {want_aux}"
        assert model.router_logits() == []  # aux_loss releases them
        loss, got = mn_loss_and_grads(model, toks, total)
    finally:
        model.output_router_logits = False
    assert abs(loss - ref_loss) < GRAD_TOL * abs(ref_loss), f"loss with aux loss {loss} != {ref_loss}"
    for k in gate_keys:
        assert relative_error(got[k], ref[k]) < GRAD_TOL, k
    with pytest.raises(ValueError, match="output_router_logits"):
        model.aux_loss()


def assert_saved_folder_loads_in_transformers(hf, model, folder, vocab, *, architecture=None, model_type=None,
                                              lengths=(12,), seed=4, reload=False, tol=LOGITS_TOL):
    """``model.save_pretrained(folder)`` writes a config naming ``architecture`` and ``model_type``
    (by default the model class's) that transformers' ``AutoModelForCausalLM`` loads back as ``hf``'s
    class, giving ``hf``'s logits within ``tol`` on ``tokens(vocab, (1, length), seed)`` for each of
    ``lengths``; with ``reload``, metalnn's `load_pretrained` of the folder gives them too.
    Returns transformers' model of the folder."""
    architecture = architecture or type(model).architecture
    model_type = model_type or type(model).model_type
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [architecture] and cfg["model_type"] == model_type, \
        (cfg["architectures"], cfg["model_type"])
    back = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert type(back) is type(hf), type(back)
    again = load_pretrained(folder) if reload else None
    for length in lengths:
        toks = tokens(vocab, (1, length), seed=seed)
        want = hf_logits(hf, toks)
        err = max_error(hf_logits(back, toks), want)
        assert err < tol, f"transformers' logits of the saved folder differ by {err:.3g} ({length} tokens)"
        if again is not None:
            err = max_error(again(mx.array(toks)), want)
            assert err < tol, f"metalnn's logits of the saved folder differ by {err:.3g} ({length} tokens)"
    return back


def assert_bfloat16_as_close_as_transformers(folder, vocab, shape=(2, 20), seed=9, *, margin=1.5):
    """Loaded from ``folder`` in bfloat16, metalnn's logits stay as close to a float32 run on the
    bfloat16-rounded weights as transformers' own bfloat16 run does (``margin`` times its error, for
    a different summation order) on ``tokens(vocab, shape, seed)``. Returns the bfloat16 model."""
    toks = tokens(vocab, shape, seed=seed)
    rounded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                                attn_implementation="eager").eval()
    hf_bf16 = hf_logits(rounded, toks)
    want = hf_logits(rounded.float(), toks)
    model = load_pretrained(folder, dtype="bfloat16")
    got = model(mx.array(toks))
    assert got.dtype == mx.bfloat16, got.dtype
    err, ref_err = max_error(got.astype(mx.float32), want), max_error(hf_bf16, want)
    assert err < margin * ref_err, f"bfloat16 logits off by {err:.3g}, transformers' by {ref_err:.3g}"
    return model


def assert_lora_trains(folder, vocab, targets, want_paths, *, shape=(4, 17), seed=7, steps=4, lr=2e-2,
                       min_drop=0.01, prepare=None):
    """LoRA adapters of rank 4 on the ``targets`` projections of the model in ``folder`` (passed through
    ``prepare`` first when given, e.g. `hf_models.small_chunks`) sit exactly at ``want_paths`` (module
    paths, any order), and ``steps`` Adam steps (learning rate ``lr``) through `metalnn.Trainer` on one
    fixed batch ``tokens(vocab, shape, seed)`` lower the next-token loss by more than ``min_drop``.
    Returns the adapted model."""
    mx.random.seed(0)
    model = load_pretrained(folder)
    if prepare is not None:
        model = prepare(model)
    paths = mn.lora.apply(model, rank=4, alpha=8.0, targets=targets)
    assert sorted(paths) == sorted(want_paths), sorted(set(paths) ^ set(want_paths))
    batch = mx.array(tokens(vocab, shape, seed=seed))
    loss = lambda m, b, d: mn.losses.cross_entropy(m(b[:, :-1], device=d), b[:, 1:])  # noqa: E731
    trainer = mn.Trainer(model, optim.Adam(lr), loss, mn.Device(seed=0), progress=False)
    trainer.fit(lambda step: batch, steps)
    losses = trainer.history["loss"]
    assert losses[-1] < losses[0] - min_drop, losses
    return model


def assert_info_features(folder, architecture, features):
    """``metalnn info FOLDER`` succeeds, names ``architecture`` and prints ``features`` (a list of
    strings, in order) on its features line; ``--json`` gives the same list."""
    result = metalnn_cmd("info", folder)
    assert result.returncode == 0, result.stderr
    assert re.search(r"architecture\s+" + re.escape(architecture) + r"\b", result.stdout), result.stdout
    assert re.search(r"features\s+" + re.escape("; ".join(features)) + "\n", result.stdout), result.stdout
    assert json.loads(metalnn_cmd("info", folder, "--json").stdout)["features"] == features


def assert_emulated_kernels_match(model, vocab, monkeypatch, kernels, shape=(1, 7), seed=7, *, atol=KERNELS_TOL):
    """The whole model on the emulated Metal kernels gives the reference path's logits and gradient of
    every parameter (next-token loss) on ``tokens(vocab, shape, seed)``, within ``atol`` (absolute),
    and the ``kernels`` named (a set of kernel names, e.g. ``{"ssd_forward", "ssd_backward"}``) ran.
    ``monkeypatch`` is pytest's (it records the launches)."""
    from kernel_cases import spy_launches

    toks = mx.array(tokens(vocab, shape, seed=seed))
    ref_dev, emu_dev = mn.Device(kernels="reference"), mn.Device(kernels="emulate")
    launches = spy_launches(monkeypatch)
    np.testing.assert_allclose(np.array(model(toks, device=emu_dev)), np.array(model(toks, device=ref_dev)),
                               atol=atol)
    g_ref = dict(tree_flatten(nn.value_and_grad(model, lambda t: lm_loss(model, t, ref_dev))(toks)[1]))
    g_emu = dict(tree_flatten(nn.value_and_grad(model, lambda t: lm_loss(model, t, emu_dev))(toks)[1]))
    ran = launches.names()
    assert set(kernels) <= ran, ran
    assert g_ref.keys() == g_emu.keys()
    for k in g_ref:
        np.testing.assert_allclose(np.array(g_emu[k]), np.array(g_ref[k]), atol=atol, err_msg=k)
