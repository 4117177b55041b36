"""scripts/bench_preference.py's helpers: step timing, the generated data and the table's ratios
(the benchmark itself stays out of the test run)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench_preference.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_preference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_times_leave_out_the_warmup(bench):
    # start of step 1, then the end of steps 1..4
    assert bench.step_times([0.0, 5.0, 6.0, 8.0, 11.0], warmup=2) == [2.0, 3.0]
    assert bench.step_times([0.0, 5.0, 6.0], warmup=0) == [5.0, 1.0]
    with pytest.raises(ValueError, match="warmup"):
        bench.step_times([0.0, 5.0, 6.0], warmup=2)


def test_generated_data_is_trl_shaped_and_varied(bench):
    pairs = bench.preference_pairs(12)
    assert len(pairs) == 12
    for p in pairs:
        assert [m["role"] for m in p["prompt"]] == ["user"]
        assert p["chosen"][0]["role"] == p["rejected"][0]["role"] == "assistant"
        assert p["chosen"][0]["content"] != p["rejected"][0]["content"]
    assert len({len(p["chosen"][0]["content"]) for p in pairs}) > 3  # batches of varied lengths
    prompts = bench.grpo_prompts(5)
    for r in prompts:  # "What is A + B? ..." with the answer A + B
        a, b = r["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + ")
        assert int(a) + int(b) == int(r["answer"])
    rewards = bench.length_reward(["x" * 60, [{"role": "assistant", "content": "x" * 30}]])
    assert rewards == [0.0, -0.5]


def test_table_ratios_are_against_the_trl_peer(bench):
    results = {"dpo-lora": {"tokens_per_s": 300.0, "step_s": 1.0, "peak_mib": 900.0, "above_imports_mib": 400.0},
               "trl-dpo-lora": {"tokens_per_s": 100.0, "step_s": 3.0, "peak_mib": 1800.0, "above_imports_mib": 1000.0},
               "grpo-lora": {"step_s": 2.0, "peak_mib": 900.0, "above_imports_mib": 500.0},
               "trl-grpo-lora": {"step_s": 8.0, "peak_mib": 1800.0, "above_imports_mib": 1000.0}}
    rows = {line.split(" | ")[0][2:]: line for line in bench.table(results)[2:]}
    assert "| 3.00x |" in rows[bench.RUNS["dpo-lora"][2]] and "| 0.40x |" in rows[bench.RUNS["dpo-lora"][2]]
    assert "| 4.00x |" in rows[bench.RUNS["grpo-lora"][2]] and "| 0.50x |" in rows[bench.RUNS["grpo-lora"][2]]
    assert "| 1.00x |" in rows[bench.RUNS["trl-dpo-lora"][2]]
