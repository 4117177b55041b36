"""`metalnn.llm.tuner.grpo` end to end on a tiny random Llama: rollouts (EOS handling, seeds), reward
failures (counted, the run goes on), reward weights, prompt files, and a short training run that
raises the mean reward on held-out prompts.

The oracle of the loss itself is TRL (test_grpo_trl.py); here the references are hand-computed
rewards and the behaviour of a run. The learning test's margin: the held-out mean reward (16
sampled completions per prompt at temperature 1, fixed seeds) must rise by at least 0.15 from 0.023
(a random model writes the rewarded token one time in ~47); both runs (full fine-tuning, and LoRA
with beta > 0) measured 1.000 after 20 steps, so the margin leaves wide room for other BLAS
summation orders.
"""

import json

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from metalnn.llm.models import load_pretrained, load_tokenizer
from metalnn.llm.tuner import grpo, lora, rewards
from metalnn.llm.tuner.datasets import DatasetError
from metalnn.llm.tuner.grpo import GRPOConfig, GRPOTrainer

transformers.logging.set_verbosity_error()
CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 +=?<>/."))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    vocab = {c: i for i, c in enumerate(CHARS)}
    for s in ("<unk>", "<pad>", "<eos>"):
        vocab[s] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", "<pad>", "<eos>"])
    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.02,
                                   eos_token_id=vocab["<eos>"], bos_token_id=None, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def load(folder):
    return load_pretrained(folder), load_tokenizer(folder)


PROMPTS = [{"prompt": p, "target": t} for p, t in
           (("1+2=", "3"), ("what is 7?", "7"), ("abc", "d"), ("9 9", "9"), ("x?", "y"), ("hello", "o"))]


def test_rollout_cuts_at_eos_and_is_reproducible(folder):
    model, tok = load(folder)
    trainer = GRPOTrainer(model, tok, lambda completions, **k: [0.0] * len(completions), PROMPTS,
                          GRPOConfig(num_generations=4, max_completion_length=30), batch_size=8)
    a = trainer.rollout(PROMPTS[:2], seed=3)
    b = trainer.rollout(PROMPTS[:2], seed=3)
    c = trainer.rollout(PROMPTS[:2], seed=4)
    assert a.completion_ids == b.completion_ids and a.completion_ids != c.completion_ids
    assert len(a.completion_ids) == 8 and a.prompt_ids[0] == tok.encode("1+2=")
    eos = tok.eos_token_id
    for ids, truncated, text in zip(a.completion_ids, a.truncated, a.completions):
        assert eos not in ids[:-1]  # nothing after the first EOS
        assert truncated == (ids[-1] != eos) and (len(ids) == 30 or not truncated)
        assert text == tok.decode(ids, skip_special_tokens=True)
    # the loss mask covers each completion up to and including its EOS
    np.testing.assert_array_equal(np.array(a.batch.mask).sum(1), [len(c) for c in a.completion_ids])


def test_reward_failures_are_counted_and_the_run_goes_on(folder):
    model, tok = load(folder)
    model.unfreeze()
    calls = []

    def flaky(prompts, completions, target, **kwargs):
        calls.append(len(completions))
        if any("a" in c for c in completions):
            # fails on the whole batch; called again per completion it fails only where "a" is
            if len(completions) > 1:
                raise RuntimeError("cannot score")
            raise ValueError("no 'a' allowed")
        return [None if len(c) % 3 == 0 else float(t in c) for c, t in zip(completions, target)]

    def length(completions, **kwargs):
        return [len(c) / 10 for c in completions]

    cfg = GRPOConfig(num_generations=4, max_completion_length=12, reward_weights=(1.0, 0.5))
    trainer = GRPOTrainer(model, tok, [flaky, length], PROMPTS, cfg, batch_size=8,
                          optimizer=optim.SGD(learning_rate=0.1))
    for _ in range(3):
        m = trainer.step()
        ro = trainer._rollout
        texts = ro.completions
        want_fail = [("a" in t) or len(t) % 3 == 0 for t in texts]
        assert m["rewards/flaky/failures"] == sum(want_fail) and m["rewards/length/failures"] == 0
        assert m["reward_failures"] == sum(want_fail)
        assert np.isnan(ro.scores.values[:, 0]).tolist() == want_fail
        # weights: the reward is flaky + 0.5 * length, a missing flaky reward counting 0
        want = [(0.0 if f else float(r["target"] in t)) + 0.5 * len(t) / 10
                for f, r, t in zip(want_fail, ro.records, texts)]
        assert m["reward"] == pytest.approx(np.mean(want), abs=1e-6)
        assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    assert trainer.step_count == 3


def test_reward_none_everywhere_gives_no_advantage():
    scores = rewards.RewardScores(["f"], np.array([[1.0], [np.nan], [0.0], [np.nan]], np.float32), {"f": 2})
    adv, zero = rewards.advantages(scores, num_generations=2)
    # an unscorable completion: out of its group's statistics, advantage 0
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0] and np.isnan(rewards.weighted_rewards(scores)[1])
    scores.values[1, 0] = 3.0
    adv, _ = rewards.advantages(scores, num_generations=2)
    want = (np.array([1.0, 3.0]) - 2.0) / (np.std([1.0, 3.0], ddof=1) + 1e-4)
    np.testing.assert_allclose(adv[:2], want, rtol=1e-6)


def test_reward_weights_must_match_the_functions(folder):
    model, tok = load(folder)
    with pytest.raises(ValueError, match="reward_weights has 1 weights for 2 reward functions"):
        GRPOTrainer(model, tok, [len, len], PROMPTS, GRPOConfig(num_generations=2, reward_weights=(1.0,)),
                    batch_size=2)
    with pytest.raises(ValueError, match="batch_size 6 must be a multiple of num_generations 4"):
        GRPOTrainer(model, tok, len, PROMPTS, GRPOConfig(num_generations=4), batch_size=6)
    with pytest.raises(ValueError, match="beta > 0 needs a reference model"):
        GRPOTrainer(model, tok, len, PROMPTS, GRPOConfig(num_generations=2, beta=0.1), batch_size=2)
    with pytest.raises(ValueError, match="loss_type: expected one of grpo, bnpo, dr_grpo, dapo, got 'ppo'"):
        GRPOConfig(loss_type="ppo")


def test_prompt_files(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "x": 1}\n\n{"prompt": [{"role": "user", "content": "b"}]}\n')
    assert grpo.load_prompts(path) == [{"prompt": "a", "x": 1}, {"prompt": [{"role": "user", "content": "b"}]}]
    path.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(DatasetError, match=r"p.jsonl:2: 'prompt' must be a string or a non-empty list"):
        grpo.load_prompts(path)


SEVEN = CHARS.index("7")


def seven_fraction(completion_ids, **kwargs):
    """The learnable reward: the fraction of the completion's tokens that are '7' (counted on the
    ids, so special tokens, which decode to nothing, cannot shorten the text to game it)."""
    return [sum(t == SEVEN for t in ids) / len(ids) for ids in completion_ids]


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora-beta"])
def test_training_raises_the_held_out_reward(folder, adapters):
    model, tok = load(folder)
    if adapters:
        mx.random.seed(0)
        # the output head too: a rank-8 update of it moves the token distribution of this tiny model in
        # a few steps (through q/v alone a width-32 model with 0.02-scale weights learns far slower)
        lora.apply(model, rank=8, alpha=16, targets=("q_proj", "v_proj", "lm_head"))
        cfg = GRPOConfig(num_generations=8, max_completion_length=8, beta=0.04, loss_type="grpo")
        lr = 3e-2
    else:
        model.unfreeze()
        cfg = GRPOConfig(num_generations=8, max_completion_length=8)
        lr = 1e-2
    train, held_out = PROMPTS[:4], PROMPTS[4:]
    trainer = GRPOTrainer(model, tok, seven_fraction, train, cfg, batch_size=16, seed=1,
                          optimizer=optim.Adam(learning_rate=lr))
    before = trainer.mean_reward(held_out, num_generations=16)
    metrics = trainer.train(20)
    after = trainer.mean_reward(held_out, num_generations=16)
    assert before < 0.1
    assert after > before + 0.15, (before, after, [round(m["reward"], 3) for m in metrics])
    assert all(np.isfinite(m["loss"]) for m in metrics)
    if adapters:
        assert all(m["kl"] >= 0 for m in metrics) and metrics[-1]["kl"] > 0  # it moved away from the base
