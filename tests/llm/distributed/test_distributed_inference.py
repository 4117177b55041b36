"""Pipeline- and tensor-parallel inference on mx.distributed against one process.

Ranks are launched by ``mlx.launch --backend ring`` on localhost (2 and 3 ranks; one launch per split
and size runs every check on every model: `tests/support/workers/distributed_infer.py`). The
references are metalnn's own one-process runs of the same checkpoints, whose agreement with
transformers the model tests establish.

Tolerances: logits within 1e-5 absolute (float32). A pipeline rank computes exactly the one-process
arithmetic (the other ranks add zeros to its logits), so its logits are bit-identical; tensor parallel
sums the ranks' partial products of o_proj / down_proj / the experts in another order (observed
differences ~2e-7 on O(0.1) logits). Greedy tokens identical. Per-rank parameter bytes (the arrays'
bytes, not RSS) at most (1/N + 10%) of the whole model's.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import metalnn as mn
from metalnn.llm.distributed import parameter_bytes
from metalnn.llm.models import load_pretrained

SUPPORT = Path(__file__).resolve().parents[2] / "support"
WORKER = SUPPORT / "workers" / "distributed_infer.py"
sys.path.insert(0, str(SUPPORT))
sys.path.insert(0, str(WORKER.parent))
import distributed_infer as worker  # noqa: E402
import gguf_files  # noqa: E402
from hf_models import hf_model  # noqa: E402
from ring_launch import launch_ranks  # noqa: E402

LOGITS_TOL = 1e-5


def launch(n, kind, out, models, *extra, timeout=300):
    return launch_ranks(n, [sys.executable, WORKER, kind, out, *models, *extra], timeout=timeout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{name: path}``: a dense Llama, a Qwen3-MoE (tied head, one dense layer), a Qwen3.5 hybrid
    (Gated DeltaNet layers between attention layers) and a Nemotron-H (Mamba2, attention and MLP
    layers): the last two with recurrent caches; safetensors folders, and a Llama GGUF file with
    quantized tensors (Q4_0 ... Q8_0, F16, BF16)."""
    root = tmp_path_factory.mktemp("ckpt")
    llama = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, vocab_size=worker.VOCAB,
                     hidden_size=48, intermediate_size=80, num_hidden_layers=6, num_attention_heads=6,
                     num_key_value_heads=6, max_position_embeddings=256)
    llama.save_pretrained(root / "llama")
    moe = hf_model(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, vocab_size=worker.VOCAB,
                   hidden_size=48, intermediate_size=64, num_hidden_layers=6, num_attention_heads=6,
                   num_key_value_heads=6, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   norm_topk_prob=True, mlp_only_layers=[2], tie_word_embeddings=True, max_position_embeddings=256)
    moe.save_pretrained(root / "moe")
    hybrid = hf_model(transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, vocab_size=worker.VOCAB,
                      hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                      initializer_range=0.2, layer_types=["linear_attention", "full_attention"] * 3,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    hybrid.save_pretrained(root / "hybrid")
    mamba = hf_model(transformers.NemotronHConfig, transformers.NemotronHForCausalLM, vocab_size=worker.VOCAB,
                     hidden_size=32, num_attention_heads=4, head_dim=8, intermediate_size=24, mamba_head_dim=16,
                     chunk_size=8, hybrid_override_pattern="-M*M-M", num_key_value_heads=1, mamba_num_heads=4,
                     ssm_state_size=5, n_groups=1, conv_kernel=3, initializer_range=0.15)
    mamba.save_pretrained(root / "mamba")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    gguf_model = transformers.LlamaForCausalLM(cfg).eval()
    gguf_files.write(root / "llama.gguf", gguf_model, arch="llama")
    return {"llama": root / "llama", "moe": root / "moe", "hybrid": root / "hybrid", "mamba": root / "mamba",
            "gguf": root / "llama.gguf"}


@pytest.fixture(scope="module")
def references(checkpoints):
    """One process's logits, greedy tokens and parameter bytes of each checkpoint."""
    out = {}
    for name, path in checkpoints.items():
        model = load_pretrained(path)
        logits = np.array(model(mx.array(worker.TOKENS)))
        one = mn.generate(model, worker.PROMPT, max_new_tokens=worker.NEW)
        three = np.array(mn.generate(model, mx.array(worker.PROMPTS), max_new_tokens=worker.NEW)).tolist()
        long = [int(t) for t in mn.generate(model, worker.LONG, max_new_tokens=worker.NEW_LONG)]
        out[name] = dict(logits=logits, greedy1=[int(t) for t in one], greedy3=three, long=long,
                         bytes=parameter_bytes(model))
    return out


def checkpoint_names(path):
    """The tensor names of a checkpoint file (safetensors folder or GGUF file)."""
    if str(path).endswith(".gguf"):
        from metalnn.llm.gguf.reader import read_header

        return set(read_header(path).tensors)
    from metalnn.weights import open_provider

    return set(open_provider(path).keys())


def expected_reads(path, blocks, rank, size, tied):
    """The tensors a pipeline rank holding ``blocks`` must read (and no others)."""
    want = set()
    for name in checkpoint_names(path):
        m = re.match(r"^(?:model\.layers|backbone\.layers|blk)\.(\d+)\.", name)
        if m:
            keep = blocks[0] <= int(m.group(1)) < blocks[1]
        elif name in ("token_embd.weight", "model.embed_tokens.weight", "backbone.embeddings.weight"):
            keep = rank == 0 or (tied and rank == size - 1)
        else:  # final norm, head (rope factors: none in these files)
            keep = rank == size - 1
        if keep:
            want.add(name)
    return want


PIPELINE = ("llama", "moe", "gguf", "hybrid", "mamba")
# Three tensor-parallel ranks on two cores spin against each other at every one of a step's all_sums
# (~0.2 s a decoding step), so that case generates 6 tokens, not worker.NEW: greedy tokens are a
# prefix of the longer reference run's.
CASES = [("pipeline", 2, PIPELINE, worker.NEW), ("pipeline", 3, PIPELINE, worker.NEW),
         ("tensor", 2, ("llama", "moe", "gguf"), worker.NEW), ("tensor", 3, ("llama", "moe"), 6)]


@pytest.mark.parametrize("kind,size,names,new", CASES, ids=[f"{k}-{n}" for k, n, _, _ in CASES])
def test_ranks_equal_one_process(tmp_path, checkpoints, references, kind, size, names, new):
    r = launch(size, kind, tmp_path, [checkpoints[n] for n in names], "--new", str(new))
    assert r.ok, r.text
    logs = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(size)]
    for i, name in enumerate(names):
        ref = references[name]
        tied = name == "moe"
        covered = set()
        for rank, log in enumerate(logs):
            got = log["models"][i]
            where = f"{kind} rank {rank}/{size} {name}"
            logits = np.load(tmp_path / f"rank{rank}_{i}.npy")
            err = float(np.abs(logits - ref["logits"]).max())
            assert err <= LOGITS_TOL, f"{where}: logits differ by {err}"
            if kind == "pipeline":
                assert err == 0.0, f"{where}: a pipeline computes one process's arithmetic, yet differs by {err}"
            assert got["greedy1"] == ref["greedy1"][:new], where
            assert got["greedy3"] == [row[:new] for row in ref["greedy3"]], where
            assert got["long"] == ref["long"], where  # after a prompt of micro-batches on a pipeline
            if kind == "pipeline":
                assert len(got["spans"]) == 3, got["spans"]  # 199 positions: 3 micro-batches of >= 64
            share = got["bytes"] / ref["bytes"]
            assert share <= 1 / size + 0.10, f"{where}: holds {share:.3f} of the parameter bytes"
            reads = set(got["reads"])
            assert len(reads) == len(got["reads"]), f"{where}: a tensor read twice"
            if kind == "pipeline":
                assert reads == expected_reads(checkpoints[name], got["blocks"], rank, size, tied), where
            else:
                assert reads == checkpoint_names(checkpoints[name]), where
            covered |= reads
        assert covered == checkpoint_names(checkpoints[name])
        if kind == "pipeline":  # contiguous runs of blocks, one per rank, in rank order
            runs = [log["models"][i]["blocks"] for log in logs]
            assert runs[0][0] == 0 and all(a[1] == b[0] and a[0] < a[1] for a, b in zip(runs, runs[1:]))


@pytest.mark.parametrize("length,size", [(1, 2), (63, 2), (128, 2), (199, 2), (1000, 2), (1000, 3), (129, 5)])
def test_pipeline_prompts_run_as_even_micro_batches(length, size):
    """`PipelineLM.prefill_spans`: contiguous runs covering every position, ``MICRO_BATCHES_PER_RANK``
    per rank where each keeps ``MIN_MICRO_BATCH`` tokens, lengths within one token of each other."""
    from types import SimpleNamespace

    from metalnn.llm.distributed.pipeline import MICRO_BATCHES_PER_RANK, MIN_MICRO_BATCH, PipelineLM

    class Stage(PipelineLM):
        backbone = SimpleNamespace(size=size)

    spans = Stage().prefill_spans(length)
    assert spans[0][0] == 0 and spans[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len(spans) == max(1, min(MICRO_BATCHES_PER_RANK * size, length // MIN_MICRO_BATCH))
    sizes = [e - s for s, e in spans]
    assert max(sizes) - min(sizes) <= 1 and (len(spans) == 1 or min(sizes) >= MIN_MICRO_BATCH)
    assert Stage().prefill_spans(0) == []


def test_a_dead_rank_stops_the_others_naming_it(tmp_path, checkpoints):
    """Rank 1 is killed (SIGKILL) in the middle of the first generation; rank 0, blocked in the
    pipeline's exchange, must end with an error naming rank 1 instead of hanging (a hang would raise
    TimeoutExpired here) and write no results."""
    r = launch(2, "pipeline", tmp_path, [checkpoints["llama"]], "--die-at", "5", timeout=120)
    assert 1 in r.failed and re.search(r"rank 1 (\(pid \d+\) died|exited with code -9)", r.text), r.text
    assert not (tmp_path / "rank0.json").exists()


@pytest.mark.parametrize("split", ["pipeline", "tensor"])
def test_generate_command_under_mlx_launch(tmp_path, checkpoints, split):
    """``metalnn generate`` under ``mlx.launch`` (2 ranks, the GGUF model) writes, on rank 0 alone, the
    text one process writes."""
    cmd = ["-m", "metalnn", "generate", str(checkpoints["gguf"]), "--prompt", "hello there", "--max-tokens", "12",
           "--temperature", "0"]
    one = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    r = launch_ranks(2, [sys.executable, *cmd, "--split", split], timeout=180)
    assert r.ok, r.text
    assert r.stdout == one.stdout
    assert r.stderr.count("generation: 12 tokens") == 1, r.stderr
