"""The ``metalnn`` command, run as a child process (``python -m metalnn``), on the tiny model of
tests/support/app_models.py.

Generated text is compared with `metalnn.llm.text_generation.TextStream` in this process on the same
checkpoint (greedy decoding); sizes with the checkpoint's tensors read by ``safetensors``; LoRA
adapters with PEFT (the format's reference implementation).
"""

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import metalnn as mn
from metalnn.llm.tuner import lora
from metalnn.llm.text_generation import TextStream

from app_models import save_tiny_model
from commands import assert_one_line_error, metalnn_cmd, metalnn_in_process
from bundled_model import smollm2_file

COMMANDS = ("info", "generate", "chat", "serve", "quantize", "export", "lora", "dpo", "orpo", "kto", "grpo", "bench")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def local(tiny):
    return mn.models.load_pretrained(tiny), mn.models.load_tokenizer(tiny)


def greedy(local, ids, max_tokens, **kw):
    model, tok = local
    s = TextStream(model, tok, ids, max_tokens, temperature=0.0, **kw)
    return "".join(s), s


def test_every_command_has_help_and_the_console_script_is_declared():
    result = metalnn_cmd("--help")
    assert result.returncode == 0
    assert metalnn_cmd("generate", "--help").stdout.startswith("usage: metalnn generate")  # through the script
    for command in COMMANDS:
        assert command in result.stdout
        sub = metalnn_in_process(command, "--help")
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: metalnn {command}"), sub.stderr
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("metalnn") == "metalnn.cli:main"
    assert metalnn_cmd("--version").stdout.strip() == f"metalnn {mn.__version__}"


def test_importing_metalnn_leaves_out_the_server_stack():
    code = ("import sys, metalnn, metalnn.cli; "
            "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn', 'pydantic') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_info(tiny):
    from safetensors.numpy import load_file

    tensors = load_file(str(tiny / "model.safetensors"))
    result = metalnn_cmd("info", tiny)
    assert result.returncode == 0, result.stderr
    assert re.search(r"architecture\s+LlamaForCausalLM", result.stdout)
    assert re.search(r"layers\s+2\n", result.stdout)
    assert f"({sum(t.size for t in tensors.values()):,})" in result.stdout
    assert re.search(r"weights\s+float32", result.stdout)
    assert re.search(r"context length\s+4096", result.stdout)
    assert re.search(r"tokenizer\s+yes, ends at <\|im_end\|>", result.stdout)
    assert re.search(r"chat template\s+yes", result.stdout)
    facts = json.loads(metalnn_cmd("info", tiny, "--json").stdout)
    assert facts["parameters"] == sum(t.size for t in tensors.values()) and facts["quantization"] is None


def test_generate_streams_the_library_text_and_reports_speeds(tiny, local):
    _, tok = local
    want, ref = greedy(local, tok.encode("Once upon"), 30)
    result = metalnn_cmd("generate", tiny, "--prompt", "Once upon", "--max-tokens", "30", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n"
    assert re.search(rf"prompt: {ref.prompt_tokens} tokens, [\d.]+ tokens/s", result.stderr), result.stderr
    assert re.search(r"generation: 30 tokens, [\d.]+ tokens/s \(--max-tokens reached\)", result.stderr)
    # the prompt from stdin gives the same
    from_stdin = metalnn_cmd("generate", tiny, "--prompt", "-", "--max-tokens", "30", "--temperature", "0",
                             input="Once upon")
    assert from_stdin.stdout == result.stdout


def test_generate_chat_system_and_stop(tiny, local):
    _, tok = local
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    full, _ = greedy(local, tok.apply_chat_template(messages), 40)
    result = metalnn_cmd("generate", tiny, "--chat", "--system", "Be brief.", "--prompt", "Hi", "--max-tokens", "40",
                         "--temperature", "0")
    assert result.stdout == full + "\n"
    stop = full[8:11]
    result = metalnn_cmd("generate", tiny, "--chat", "--system", "Be brief.", "--prompt", "Hi", "--max-tokens", "40",
                         "--temperature", "0", "--stop", stop)
    assert result.stdout == full[:full.find(stop)] + "\n" and "(end of text)" in result.stderr
    sampled = metalnn_cmd("generate", tiny, "--prompt", "Hi", "--temperature", "1", "--seed", "3", "--top-k", "10",
                          "--top-p", "0.9", "--max-tokens", "30")
    want, _ = greedy(local, tok.encode("Hi"), 30)
    model, _ = local
    s = TextStream(model, tok, tok.encode("Hi"), 30, temperature=1.0, seed=3, top_k=10, top_p=0.9)
    assert sampled.stdout == "".join(s) + "\n" != want + "\n"


def test_generate_samples_like_the_server_by_default(tiny, local, tmp_path):
    """No sampling options: the model's generation_config.json, else the shared default (the same
    SamplingParams the server builds)."""
    from metalnn.llm.sampling import SamplingParams

    model, tok = local
    result = metalnn_cmd("generate", tiny, "--prompt", "Hi", "--seed", "5", "--max-tokens", "30")
    want = TextStream(model, tok, tok.encode("Hi"), 30, sampling=SamplingParams.from_generation_config(None, seed=5))
    assert result.stdout == "".join(want) + "\n"
    assert result.stdout != greedy(local, tok.encode("Hi"), 30)[0] + "\n"
    import shutil

    folder = shutil.copytree(tiny, tmp_path / "greedy-config")
    (folder / "generation_config.json").write_text('{"do_sample": false}')
    result = metalnn_cmd("generate", folder, "--prompt", "Hi", "--seed", "5", "--max-tokens", "30")
    assert result.stdout == greedy(local, tok.encode("Hi"), 30)[0] + "\n"


def test_chat_from_stdin_with_reset_and_exit(tiny, local):
    _, tok = local
    hello = [{"role": "user", "content": "Hello"}]
    a1, _ = greedy(local, tok.apply_chat_template(hello), 25)
    a2, _ = greedy(local, tok.apply_chat_template(hello + [{"role": "assistant", "content": a1},
                                                           {"role": "user", "content": "More"}]), 25)
    result = metalnn_cmd("chat", tiny, "--max-tokens", "25", "--temperature", "0",
                         input="Hello\n/reset\nHello\nMore\n/exit\nNever asked\n")
    assert result.returncode == 0, result.stderr
    # after /reset the same question gets the same answer; the next turn sees the history
    assert result.stdout == "> " + a1 + "\n> > " + a1 + "\n> " + a2 + "\n> "
    assert result.stderr.count(" tokens/s]") == 3 and "[conversation cleared]" in result.stderr
    # end of input also leaves
    assert metalnn_cmd("chat", tiny, "--max-tokens", "5", input="Hello\n").returncode == 0


def _signal_status() -> str:
    """This process's ignored and blocked signal masks (``/proc/self/status``), for failure messages."""
    lines = Path("/proc/self/status").read_text().splitlines() if Path("/proc/self/status").exists() else []
    return " ".join(line for line in lines if line.startswith(("SigBlk", "SigIgn")))


@pytest.fixture(scope="module")
def slow_tiny(tmp_path_factory):
    """A wider chat model (512 wide, 8 layers: ~100 tokens/s on two cores) whose greedy answer to the
    Ctrl-C test's question runs past 400 tokens: the 3000-token answer is still running when the
    test has read its first 40 characters, however loaded the machine (the 64-wide model writes all
    3000 tokens in about two seconds, which a busy reader may not outlast)."""
    return save_tiny_model(tmp_path_factory.mktemp("slow") / "tiny", hidden_size=512, num_hidden_layers=8, seed=1)


def test_chat_ctrl_c_stops_the_answer_not_the_program(slow_tiny):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # A child inherits its parent's ignored and blocked signals: a test run whose process ignores or
    # blocks SIGINT (a launcher, a library's thread setup) would start a chat that never sees Ctrl-C,
    # unlike one started from a terminal. The child gets a terminal's SIGINT: unblocked, and Python's
    # KeyboardInterrupt handler (which Python leaves out when SIGINT arrives ignored).
    terminal_like = ("import signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); "
                     "signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "from metalnn.cli import main; sys.exit(main(sys.argv[1:]))")
    # greedy: this model's greedy answer runs past 400 tokens (sampled ones may end early)
    p = subprocess.Popen([sys.executable, "-c", terminal_like, "chat", str(slow_tiny), "--max-tokens", "3000",
                          "--temperature", "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = [], []
    readers = [threading.Thread(target=lambda f, acc: acc.extend(iter(lambda: f.read(1), "")), args=a, daemon=True)
               for a in ((p.stdout, out), (p.stderr, err))]
    for r in readers:
        r.start()
    try:
        p.stdin.write("Talk for a long time\n")
        p.stdin.flush()
        deadline = time.monotonic() + 120
        while len("".join(out)) < 40:  # the answer is streaming
            assert p.poll() is None and time.monotonic() < deadline, "".join(err)
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        while "stopped]" not in "".join(err):
            assert p.poll() is None and time.monotonic() < deadline, (_signal_status(), "".join(err))
            time.sleep(0.02)
        p.stdin.write("/exit\n")
        p.stdin.flush()
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    for r in readers:
        r.join(10)
    stderr = "".join(err)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    tokens = int(re.search(r"\[(\d+) tokens, [\d.]+ tokens/s, stopped\]", stderr).group(1))
    assert 0 < tokens < 3000


def test_quantize_writes_a_loadable_quantized_copy(tiny, local, tmp_path):
    out = tmp_path / "q4"
    result = metalnn_cmd("quantize", tiny, out, "--bits", "4", "--group-size", "64")
    assert result.returncode == 0, result.stderr
    # 2 x 7 projections, the embedding and the output projection
    assert "quantized 16 layer(s) to 4 bits (group size 64" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    # each weight is within one quantization step of the float one (4 bits: 15 steps per group's range; MLX
    # places the grid so that the group's edge of largest magnitude is exact, so errors reach up to one step)
    model, _ = local
    quantized = mn.models.load_pretrained(out)
    w = np.array(model.model.layers[0].self_attn.q_proj.weight).reshape(-1, 64)
    deq = np.array(quantized.model.layers[0].self_attn.q_proj.dequantized_weight()).reshape(-1, 64)
    step = (w.max(axis=1) - w.min(axis=1)) / 15
    assert np.all(np.abs(w - deq) <= step[:, None] * 1.001 + 1e-7)
    assert np.abs(w - deq).mean() < 0.35 * step.mean()  # rounding to nearest: a quarter step on average
    info = json.loads(metalnn_cmd("info", out, "--json").stdout)
    assert info["quantization"]["bits"] == 4 and info["quantization"]["group_size"] == 64
    assert info["parameters"] == json.loads(metalnn_cmd("info", tiny, "--json").stdout)["parameters"]
    assert metalnn_cmd("generate", out, "--prompt", "Hi", "--max-tokens", "5").returncode == 0
    # refusals: a folder that is not empty, a model already quantized
    assert_one_line_error(metalnn_cmd("quantize", tiny, out), "not an empty folder")
    assert_one_line_error(metalnn_cmd("quantize", out, tmp_path / "again"), "already quantized")
    assert not (tmp_path / "again").exists()


def test_lora_trains_peft_adapters(tiny, tmp_path):
    import peft  # noqa: PLC0415  (the test extra's oracles; imported here to keep the other tests light)
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    data = tmp_path / "train.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": f"{w} {w} {w}"}]}
            for w in ("red", "blue", "green", "gold", "teal", "pink", "gray", "navy")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "adapters"
    result = metalnn_cmd("lora", tiny, "--train", data, "--valid", data, "--out", out, "--steps", "30",
                         "--batch-size", "4", "--learning-rate", "3e-2", "--rank", "4", "--alpha", "8",
                         "--targets", "q_proj,v_proj,lm_head")
    assert result.returncode == 0, result.stderr
    # the output projection too: the random model's logits are too small to fit the answers through the blocks
    assert result.stdout.startswith("LoRA: 5 adapters of rank 4 on q_proj, v_proj, lm_head")
    before, after = map(float, re.search(r"validation loss: ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    assert after < before * 0.8, result.stdout  # it learned the answers it was shown
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8

    # PEFT reads them into transformers' Llama: the same logits as metalnn with the adapters
    tok = mn.models.load_tokenizer(tiny)
    ids = tok.apply_chat_template(rows[0]["messages"])
    ours = mn.models.load_pretrained(tiny)
    lora.load_adapters(ours, out)
    want = np.array(ours(mx.array([ids])))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf, str(out))(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)  # float32, 2 tiny layers
    # QLoRA: the same on 4-bit weights
    qlora = metalnn_cmd("lora", tiny, "--train", data, "--out", tmp_path / "qlora", "--steps", "2", "--quantize", "4")
    assert qlora.returncode == 0 and qlora.stdout.startswith("QLoRA:"), qlora.stderr
    # with gradient checkpointing: the same gradients, so the same adapters (float32 recomputation: 1e-5)
    ckpt = metalnn_cmd("lora", tiny, "--train", data, "--out", tmp_path / "qlora-ckpt", "--steps", "2", "--quantize",
                       "4", "--grad-checkpoint")
    assert ckpt.returncode == 0, ckpt.stderr
    assert "gradient checkpointing: 2 blocks recomputed" in ckpt.stdout, ckpt.stdout
    plain, recomputed = (mx.load(str(tmp_path / d / "adapter_model.safetensors")) for d in ("qlora", "qlora-ckpt"))
    assert plain.keys() == recomputed.keys()
    for name in plain:
        np.testing.assert_allclose(np.array(recomputed[name]), np.array(plain[name]), atol=1e-5, err_msg=name)


def test_bench(tiny):
    result = metalnn_cmd("bench", tiny, "--prompt-tokens", "16", "--gen-tokens", "8", "--runs", "1")
    assert result.returncode == 0, result.stderr
    prompt = float(re.search(r"prompt:\s+([\d.]+) tokens/s", result.stdout).group(1))
    generation = float(re.search(r"generation:\s+([\d.]+) tokens/s", result.stdout).group(1))
    assert prompt > 0 and generation > 0


def test_errors_are_one_clear_line(tiny, tmp_path):
    # in this process but serve (which would install its signal handlers here); `metalnn_cmd` checks the
    # same one-line form through the real script in the other command tests
    assert_one_line_error(metalnn_in_process("generate", tmp_path / "nothing", "--prompt", "x"), "nothing", "no such file")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"architectures": ["FooForCausalLM"]}')
    assert_one_line_error(metalnn_in_process("info", tmp_path / "odd"), "unsupported architecture FooForCausalLM")
    assert_one_line_error(metalnn_cmd("serve", tmp_path / "odd", "--port", "0"), "FooForCausalLM")
    plain = save_tiny_model(tmp_path / "plain", chat_template=None)
    assert_one_line_error(metalnn_in_process("chat", plain), "no chat template")
    assert_one_line_error(metalnn_in_process("generate", plain, "--chat", "--prompt", "x"), "no chat template")
    assert_one_line_error(metalnn_in_process("generate", tiny, "--system", "s", "--prompt", "x"), "--system needs --chat")
    assert_one_line_error(metalnn_in_process("generate", tiny, "--prompt", "x", "--top-p", "1.5"), "--top-p")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    assert_one_line_error(metalnn_in_process("lora", tiny, "--train", bad, "--out", tmp_path / "a"), f"{bad}:2", "JSON")
    assert not (tmp_path / "a").exists()
    usage = metalnn_in_process("generate", tiny, "--prompt", "x", "--max-tokens", "many")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr and "--max-tokens" in usage.stderr
    assert metalnn_in_process().returncode == 2


def test_info_of_the_smollm2_gguf():
    """The facts of SmolLM2-135M-Instruct (Q4_1): its published architecture numbers."""
    facts = json.loads(metalnn_cmd("info", smollm2_file(), "--json").stdout)
    hidden, ffn, layers, vocab, kv = 576, 1536, 30, 49152, 3 * 64
    per_block = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    assert facts["parameters"] == vocab * hidden + layers * per_block + hidden  # tied output: 134,515,008
    assert facts["layers"] == 30 and facts["context_length"] == 8192 and facts["vocab_size"] == vocab
    # the file's blocks, as llama.cpp's Q4_1 mix holds them: every projection Q4_1, the token table Q8_0
    assert facts["quantization"]["ggml_types"] == {"Q4_1": 210, "Q8_0": 1} and facts["quantization"]["bits"] is None
    assert facts["chat_template"] and facts["eos_tokens"] == ["<|im_end|>"]
