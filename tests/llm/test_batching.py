"""Continuous batching (`metalnn.llm.batching.BatchGenerator`, `metalnn.layers.batch_cache`) against
transformers: every sequence of a batch, joining and leaving at different steps, gets the logits
transformers computes for that sequence alone.

The sampler of these tests records each row's logits and feeds back a fixed continuation (teacher
forcing), so a sequence's logits at each step are compared with transformers' logits of the whole
sequence without a cache. Families: Llama with GQA (the fused native decoding step with
per-sequence first columns), Mistral with a sliding window of 3 (the window and the padding mask
together), Qwen3 (q/k norms), GPT-2 (learned absolute positions: per-sequence position ids),
Qwen3.5 (Gated DeltaNet recurrent states stacked by row, attention rows left-aligned); the Llama model
also on the ``"reference"`` device (op by op: RoPE with per-sequence offsets, each row's causal mask
in the attention op).

Tolerance 2e-4 of the logits' scale: float32 against float32 through two or three blocks, as the
model tests (measured ~1e-6 to 3e-5).
"""

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import metalnn as mn
from metalnn.layers.batch_cache import BatchKVCache, keep_rows, merge_rows
from metalnn.llm.batching import BatchGenerator
from metalnn.llm.prefix_cache import PrefixCache
from tests.support.hf_models import hf_logits, hf_model

TOL = 2e-4
VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
            tie_word_embeddings=False)
HYBRID = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, initializer_range=0.2,
              layer_types=["linear_attention", "full_attention", "linear_attention"], tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
FAMILIES = {
    "llama_gqa": lambda: hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **BASE),
    "mistral_window": lambda: hf_model(transformers.MistralConfig, transformers.MistralForCausalLM, **BASE,
                                       sliding_window=3),
    "qwen3_qk_norm": lambda: hf_model(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, **BASE, head_dim=16),
    "gpt2": lambda: hf_model(transformers.GPT2Config, transformers.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=64,
                             n_layer=2, n_head=4, n_positions=128, initializer_range=0.1),
    "qwen3_5_hybrid": lambda: hf_model(transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, **HYBRID),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            hf = FAMILIES[name]()
            folder = tmp_path_factory.mktemp(name)
            hf.save_pretrained(folder)
            cache[name] = (hf, mn.models.load_pretrained(folder))
        return cache[name]
    return get


class Forced:
    """A sampler that records each row's logits and answers each sequence's fixed continuation."""

    def __init__(self):
        self.logits = {}

    def __call__(self, sequences, logits):
        rows = np.array(logits)
        out = []
        for seq, row in zip(sequences, rows):
            self.logits.setdefault(seq.uid, []).append(row)
            out.append(seq.state[len(seq.tokens)])
        return out


def run_batch(model, sequences, steps_before_join, device=None, prefill_chunk=4, prefix_cache=None):
    """Run ``sequences`` (``(full tokens, prompt length)``) through a `BatchGenerator`; sequence i is
    added after ``steps_before_join[i]`` steps. Returns ``{i: logits [n_new, vocab]}``."""
    forced = Forced()
    gen = BatchGenerator(model, sample=forced, prefill_chunk=prefill_chunk, device=device, prefix_cache=prefix_cache)
    uids, step = {}, 0
    pending = sorted(range(len(sequences)), key=lambda i: steps_before_join[i])
    while pending or gen:
        while pending and steps_before_join[pending[0]] <= step:
            i = pending.pop(0)
            full, p = sequences[i]
            seq = gen.add(full[:p], max_tokens=len(full) - p + 1, state=list(full[p:]) + [0])
            uids[i] = seq.uid
        gen.step()
        step += 1
        assert step < 500
    return {i: np.stack(forced.logits[u]) for i, u in uids.items()}


def check(hf, got, sequences):
    for i, (full, p) in enumerate(sequences):
        want = hf_logits(hf, np.array([full]))[0, p - 1:]
        assert got[i].shape == want.shape, (i, got[i].shape, want.shape)
        err = np.abs(got[i] - want).max() / np.abs(want).max()
        assert err < TOL, f"sequence {i}: relative error {err:.3g}"


def make_sequences(seed, lengths, new):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, p + n).tolist(), p) for p, n in zip(lengths, new)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_sequences_get_their_own_logits(checkpoints, family):
    hf, model = checkpoints(family)
    # prompts of 3, 11, 6 and 1 tokens (11 > the batch's columns when it joins: the buffers grow),
    # different lengths of continuation (rows leave at different steps), joins while others decode
    sequences = make_sequences(1, [3, 11, 6, 1], [9, 4, 7, 5])
    got = run_batch(model, sequences, [0, 2, 2, 7])
    check(hf, got, sequences)


def test_op_by_op_path_masks_each_row_and_offsets_rope(checkpoints):
    hf, model = checkpoints("llama_gqa")
    sequences = make_sequences(2, [5, 2, 9], [6, 8, 3])
    got = run_batch(model, sequences, [0, 1, 3], device=mn.Device(kernels="reference"))
    check(hf, got, sequences)


def test_prefix_cache_reuses_a_shared_beginning(checkpoints):
    hf, model = checkpoints("llama_gqa")
    rng = np.random.default_rng(3)
    shared = rng.integers(0, VOCAB, 20).tolist()
    first = (shared + rng.integers(0, VOCAB, 6).tolist(), 22)
    second = (shared + rng.integers(0, VOCAB, 9).tolist(), 25)  # branches off after the 20 shared tokens
    cache = PrefixCache(min_tokens=8)
    got = run_batch(model, [first], [0], prefix_cache=cache)
    check(hf, got, [first])
    assert len(cache) >= 1
    got = run_batch(model, [second], [0], prefix_cache=cache)
    check(hf, got, [second])
    assert cache.hits == 1 and cache.hit_tokens == 20
    # the entry was not changed by the sequence that continued from it
    got = run_batch(model, [first], [0], prefix_cache=cache)
    check(hf, got, [first])


def test_prefix_cache_of_a_hybrid_model_needs_whole_entries(checkpoints):
    hf, model = checkpoints("qwen3_5_hybrid")
    rng = np.random.default_rng(4)
    turn1 = rng.integers(0, VOCAB, 12).tolist()
    cache = PrefixCache(min_tokens=4)
    got = run_batch(model, [(turn1 + [5, 6, 7], 12)], [0], prefix_cache=cache)
    # stored: the prompt (12 tokens) and the prompt with the new tokens fed back (5, 6, 7; the last
    # new token is never fed back)
    turn2 = (turn1 + [5, 6, 7] + rng.integers(0, VOCAB, 8).tolist(), 18)
    got = run_batch(model, [turn2], [0], prefix_cache=cache)
    check(hf, got, [turn2])
    assert cache.hit_tokens == 15
    # a prompt that diverges inside an entry cannot use a recurrent state of another length
    other = (turn1[:10] + rng.integers(0, VOCAB, 6).tolist(), 16)
    before = cache.hits
    check(hf, run_batch(model, [other], [0], prefix_cache=cache), [other])
    assert cache.hits == before


def test_merge_and_keep_rows_layout():
    def kv(n, fill):
        c = mn.layers.KVCache()
        c.update_and_fetch(mx.full((1, 2, n, 4), fill, mx.float32), mx.full((1, 2, n, 4), -fill, mx.float32))
        return [c]
    merged = merge_rows([kv(3, 1.0), kv(5, 2.0)])[0]
    assert isinstance(merged, BatchKVCache) and merged.offset == 5 and merged.lengths == [3, 5]
    assert merged.positions.tolist() == [3, 5] and merged.ragged
    keys = np.array(merged.keys)
    assert np.all(keys[0, :, :3] == 1) and np.all(keys[0, :, 3:] == 0) and np.all(keys[1, :, :5] == 2)
    # two new positions: each row writes at its own columns, each query sees its own past
    merged.update_and_fetch(mx.full((2, 2, 2, 4), 7.0), mx.full((2, 2, 2, 4), -7.0))
    assert merged.lengths == [5, 7]
    keys = np.array(merged.keys)
    assert np.all(keys[0, :, 3:5] == 7) and np.all(keys[0, :, 5:7] == 0) and np.all(keys[1, :, 5:7] == 7)
    mask = np.array(merged.key_mask(2))[:, 0]
    assert mask.shape == (2, 2, 7)
    assert mask[0].tolist() == [[True] * 4 + [False] * 3, [True] * 5 + [False] * 2]
    assert mask[1].tolist() == [[True] * 6 + [False], [True] * 7]
    window = np.array(merged.key_mask(2, window=2))[:, 0]
    assert window[0, 1].tolist() == [False] * 3 + [True] * 2 + [False] * 2
    merged.rewind([1, 0])
    assert merged.lengths == [4, 7]
    kept = keep_rows([merged], [0])[0]
    assert kept.lengths == [4] and not kept.ragged and np.all(np.array(kept.keys)[0, :, 3] == 7)
    with pytest.raises(ValueError, match="no caches"):
        merge_rows([])


def test_generator_limits_eos_and_cancel(checkpoints):
    _, model = checkpoints("llama_gqa")
    gen = BatchGenerator(model, prefill_chunk=64)
    a = gen.add([1, 2, 3], max_tokens=3)
    b = gen.add([4, 5], max_tokens=50)
    c = gen.add([6], max_tokens=50)
    events = []
    for _ in range(3):
        events += gen.step()
    # a's first greedy token decides the eos id of a fourth sequence with the same prompt
    first_a = next(e.token for e in events if e.uid == a.uid)
    d = gen.add([1, 2, 3], max_tokens=50, eos=[first_a])
    assert gen.cancel(c.uid) and c.finish_reason == "cancelled" and not gen.cancel(c.uid)
    while gen:
        events += gen.step()
        if len(b.tokens) >= 6:
            gen.cancel(b.uid)
    assert a.finish_reason == "length" and len(a.tokens) == 3
    assert d.finish_reason == "stop" and d.tokens == [first_a]
    assert b.finish_reason == "cancelled" and len(b.tokens) == 6
    ends = [e for e in events if e.finish_reason]
    assert sorted(e.uid for e in ends) == sorted([a.uid, d.uid])
    with pytest.raises(ValueError, match="empty"):
        gen.add([], max_tokens=3)


def test_first_token_returns_before_decoding_only_when_the_batch_was_empty(checkpoints):
    """Into an empty batch, a prompt's first token returns from the step that sampled it, no
    decoding step queued yet (`BatchGenerator.steps` counts those); a prompt joining a running
    batch does not hold the others back: that step decodes them too. The tokens stay those of
    `generate` alone."""
    _, model = checkpoints("llama_gqa")
    gen = BatchGenerator(model, prefill_chunk=64)
    a = gen.add([1, 2, 3], max_tokens=6)
    events = gen.step()
    assert [(e.uid, e.token) for e in events] == [(a.uid, a.tokens[0])] and gen.steps == 0
    gen.step()
    assert gen.steps == 1
    b = gen.add([4, 5], max_tokens=6)
    before = gen.steps
    events = gen.step()
    assert b.uid in [e.uid for e in events] and gen.steps == before + 1
    while gen:
        gen.step()
    assert a.tokens == greedy_alone(model, [1, 2, 3], 6) and b.tokens == greedy_alone(model, [4, 5], 6)


def test_ragged_batch_decodes_in_the_fused_step(checkpoints):
    import io
    import re

    from metalnn.cpu import decode_step as native
    from native_platform import require_native

    require_native(native.available(), "the fused decoding step")
    _, model = checkpoints("llama_gqa")
    groups = []
    for n in (2, 5):
        caches = model.make_cache()
        mx.eval(model(mx.arange(n)[None], cache=caches))  # (the prompts: fused nodes of their own)
        groups.append(caches)
    caches = merge_rows(groups)
    assert caches[0].lengths == [2, 5]
    logits = model(mx.array([[1], [2]]), cache=caches)
    buf = io.StringIO()
    mx.export_to_dot(buf, logits)
    assert re.findall(r'label ?= ?"([A-Za-z_]+)', buf.getvalue()).count("DecoderStackStep") == 1


def greedy_alone(model, prompt, n):
    return mn.generate(model, prompt, n, eos_token_id=())


@pytest.mark.parametrize("drafter", ["lookup", "same_model", "other_model"])
def test_speculative_decoding_gives_the_greedy_tokens(checkpoints, drafter):
    from metalnn.llm.batching import DraftModel, PromptLookup

    _, model = checkpoints("llama_gqa")
    if drafter == "lookup":
        d = PromptLookup(max_ngram=3, min_ngram=1)
    elif drafter == "same_model":
        d = DraftModel(model)
    else:
        d = DraftModel(checkpoints("qwen3_qk_norm")[1])
    rng = np.random.default_rng(7)
    motif = rng.integers(0, VOCAB, 5).tolist()
    prompts = [motif * 4, rng.integers(0, VOCAB, 9).tolist(), motif * 2 + [3]]
    lengths = [24, 17, 30]
    gen = BatchGenerator(model, drafter=d, max_draft=4, prefill_chunk=8)
    seqs = [gen.add(p, n) for p, n in zip(prompts, lengths)]
    while gen:
        gen.step()
    for seq, p, n in zip(seqs, prompts, lengths):
        assert seq.tokens == greedy_alone(model, p, n)
    drafted, kept = sum(s.drafted for s in seqs), sum(s.accepted for s in seqs)
    assert drafted > 0 and kept > 0
    if drafter == "same_model":  # the model agrees with itself: every draft is kept
        assert kept == drafted
    # fewer batched passes than without drafts: several tokens per pass where drafts were kept
    plain = BatchGenerator(model, prefill_chunk=8)
    for p, n in zip(prompts, lengths):
        plain.add(p, n)
    while plain:
        plain.step()
    assert gen.steps < plain.steps


def test_hybrid_models_decode_without_drafts(checkpoints):
    from metalnn.llm.batching import PromptLookup

    _, model = checkpoints("qwen3_5_hybrid")
    prompt = [5, 6, 7] * 5
    gen = BatchGenerator(model, drafter=PromptLookup(min_ngram=1))
    seq = gen.add(prompt, 12)
    while gen:
        gen.step()
    assert seq.tokens == greedy_alone(model, prompt, 12) and seq.drafted == 0


def test_pipelined_steps_give_each_sequence_its_lone_greedy_tokens(checkpoints):
    """The default greedy sampler pipelines: step n + 1 is queued before step n is read. Rows
    joining late, leaving at their limits or an EOS id, and a cancel mid-run all keep each
    sequence's tokens those of `generate` alone; the prefix cache stores what the caches hold."""
    _, model = checkpoints("llama_gqa")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (4, 9, 2, 6)]
    limits = [7, 15, 11, 9]
    cache = PrefixCache(min_tokens=2)
    gen = BatchGenerator(model, prefill_chunk=4, prefix_cache=cache)
    assert gen.sample_lazy is not None
    alone = [greedy_alone(model, p, n) for p, n in zip(prompts, limits)]
    eos = alone[3][4]  # the fourth sequence stops at its fifth token
    seqs = [gen.add(prompts[0], limits[0]), gen.add(prompts[1], limits[1])]
    steps = 0
    while gen:
        gen.step()
        steps += 1
        if steps == 3:
            seqs.append(gen.add(prompts[2], limits[2]))
            seqs.append(gen.add(prompts[3], limits[3], eos=[eos]))
    for seq, want in zip(seqs[:3], alone):
        assert seq.tokens == want
    assert seqs[3].tokens == alone[3][:alone[3].index(eos) + 1] and seqs[3].finish_reason == "stop"
    # a finished sequence's cache entry continues exactly: its tokens as a new prompt reuse it
    full = prompts[1] + seqs[1].tokens
    again = BatchGenerator(model, prefix_cache=cache)
    follow = again.add(full, 4)
    while again:
        again.step()
    assert follow.cached_prefix >= len(full) - 2
    assert follow.tokens == greedy_alone(model, full, 4)


def test_pipelined_steps_write_the_caches_in_place(checkpoints, monkeypatch):
    """Step n + 1's graph is built while step n runs but queued only after step n has finished: its
    cache write then takes the cache buffer over (MLX decides when queuing) instead of copying every
    layer's cache a step while step n still holds it. Checked where it is decided (step n's tokens
    are evaluated before step n + 1 is queued) and by its effect (one buffer over the steps); the
    tokens stay `generate`'s alone."""
    from metalnn.cpu import decode_step as native
    from native_platform import require_native

    require_native(native.available(), "the fused decoding step")
    _, model = checkpoints("llama_gqa")
    prompts = [[5, 9, 2], [7, 1, 3, 8, 4]]
    gen = BatchGenerator(model)
    evaluated, queued_behind = [], []
    real_eval, real_async = mx.eval, mx.async_eval

    def spy_eval(*arrays):
        evaluated.extend(arrays)
        return real_eval(*arrays)

    def spy_async(*arrays):
        prev = gen._pending  # (still the step before while the next one is queued)
        if prev is not None:
            queued_behind.append(any(a is prev.tokens for a in evaluated))
        return real_async(*arrays)

    monkeypatch.setattr(mx, "eval", spy_eval)
    monkeypatch.setattr(mx, "async_eval", spy_async)
    seqs = [gen.add(p, 12) for p in prompts]
    buffers = []
    while gen:
        gen.step()
        if gen.running == 2 and gen._pending is not None:
            real_eval(gen._pending.tokens)
            view = np.array(gen._caches[1].store.buffer, copy=False)  # (every layer's cache: one buffer)
            buffers.append(view.__array_interface__["data"][0])
            del view
    monkeypatch.undo()
    assert len(queued_behind) >= 8 and all(queued_behind), queued_behind
    assert len(buffers) >= 8 and len(set(buffers[1:])) == 1, buffers
    assert [s.tokens for s in seqs] == [greedy_alone(model, p, 12) for p in prompts]


def test_keep_and_merge_rows_of_a_decoding_batch_stay_in_one_buffer(checkpoints):
    """After fused steps a batch's caches are bound to one stack buffer (`metalnn.functional.StackCache`);
    `keep_rows` and `merge_rows` of them give caches bound to a new one holding the same rows, so
    the next step needs no gathering of every layer's cache (a copy of all of them a join or leave)."""
    from metalnn.cpu import decode_step as native
    from native_platform import require_native

    require_native(native.available(), "the fused decoding step")
    _, model = checkpoints("llama_gqa")
    groups = []
    for prompt in ([5, 9, 2], [7, 1, 3, 8, 4]):
        caches = model.make_cache()
        mx.eval(model(mx.array([prompt]), cache=caches))
        groups.append(caches)
    batch = merge_rows(groups)
    mx.eval(model(mx.array([[3], [4]]), cache=batch))
    store = batch[0].store
    assert isinstance(store, mn.functional.StackCache) and all(c.store is store for c in batch)
    before = np.array(store.buffer)                                  # [layers, 2, rows, heads, capacity, width]
    kept = keep_rows(batch, [1])
    kept_store = kept[0].store
    assert kept_store is not store and all(c.store is kept_store for c in kept)
    assert [c.lengths for c in kept] == [[6]] * len(kept)
    np.testing.assert_array_equal(np.array(kept_store.buffer)[:, :, 0, :, :6], before[:, :, 1, :, :6])
    fresh = model.make_cache()
    mx.eval(model(mx.array([[2, 6]]), cache=fresh))
    merged = merge_rows([kept, fresh])
    merged_store = merged[0].store
    assert all(c.store is merged_store for c in merged) and [c.lengths for c in merged] == [[6, 2]] * len(merged)
    got = np.array(merged_store.buffer)
    np.testing.assert_array_equal(got[:, :, 0, :, :6], before[:, :, 1, :, :6])
    for i, c in enumerate(fresh):
        np.testing.assert_array_equal(got[i, 0, 1, :, :2], np.array(c.keys)[0, :, :2])
        np.testing.assert_array_equal(got[i, 1, 1, :, :2], np.array(c.values)[0, :, :2])
    # the merged batch decodes on from there as the rows' own caches would
    step = model(mx.array([[9], [9]]), cache=merged)
    assert all(c.store is merged_store for c in merged) and merged[0].lengths == [7, 3]
    alone = model(mx.array([[9]]), cache=fresh)
    np.testing.assert_allclose(np.array(step)[1], np.array(alone)[0], rtol=1e-4, atol=1e-5)


def spy_widths(model, monkeypatch) -> list:
    """The shapes of the token arrays ``model`` is called with, from now on (a list that grows)."""
    shapes, real = [], type(model).__call__

    def spy(self, tokens, *args, **kwargs):
        if self is model:
            shapes.append(tuple(np.shape(tokens)))
        return real(self, tokens, *args, **kwargs)
    monkeypatch.setattr(type(model), "__call__", spy)
    return shapes


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prompts_waiting_together_run_as_one_pass(checkpoints, family, monkeypatch):
    hf, model = checkpoints(family)
    # five prompts arrive at once (rests of 2 to 13 tokens: 5 x 13 = 65 padded tokens, within the
    # chunk of 80), two more while those decode
    sequences = make_sequences(5, [4, 13, 2, 7, 9, 3, 6], [5, 3, 8, 4, 6, 5, 2])
    shapes = spy_widths(model, monkeypatch)
    got = run_batch(model, sequences, [0, 0, 0, 0, 0, 3, 3], prefill_chunk=80)
    check(hf, got, sequences)
    prompt_passes = [s for s in shapes if s[-1] > 1]
    if family == "qwen3_5_hybrid":  # recurrent states: one prompt at a time
        assert prompt_passes == [(1, n) for n in (4, 13, 2, 7, 9, 3, 6)]
    else:
        assert prompt_passes == [(5, 13), (2, 6)]


def test_prompts_together_with_and_without_a_prefix_cache_match(checkpoints, monkeypatch):
    hf, model = checkpoints("llama_gqa")
    rng = np.random.default_rng(6)
    shared = rng.integers(0, VOCAB, 20).tolist()
    cache = PrefixCache(min_tokens=8)
    run_batch(model, [(shared + [1, 2], 21)], [0], prefix_cache=cache)  # stores the shared beginning
    # two prompts branching off after it (their rests: 5 and 2 tokens after a 20-position row) and
    # one that matches nothing (12 tokens from an empty row), waiting together; the first ends at
    # its first token (one new token) and never joins
    sequences = [(shared + rng.integers(0, VOCAB, 5).tolist(), 25), (shared + rng.integers(0, VOCAB, 4).tolist(), 22),
                 (rng.integers(0, VOCAB, 17).tolist(), 12), (shared + rng.integers(0, VOCAB, 4).tolist(), 24)]
    shapes = spy_widths(model, monkeypatch)
    got = run_batch(model, sequences, [0, 0, 0, 0], prefix_cache=cache, prefill_chunk=64)
    check(hf, got, sequences)
    assert [s for s in shapes if s[-1] > 1] == [(4, 12)]
    assert cache.hits == 3 and cache.hit_tokens == 60
    # each prompt was stored as computed in the padded pass: a later identical prompt reuses it whole
    again = run_batch(model, [sequences[2]], [0], prefix_cache=cache)
    check(hf, again, [sequences[2]])
    assert cache.hit_tokens == 60 + 11


def test_logits_at_each_rows_own_position(checkpoints):
    _, model = checkpoints("llama_gqa")
    tokens = mx.array(make_sequences(7, [6, 6], [0, 0])[0][0][:6] * 2).reshape(2, 6)
    full = model(tokens)
    got = model(tokens, last_only=[2, 5])
    assert got.shape == (2, 1, VOCAB)
    # (the head multiplies 2 rows here and 12 there: the same sums in another order, float32)
    want = np.array(mx.stack([full[0, 2], full[1, 5]]))
    assert np.abs(np.array(got[:, 0]) - want).max() <= 1e-5 * np.abs(want).max()
    for bad in ([1], [0, 6], [-1, 2]):
        with pytest.raises(ValueError, match="last_only must be True, False or one position"):
            model(tokens, last_only=bad)


def test_sequence_rows_layout_and_errors():
    from metalnn.layers.batch_cache import sequence_rows
    from metalnn.layers.attention import KVCache
    from metalnn.layers.gated_deltanet import GatedDeltaCache

    filled = KVCache()
    filled.update_and_fetch(mx.ones((1, 2, 3, 4)), 2 * mx.ones((1, 2, 3, 4)))
    rows = sequence_rows([[KVCache()], [filled], [KVCache()]])
    assert len(rows) == 1 and rows[0].lengths == [0, 3, 0]
    keys, values = np.array(rows[0].keys), np.array(rows[0].values)
    assert keys.shape[:2] == (3, 2) and keys.shape[2] >= 3
    assert np.all(keys[1, :, :3] == 1) and np.all(values[1, :, :3] == 2) and not keys[[0, 2]].any()
    assert sequence_rows([[KVCache()], [KVCache()]])[0].lengths == [0, 0]
    with pytest.raises(TypeError, match="layer 0 needs one-sequence KVCache"):
        sequence_rows([[GatedDeltaCache()], [KVCache()]])
    with pytest.raises(ValueError, match="cache lists of different lengths"):
        sequence_rows([[KVCache()], [KVCache(), KVCache()]])
