"""Unit checks of preference training: the losses on hand-made log-probabilities against their formulas
(written independently with NumPy / torch here), the data errors naming file, line and field, TRL's
prompt extraction and tokenisation details, and the reference model: adapters switched off equals a
separately loaded base, the weight snapshot of full fine-tuning stays the initial model, and
precomputed reference log-probabilities give the live reference's losses. Tolerances: float32
arithmetic on values of order 1 (1e-6 relative)."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from metalnn import Trainer
from metalnn.cli.train_options import make_optimizer
from metalnn.llm.models import load_pretrained, load_tokenizer
from metalnn.llm.tuner import lora
from metalnn.llm.tuner import preference as pref
from metalnn.llm.tuner import preference_data as pdata
from metalnn.llm.tuner.datasets import DatasetError
from preference_models import STANDARD_PAIRS, conversational, save_preference_model, unpaired, write_jsonl

C = np.array([-3.0, -10.0, -0.5, -7.25], dtype=np.float32)
R = np.array([-4.0, -2.0, -0.7, -7.0], dtype=np.float32)
RC = np.array([-3.5, -9.0, -0.6, -8.0], dtype=np.float32)
RR = np.array([-3.0, -2.5, -0.9, -6.0], dtype=np.float32)


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("loss_type, beta, eps", [("sigmoid", 0.1, 0.0), ("hinge", 0.3, 0.0), ("robust", 0.2, 0.1),
                                                  ("ipo", 0.5, 0.0)])
def test_dpo_losses_match_their_formulas(loss_type, beta, eps):
    lc, lr = np.array([3.0, 5.0, 1.0, 0.0], np.float32), np.array([2.0, 4.0, 6.0, 1.0], np.float32)
    got = pref.dpo_losses(mx.array(C), mx.array(R), mx.array(RC), mx.array(RR), beta=beta, loss_type=loss_type,
                          label_smoothing=eps, chosen_lengths=mx.array(lc), rejected_lengths=mx.array(lr))
    dc, dr = _t(C) - _t(RC), _t(R) - _t(RR)
    d = dc - dr
    want = {"sigmoid": lambda: -F.logsigmoid(beta * d),
            "hinge": lambda: torch.relu(1 - beta * d),
            "robust": lambda: (-(1 - eps) * F.logsigmoid(beta * d) + eps * F.logsigmoid(-beta * d)) / (1 - 2 * eps),
            "ipo": lambda: (dc / _t(lc).clamp(min=1) - dr / _t(lr).clamp(min=1) - 1 / (2 * beta)) ** 2}[loss_type]()
    np.testing.assert_allclose(np.array(got), want.numpy(), rtol=1e-6, atol=1e-7)


def test_log_sigmoid_has_the_right_gradient_at_zero():
    # every DPO run starts at delta = 0; a gradient of 0 there would never move the model
    g = mx.grad(lambda x: pref.log_sigmoid(x).sum())(mx.array([0.0, -30.0, 30.0]))
    np.testing.assert_allclose(np.array(g), [0.5, 1.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(np.array(pref.log_sigmoid(mx.array([-100.0, 100.0]))), [-100.0, 0.0], atol=1e-6)


def test_orpo_log_odds_and_kto_losses_match_their_formulas():
    c, r = np.array([-0.2, -1.5, -3.0], np.float32), np.array([-0.9, -0.1, -3.5], np.float32)
    got = np.array(pref.orpo_log_odds(mx.array(c), mx.array(r)))
    odds = lambda p: np.log(np.exp(p.astype(np.float64)) / (1 - np.exp(p.astype(np.float64))))  # noqa: E731
    np.testing.assert_allclose(got, odds(c) - odds(r), rtol=1e-5)
    ratios, labels, kl, beta = np.array([0.5, -1.0, 2.0], np.float32), np.array([1.0, 0.0, 0.0], np.float32), 0.3, 0.2
    got = np.array(pref.kto_losses(mx.array(ratios), mx.array(labels), mx.array(kl), beta=beta, desirable_weight=2.0,
                                   undesirable_weight=0.5))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = [2.0 * (1 - sig(beta * (0.5 - kl))), 0.5 * (1 - sig(beta * (kl + 1.0))), 0.5 * (1 - sig(beta * (kl - 2.0)))]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_bad_loss_settings_are_refused():
    with pytest.raises(ValueError, match="loss_type must be one of sigmoid, ipo, hinge, robust, got 'nca'"):
        pref.DPOLoss(None, loss_type="nca")
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        pref.DPOLoss(None, loss_type="robust", label_smoothing=0.5)


# -- data --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preference_model(tmp_path_factory.mktemp("pref") / "model")


@pytest.fixture(scope="module")
def tok(folder):
    return load_tokenizer(folder)


def test_extract_prompt_is_trls():
    assert pdata.extract_prompt("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")
    chosen = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    rejected = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away"}]
    assert pdata.extract_prompt(chosen, rejected) == (chosen[:1], chosen[1:], rejected[1:])


def test_standard_pairs_get_bos_and_eos_as_trl(tok):
    e = pdata.tokenize_pair(tok, {"prompt": "Hi", "chosen": " yo", "rejected": " no<|im_end|>"})
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert e.prompt_ids == (bos, *tok.encode("Hi", add_special_tokens=False))
    assert e.chosen_ids == (*tok.encode(" yo", add_special_tokens=False), eos)
    assert e.rejected_ids == (*tok.encode(" no", add_special_tokens=False), eos)  # EOS not doubled
    implicit = pdata.tokenize_pair(tok, {"chosen": "Hi yo", "rejected": "Hi no"})
    assert implicit == e


def test_conversational_pairs_go_through_the_template(tok):
    [record] = conversational(STANDARD_PAIRS[:1])
    e = pdata.tokenize_pair(tok, record)
    assert e.prompt_ids == tuple(tok.apply_chat_template(record["prompt"], add_generation_prompt=True))
    full = tok.apply_chat_template(record["prompt"] + record["chosen"], add_generation_prompt=False)
    assert e.prompt_ids + e.chosen_ids == tuple(full)
    assert tok.decode(e.chosen_ids, skip_special_tokens=False) == "blue.<|im_end|>\n"


def test_truncation_and_dropped_examples(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "abcdefgh", "chosen": "ij", "rejected": "klmnop"},
                                              {"prompt": "a", "chosen": "bc", "rejected": "d"}])
    data = pdata.load_preference_data(path, tok, "dpo", max_length=5)
    assert len(data) == 1  # the first prompt (BOS + 8 characters) fills max_length: left out, as TRL
    batch = pdata.load_preference_data(path, tok, "dpo", max_length=5, truncation_mode="keep_end").collate([0])
    ids, mask = np.array(batch["input_ids"]), np.array(batch["completion_mask"])
    assert ids.shape == (2, 5)  # both rows cut to their last 5 tokens
    assert tok.decode(ids[1][mask[1] > 0]) == "klmnop"[-4:]
    assert mask[0].tolist() == [0, 0, 1, 1, 1]


def test_kto_batches_build_trls_mismatched_pairs(tok, tmp_path):
    records = unpaired(STANDARD_PAIRS[:2])
    data = pdata.load_preference_data(write_jsonl(tmp_path / "k.jsonl", records), tok, "kto")
    batch = data.batches(3)(0)
    ids, kl, kl_mask = (np.array(batch[k]) for k in ("input_ids", "KL_input_ids", "KL_completion_mask"))
    assert np.array(batch["label"]).tolist() == [1.0, 0.0, 1.0]
    # row i: prompt i with the completion of row i - 1 (row 0 with the last row's)
    for i, j in ((0, 2), (1, 0), (2, 1)):
        e, other = data.examples[i], data.examples[j]
        assert kl[i][:len(e.prompt_ids) + len(other.completion_ids)].tolist() == list(e.prompt_ids + other.completion_ids)
        assert kl_mask[i].sum() == len(other.completion_ids)
    assert ids.shape[0] == 3


def test_paired_lines_are_unpaired_for_kto_as_trl(tok, tmp_path):
    data = pdata.load_preference_data(write_jsonl(tmp_path / "p.jsonl", STANDARD_PAIRS[:3]), tok, "kto")
    assert [e.label for e in data.examples] == [True] * 3 + [False] * 3


@pytest.mark.parametrize("line, method, message", [
    ('{"prompt": "a", "chosen": "b"}', "dpo", ":2: missing field 'rejected'"),
    ('{"prompt": "a", "chosen": "b", "rejected": 3}', "dpo", ":2: 'rejected' must be a string"),
    ('{"prompt": "a", "completion": "b", "label": "yes"}', "kto", ":2: 'label' must be true"),
    ('{"prompt": [{"role": "user"}], "chosen": [], "rejected": []}', "orpo", ":2: prompt[0] must be an object"),
    ('{"prompt": "a", "chosen"', "dpo", ":2: not valid JSON"),
    ('{"text": "a"}', "dpo", ":2: expected 'prompt', 'chosen' and 'rejected' fields"),
])
def test_bad_lines_are_named(tok, tmp_path, line, method, message):
    good = {"dpo": STANDARD_PAIRS[0], "orpo": STANDARD_PAIRS[0], "kto": unpaired(STANDARD_PAIRS)[0]}[method]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(DatasetError) as e:
        pdata.load_preference_data(path, tok, method)
    assert str(path) + message in str(e.value)


# -- the reference model -----------------------------------------------------------------------
def _batch(folder, tok, tmp_path, records=STANDARD_PAIRS[:2]):
    return pdata.load_preference_data(write_jsonl(tmp_path / "r.jsonl", records), tok, "dpo").collate([0, 1])


def test_adapters_off_reference_is_the_base_model(folder, tok, tmp_path):
    batch = _batch(folder, tok, tmp_path)
    model, base = load_pretrained(folder), load_pretrained(folder)
    lora.apply(model, rank=4, targets=("q_proj", "v_proj"))
    for _, m in lora.adapters(model).items():  # nonzero adapters: the model differs from its base
        m.lora_B.weight = mx.random.normal(m.lora_B.weight.shape, key=mx.random.key(1)) * 0.5
    ref = pref.Reference.for_model(model)
    assert ref.kind == "adapters_off"
    ids = batch["input_ids"]
    got, want, policy = ref.logits(model, ids), base(ids), model(ids)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6)  # the same weights, the same ops
    assert float(mx.abs(policy - want).max()) > 1e-2


def test_full_fine_tuning_reference_stays_the_initial_model(folder, tok, tmp_path):
    data = pdata.load_preference_data(write_jsonl(tmp_path / "r.jsonl", STANDARD_PAIRS), tok, "dpo")
    model, base = load_pretrained(folder), load_pretrained(folder)
    model.unfreeze()
    ref = pref.Reference.for_model(model)
    objective = pref.DPOLoss(ref)
    trainer = Trainer(model, make_optimizer("sgd", 0.5, 4, "constant"), objective, progress=False)
    for step in range(2):
        trainer.step(data.batches(2)(step))
    ids = data.collate([0, 1])["input_ids"]
    np.testing.assert_allclose(np.array(ref.logits(model, ids)), np.array(base(ids)), atol=1e-6)
    assert float(mx.abs(model(ids) - base(ids)).max()) > 1e-3  # while the model itself has moved


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_precomputed_reference_equals_the_live_one(folder, tok, tmp_path, method):
    records = STANDARD_PAIRS if method == "dpo" else unpaired(STANDARD_PAIRS)
    data = pdata.load_preference_data(write_jsonl(tmp_path / "r.jsonl", records), tok, method)
    results = []
    for precompute in (False, True):
        model = load_pretrained(folder)
        mx.random.seed(3)  # the same adapters' initial values in both runs
        lora.apply(model, rank=4, targets=("q_proj", "v_proj"))
        ref = pref.Reference.for_model(model)
        used = pref.precompute_reference(data, model, ref, 2) if precompute else data
        objective = pref.objective(method, None if precompute else ref)
        trainer = Trainer(model, make_optimizer("adam", 0.05, 3), objective, progress=False)
        losses = []
        for step in range(3):
            batch = used.batches(2)(step)
            assert ("ref_chosen_logps" in batch or "ref_logps" in batch) == precompute
            losses.append((trainer.step(batch), objective.metrics()))
        results.append(losses)
    for (l0, m0), (l1, m1) in zip(*results):
        assert l0 == pytest.approx(l1, rel=1e-5, abs=1e-6)
        assert m0.keys() == m1.keys()
        for k in m0:
            assert m0[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k


def test_metrics_come_back_from_the_compiled_step(folder, tok, tmp_path):
    data = pdata.load_preference_data(write_jsonl(tmp_path / "r.jsonl", STANDARD_PAIRS), tok, "dpo")
    runs = []
    for compile in (True, False):
        model = load_pretrained(folder)
        model.unfreeze()
        objective = pref.DPOLoss(pref.Reference.for_model(model))
        trainer = Trainer(model, make_optimizer("sgd", 0.5, 3), objective, progress=False, compile=compile)
        assert trainer.use_compile == compile
        runs.append([(trainer.step(data.batches(2)(s)), objective.metrics()) for s in range(3)])
    for (l0, m0), (l1, m1) in zip(*runs):
        assert l0 == pytest.approx(l1, rel=1e-5)
        assert set(m0) == set(m1) == set(pref.DPOLoss.names)
        for k in m0:  # each step's own values (not the first step's, nor placeholders)
            assert m0[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    assert runs[0][0][1]["logps/chosen"] != runs[0][1][1]["logps/chosen"]


# -- QLoRA on a GGUF file ----------------------------------------------------------------------
def test_qlora_dpo_on_a_gguf_file_keeps_the_base_packed(tmp_path):
    """DPO with LoRA over a GGUF model's own Q4_0 / Q8_0 blocks: the adapters train, every packed
    tensor keeps its type and bytes, and the written adapters load back, in metalnn on a fresh
    reading of the file (the same weights and ops; 1e-5, as BLAS's thread count follows the machine's load
    and so may the order of float32 sums: 1.4e-6 measured on logits of order 2 on a busy machine) and in PEFT on transformers' reading
    of it (every tensor dequantized to float32: 1e-4, float32 rounding as in
    tests/llm/tuner/test_adapters.py)."""
    import peft
    import transformers

    import gguf_files
    from gguf import GGMLQuantizationType as Q
    from metalnn.layers.ggml import GGMLEmbedding, GGMLLinear

    types = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0, "attn_q.weight": Q.Q4_0,
             "attn_k.weight": Q.Q4_0, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q4_0,
             "ffn_gate.weight": Q.Q4_0, "ffn_up.weight": Q.Q8_0, "ffn_down.weight": Q.Q4_0}
    path = gguf_files.write(tmp_path / "m.gguf", gguf_files.hf_model("llama"), types=types)
    model, tok = load_pretrained(path), load_tokenizer(path)

    def packed(m):  # every packed tensor, by its name without the adapters' wrapping, as raw bytes
        return {name.replace(".base_layer", ""): (type(layer).__name__, layer.ggml_type,
                                                  np.array(layer.weight).tobytes())
                for name, layer in m.named_modules() if isinstance(layer, (GGMLLinear, GGMLEmbedding))}

    before = packed(model)
    assert len(before) == 2 * 7 + 2  # 7 projections a block, the embedding and the output
    data = pdata.load_preference_data(write_jsonl(tmp_path / "pairs.jsonl", STANDARD_PAIRS), tok, "dpo")
    mx.random.seed(0)
    paths = lora.apply(model, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    assert len(paths) == 8
    ref = pref.Reference.for_model(model)
    assert ref.kind == "adapters_off"
    objective = pref.DPOLoss(ref)
    trainer = Trainer(model, make_optimizer("adam", 0.02, 4), objective, progress=False)
    losses, margins = [], []
    for step in range(4):
        losses.append(trainer.step(data.batches(2)(step)))
        margins.append(objective.metrics()["rewards/margins"])
    assert losses[0] == pytest.approx(math.log(2), rel=1e-5)  # policy = reference at the start
    assert margins[-1] != 0.0 and losses[-1] < math.log(2)  # the adapters moved the policy the way DPO asks
    assert all(float(mx.abs(m.lora_B.weight).max()) > 0 for m in lora.adapters(model).values())

    after = packed(model)
    assert after.keys() == before.keys()
    for name in before:  # still GGML layers of the file's types, with bit-identical packed bytes
        assert after[name] == before[name], name
    assert all(isinstance(m.base_layer, GGMLLinear) for m in lora.adapters(model).values())

    out = lora.save_adapters(model, tmp_path / "adapters")
    model.eval()
    ids = data.collate([0, 1, 2])["input_ids"]
    trained = np.array(model(ids))
    fresh = load_pretrained(path)
    lora.load_adapters(fresh, out)
    np.testing.assert_allclose(np.array(fresh(ids)), trained, atol=1e-5, rtol=0)
    with lora.adapters_disabled(model):
        base_logits = np.array(model(ids))
    assert np.abs(trained - base_logits).max() > 1e-3  # the adapters change the logits

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(hf, out).eval()(torch.tensor(np.array(ids))).logits.numpy()
    np.testing.assert_allclose(trained, want, atol=1e-4, rtol=0)
