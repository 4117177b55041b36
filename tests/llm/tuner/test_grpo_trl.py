"""GRPO's loss, advantages, metrics and gradients against TRL's `GRPOTrainer` on the same inputs.

A tiny random Llama (transformers) with a character-level tokenizer; fixed prompts, fixed
completions (TRL's sampling is replaced by a function returning them, so TRL builds its own
inputs dict: its prompt tokenisation, left padding, completion masks, reward calls, advantages and
reference log-probabilities) and reward functions, one of which gives no reward (None) for some
completions. TRL's ``_generate_and_score_completions`` and ``_compute_loss`` (with autograd) are the
oracle; metalnn loads the same checkpoint and scores the same completions with its `GRPOTrainer`.

The reference model is a second random Llama (so the KL term and its gradient are not zero), and
one case gives both sides the same "old" log-probabilities away from the current ones, so ratios
leave the clipping range and the clip metrics count something.

Tolerances: loss, metrics and each gradient within 1e-3 relative (to the loss, the metric, or the
largest entry of the gradient) in float32: both sides sum the same few hundred terms in a different
order, so they agree to ~1e-6; a loss near 0 (the advantages of a group sum to 0) is compared
within 1e-6 absolute. Advantages within 1e-5 absolute (float32 arithmetic on values of order 1).
"""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from datasets import Dataset
from mlx.utils import tree_flatten
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from metalnn.llm.models import load_pretrained, load_tokenizer
from metalnn.llm.tuner.grpo import GRPOConfig, GRPOTrainer, Rollout, prompt_ids

import trl  # noqa: E402  (the oracle; in the [test] extra: a missing install fails, never skips)

transformers.logging.set_verbosity_error()
TOL = 1e-3
CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 +=?<>/."))
TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")
G = 3
RECORDS = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "what is 12?", "answer": "12"}]


def text(c):
    return c if isinstance(c, str) else c[0]["content"]


def contains_answer(prompts, completions, answer, **kwargs):
    return [float(a in text(c)) for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    """No reward (None) for completions longer than 4 characters."""
    return [None if len(text(c)) > 4 else -len(text(c)) / 3 for c in completions]


def write_model(folder, seed, vocab):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2,
                                   rms_norm_eps=1e-5, eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"],
                                   bos_token_id=None, attn_implementation="eager", tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # gains off 1, so a wrong norm cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    vocab = {c: i for i, c in enumerate(CHARS)}
    for s in ("<unk>", "<pad>", "<eos>"):
        vocab[s] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", "<pad>", "<eos>"])
    out = {}
    for name, seed in (("policy", 0), ("ref", 1)):
        folder = write_model(tmp_path_factory.mktemp(name), seed, vocab)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "eos_token": "<eos>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": TEMPLATE}))
        out[name] = folder
    out["eos"], out["vocab"] = vocab["<eos>"], vocab
    return out


def completions_of(folders):
    """Fixed completions as TRL's generation returns them: cut after the first EOS (kept), or
    ``max_completion_length`` tokens without one (truncated)."""
    v, eos = folders["vocab"], folders["eos"]
    ids = lambda s: [v[ch] for ch in s]  # noqa: E731
    return [ids("3") + [eos], ids("12 abc"), [eos], ids("12") + [eos], ids("x 12.."), ids("9") + [eos]]


def trl_side(folders, records, *, loss_type, beta, scale_rewards="group", old_noise=None, weights=(1.0, 0.5),
             bias_correction=True):
    """TRL's inputs dict, advantages, loss, gradients and metrics for the fixed completions."""
    args = trl.GRPOConfig(output_dir=str(folders["policy"] / "trl"), per_device_train_batch_size=2 * G,
                          num_generations=G, max_completion_length=6, beta=beta, loss_type=loss_type,
                          scale_rewards=scale_rewards, report_to=[], use_cpu=True, bf16=False,
                          gradient_checkpointing=False, reward_weights=list(weights),
                          use_bias_correction_kl=bias_correction, model_init_kwargs={"dtype": torch.float32})
    tr = trl.GRPOTrainer(model=str(folders["policy"]), reward_funcs=[contains_answer, short], args=args,
                         train_dataset=Dataset.from_list(records),
                         processing_class=transformers.AutoTokenizer.from_pretrained(folders["policy"]))
    if beta:
        tr.ref_model = transformers.AutoModelForCausalLM.from_pretrained(folders["ref"], dtype=torch.float32).eval()
    comps = completions_of(folders)
    tr._generate_single_turn = lambda *a, **k: (comps, None)
    tr.current_gradient_accumulation_steps = 1
    tr.model.train()
    inputs = tr._generate_and_score_completions([r for r in records for _ in range(G)])
    if old_noise is not None:
        with torch.no_grad():
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            logps, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, inputs["completion_ids"].size(1))
        inputs["old_per_token_logps"] = logps + torch.tensor(old_noise)
    tr.model.zero_grad()
    loss = tr._compute_loss(tr.model, inputs)
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in tr.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in tr._metrics["train"].items()}
    return inputs, loss.item(), grads, metrics


def mine(folders, records, *, loss_type, beta, scale_rewards="group", weights=(1.0, 0.5), bias_correction=True):
    model = load_pretrained(folders["policy"])
    tok = load_tokenizer(folders["policy"])
    ref = load_pretrained(folders["ref"]) if beta else None
    cfg = GRPOConfig(num_generations=G, max_completion_length=6, beta=beta, loss_type=loss_type,
                     scale_rewards=scale_rewards, reward_weights=weights, use_bias_correction_kl=bias_correction)
    trainer = GRPOTrainer(model, tok, [contains_answer, short], records, cfg, ref_model=ref, batch_size=2 * G)
    rows = [r for r in records for _ in range(G)]
    comps = completions_of(folders)
    ro = Rollout(rows, [prompt_ids(tok, r["prompt"]) for r in rows], comps,
                 [c[-1] != folders["eos"] for c in comps], [trainer.decode(r, c) for r, c in zip(rows, comps)])
    return trainer, trainer.score(ro)


def close(got, want, what):
    scale = abs(want)
    assert abs(got - want) <= max(TOL * scale, 1e-6), f"{what}: {got} vs TRL {want}"


def conversational(records):
    return [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in records]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("chat", [False, True], ids=["standard", "conversational"])
def test_advantages_and_reward_metrics_equal_trls(folders, scale_rewards, chat):
    records = conversational(RECORDS) if chat else RECORDS
    inputs, _, _, metrics = trl_side(folders, records, loss_type="dapo", beta=0.0, scale_rewards=scale_rewards)
    trainer, ro = mine(folders, records, loss_type="dapo", beta=0.0, scale_rewards=scale_rewards)
    # the same prompt tokens (TRL left-pads them) and completions
    for row, ids in enumerate(ro.prompt_ids):
        assert inputs["prompt_ids"][row][inputs["prompt_mask"][row].bool()].tolist() == ids
    assert ro.scores.failures == {"contains_answer": 0, "short": 2}
    np.testing.assert_allclose(ro.advantages, inputs["advantages"].numpy(), atol=1e-5)
    assert np.abs(ro.advantages).max() > 0.1
    got = trainer.rollout_metrics(ro)
    for k, want in metrics.items():
        if k.startswith(("rewards/", "reward", "frac_", "completions/")) or k == "num_tokens":
            close(got[k], want, k)
    assert got["reward_failures"] == 2


CASES = [(loss, beta, None, True) for loss in ("grpo", "bnpo", "dr_grpo", "dapo") for beta in (0.0, 0.1)]
CASES += [("grpo", 0.1, 0.3, True), ("dr_grpo", 0.0, 0.3, True), ("bnpo", 0.1, 0.3, False)]


@pytest.mark.parametrize("loss_type, beta, noise, correction", CASES,
                         ids=[f"{lt}-beta{b}" + ("-offpolicy" if n else "") + ("" if c else "-nocorrection")
                              for lt, b, n, c in CASES])
def test_loss_gradients_and_metrics_equal_trls(folders, loss_type, beta, noise, correction):
    old_noise = None
    if noise:
        old_noise = np.random.default_rng(5).uniform(-noise, noise, (2 * G, 6)).astype(np.float32)
    inputs, ref_loss, ref_grads, metrics = trl_side(folders, RECORDS, loss_type=loss_type, beta=beta,
                                                    old_noise=old_noise, bias_correction=correction)
    trainer, ro = mine(folders, RECORDS, loss_type=loss_type, beta=beta, bias_correction=correction)
    if beta:
        ref_logps = inputs["ref_per_token_logps"].numpy()
        got = np.array(ro.ref_logps) * np.array(ro.batch.mask)
        np.testing.assert_allclose(got, ref_logps * inputs["completion_mask"].numpy(), atol=1e-5)
    if old_noise is not None:
        logps = np.array(trainer_logps(trainer, ro))
        ro.old_logps = mx.array(logps + old_noise)
    trainer._rollout = ro
    trainer.model.train()
    (loss, got_metrics), grads = trainer._loss_and_grad()
    close(loss.item(), ref_loss, "loss")
    from metalnn.llm.tuner.grpo import finish_metrics

    got_metrics = finish_metrics(got_metrics)
    for k in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
              "clip_ratio/low_min", "clip_ratio/high_max"):
        if k in metrics:
            close(got_metrics[k], metrics[k], k)
    assert ("kl" in got_metrics) == bool(beta)
    if noise:
        assert metrics["clip_ratio/region_mean"] > 0.05  # the off-policy case does clip
    got = {k: np.array(v) for k, v in tree_flatten(grads)}
    assert set(got) == set(ref_grads)
    for k, want in ref_grads.items():
        assert np.abs(want).max() > 0, k
        err = np.abs(got[k] - want).max() / np.abs(want).max()
        assert err < TOL, f"gradient of {k} differs by {err:.3g} of its largest entry"


def trainer_logps(trainer, ro):
    from metalnn.llm.tuner.grpo import per_token_logps

    trainer.model.eval()
    return mx.stop_gradient(per_token_logps(trainer.model, ro.batch, trainer.config.temperature))
