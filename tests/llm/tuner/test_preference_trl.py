"""DPO (sigmoid and ipo), ORPO and KTO step by step against TRL 1.13 (the oracle): the same tiny Llama, the
same data (standard and conversational), full fine-tuning with SGD on a linear schedule, clipping at
1.0, batches of 2 in file order. The loss and every metric TRL logs at each of the first 3 steps
agree within 1e-3 relative (float32 on both sides; measured agreement is about 1e-5, the rounding of
float32 sums taken in different orders).

ORPO's ``logits/chosen`` and ``logits/rejected``: TRL averages over every position of the padded
batch, padding included (whose values come from transformers' attention mask); metalnn averages
over the real positions. They are compared on data whose rows all have one length (no padding),
and left out where rows differ in length.
"""

import numpy as np
import pytest

from metalnn import Trainer
from metalnn.cli.train_options import make_optimizer
from metalnn.llm.models import load_pretrained, load_tokenizer
from metalnn.llm.tuner import preference as pref
from metalnn.llm.tuner import preference_data as pdata
from preference_models import (STANDARD_PAIRS, conversational, save_preference_model, trl_steps,
                                             unpaired, unpaired_conversational, write_jsonl)

STEPS, BATCH, LR = 3, 2, 0.5
RTOL = 1e-3

#: ORPO pairs whose rows all tokenise to one length: no padding, so TRL's logits/* are comparable
EVEN_PAIRS = [
    {"prompt": "Is ice cold?", "chosen": " Yes.", "rejected": " No!!"},
    {"prompt": "Is fire hot?", "chosen": " Yes.", "rejected": " Nope"},
    {"prompt": "Is sun warm?", "chosen": " Yes.", "rejected": " Nah."},
    {"prompt": "Is sea deep?", "chosen": " Very", "rejected": " Nope"},
    {"prompt": "Is sky blue?", "chosen": " Yes.", "rejected": " Red."},
    {"prompt": "Is tea nice?", "chosen": " Sure", "rejected": " Yuck"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preference_model(tmp_path_factory.mktemp("pref") / "model")


def metalnn_steps(method, folder, path, **settings):
    """The same run in metalnn: loss, metrics and TRL's cumulative ``num_tokens`` per step."""
    model, tok = load_pretrained(folder), load_tokenizer(folder)
    data = pdata.load_preference_data(path, tok, method)
    model.unfreeze()
    reference = None if method == "orpo" else pref.Reference.for_model(model)
    objective = pref.objective(method, reference, **settings)
    trainer = Trainer(model, make_optimizer("sgd", LR, STEPS), objective, clip_grad_norm=1.0, progress=False)
    source, seen, out = data.batches(BATCH), 0, []
    for step in range(STEPS):
        batch = source(step)
        loss = trainer.step(batch)
        seen += pdata.num_tokens(batch)
        out.append({"loss": loss, **objective.metrics(), **({"num_tokens": seen} if method != "orpo" else {})})
    return out


def assert_steps_equal(got, want, skip=()):
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        keys = set(w) - set(skip)
        assert set(g) - set(skip) == keys, f"step {step}: metric names differ from TRL's"
        scale = {k: max(abs(w[k]), 1e-3) for k in keys}  # near-zero metrics (rewards at step 0): absolute 1e-6
        bad = {k: (g[k], w[k]) for k in keys if abs(g[k] - w[k]) > RTOL * scale[k]}
        assert not bad, f"step {step}: metalnn vs TRL differ in {bad}"


CASES = {
    "dpo-sigmoid-standard": ("dpo", STANDARD_PAIRS, {"beta": 0.1, "loss_type": "sigmoid"}),
    "dpo-sigmoid-conversational": ("dpo", conversational(STANDARD_PAIRS), {"beta": 0.1, "loss_type": "sigmoid"}),
    "dpo-ipo-standard": ("dpo", STANDARD_PAIRS, {"beta": 0.5, "loss_type": "ipo"}),
    "orpo-standard": ("orpo", EVEN_PAIRS, {"beta": 0.1}),
    "orpo-conversational": ("orpo", conversational(STANDARD_PAIRS), {"beta": 0.2}),
    "kto-standard": ("kto", unpaired(STANDARD_PAIRS), {"beta": 0.1, "desirable_weight": 1.0,
                                                      "undesirable_weight": 1.5}),
    "kto-conversational": ("kto", unpaired_conversational(STANDARD_PAIRS), {"beta": 0.2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_steps_equal_trl(case, folder, tmp_path):
    method, records, settings = CASES[case]
    want = trl_steps(method, folder, records, tmp_path / "trl", steps=STEPS, batch_size=BATCH, lr=LR, **settings)
    got = metalnn_steps(method, folder, write_jsonl(tmp_path / "data.jsonl", records), **settings)
    skip = ("logits/chosen", "logits/rejected") if case == "orpo-conversational" else ()
    assert_steps_equal(got, want, skip)
    # the runs train: the loss moves, and the policy leaves the reference (rewards nonzero after step 1)
    assert got[0]["loss"] != got[-1]["loss"]
    assert any(abs(s.get("rewards/chosen", 0.0)) > 1e-4 for s in got[1:])
    assert np.isfinite([v for s in got for v in s.values()]).all()
