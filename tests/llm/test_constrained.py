"""`metalnn.llm.constrained.GrammarConstraint` on a tiny random model whose text is garbage unless
constrained: every sampled completion (temperature 1.0, several seeds) is checked by an independent
judge -- ``jsonschema`` for JSON schemas, ``re.fullmatch`` for regular expressions and for a Lark
grammar's language written as a regex -- and the masks themselves against next-character sets
worked out by hand. The real vocabulary (SmolLM2's 49152 byte-level BPE tokens) goes through the
same checks with random logits.
"""

import json
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import metalnn as mn
from metalnn.llm.constrained import GrammarConstraint, GrammarError, ll_tokenizer
from metalnn.llm.generation import generate, stream_generate
from metalnn.llm.text_generation import TextStream

from app_models import tiny_tokenizer
from bundled_model import smollm2_file

#: the model's vocabulary is larger than the tokenizer's (99 tokens): the extra rows must never be sampled
MODEL_VOCAB = 128
SEEDS = range(4)

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "pet": {"enum": ["cat", "dog", None]}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "object",
     "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                               "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                              "required": ["x", "y"], "additionalProperties": False},
                    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}, "maxItems": 2}},
     "required": ["point", "tags"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 3}]},
]
REGEXES = [r"[0-9]{3}-[a-z]{2,5}", r"(yes|no|maybe)", r"\([a-c]+(,[a-c]+){0,2}\)"]


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_tokenizer()
    config = mn.models.llama_config(MODEL_VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=64)
    return mn.models.from_config(config, seed=0), tok


def sample(tiny, constraint, seed, max_tokens=200, prompt="<|im_start|>assistant\n"):
    model, tok = tiny
    stream = TextStream(model, tok, tok.encode(prompt), max_tokens, temperature=1.0, seed=seed,
                        processors=[constraint] if constraint is not None else None)
    return "".join(stream), stream


def allowed_text(constraint, tok, size=MODEL_VOCAB):
    """The set of tokens ``constraint`` leaves finite, as their text (special tokens by name)."""
    out = np.array(constraint(mx.zeros(size)))
    ids = np.nonzero(np.isfinite(out))[0]
    assert np.isneginf(out[~np.isfinite(out)]).all() and (out[ids] == 0).all()
    return {tok.tokenizer.id_to_token(int(i)) if i < tok.vocab_size else i for i in ids}


def test_unconstrained_output_is_garbage(tiny):
    """The model alone does not write JSON: what the constraint brings is not the model's doing."""
    for seed in SEEDS:
        text, _ = sample(tiny, None, seed, max_tokens=40)
        with pytest.raises(ValueError):
            json.loads(text)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_sample_validates_against_its_schema(tiny, index):
    schema = SCHEMAS[index]
    texts = set()
    for seed in SEEDS:
        text, stream = sample(tiny, GrammarConstraint.json_schema(tiny[1], schema), seed)
        jsonschema.validate(json.loads(text), schema)
        assert stream.finish_reason == "stop", (text, stream.finish_reason)
        assert all(t < tiny[1].vocab_size for t in stream.tokens)  # never a padding row of the model
        texts.add(text)
    assert len(texts) > 1  # sampled, not a fixed answer


def test_json_object_is_any_object(tiny):
    model, tok = tiny
    for seed in SEEDS:
        c = GrammarConstraint.json_object(tok)
        text, stream = sample(tiny, c, seed, max_tokens=400)
        if stream.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: still the beginning of an object
            assert text.startswith("{") and not c.done


@pytest.mark.parametrize("pattern", REGEXES)
def test_every_sample_fully_matches_the_regex(tiny, pattern):
    for seed in SEEDS:
        text, stream = sample(tiny, GrammarConstraint.regex(tiny[1], pattern), seed)
        assert re.fullmatch(pattern, text), text
        assert stream.finish_reason == "stop"


def test_lark_grammar(tiny):
    grammar = 'start: "[" item (", " item)* "]"\nitem: /[0-9]{1,2}/ | "x"'
    language = r"\[([0-9]{1,2}|x)(, ([0-9]{1,2}|x))*\]"
    for seed in SEEDS:
        text, _ = sample(tiny, GrammarConstraint.lark(tiny[1], grammar), seed)
        assert re.fullmatch(language, text), text


def test_masks_are_the_next_characters_of_the_regex(tiny):
    """Step by step through "42-ab", the allowed tokens are exactly the characters that can come
    next (worked out by hand), plus the end of sequence once the text is a full match."""
    tok = tiny[1]
    c = GrammarConstraint.regex(tok, r"[0-9]{2}-[a-z]+")
    digits, letters = set("0123456789"), set("abcdefghijklmnopqrstuvwxyz")
    expected = [digits, digits, {"-"}, letters, letters | {"<|im_end|>"}, letters | {"<|im_end|>"}]
    for step, char in enumerate("42-ab"):
        assert allowed_text(c, tok) == expected[step], step
        assert not c.done
        c.accept(tok.token_to_id(char))
    assert allowed_text(c, tok) == expected[5]
    assert c.accepting and not c.done
    c.accept(tok.token_to_id("<|im_end|>"))
    assert c.done


def test_the_json_mask_starts_with_the_brace_and_ends_with_eos(tiny):
    tok = tiny[1]
    c = GrammarConstraint.json_schema(tok, {"enum": ["ab"]})
    assert allowed_text(c, tok) == {'"'}
    for char in '"ab"':
        c.accept(tok.token_to_id(char))
    assert c.done and allowed_text(c, tok) == {"<|im_end|>"}
    with pytest.raises(GrammarError, match="not allowed"):
        GrammarConstraint.json_schema(tok, {"enum": ["ab"]}).accept(tok.token_to_id("x"))


def test_the_stream_stops_when_the_grammar_is_done(tiny):
    """No end-of-sequence token is needed: a complete grammar ends the text ("stop")."""
    for seed in SEEDS:
        c = GrammarConstraint.json_schema(tiny[1], {"enum": ["alpha", "beta"]})
        text, stream = sample(tiny, c, seed)
        assert text in ('"alpha"', '"beta"') and stream.finish_reason == "stop" and c.done
        assert tiny[1].eos_token_id not in stream.tokens


def test_the_dtype_is_kept_and_disallowed_logits_are_minus_infinity(tiny):
    tok = tiny[1]
    c = GrammarConstraint.regex(tok, "[ab]")
    logits = mx.array(np.random.default_rng(0).standard_normal(MODEL_VOCAB), dtype=mx.bfloat16)
    out = c(logits)
    assert out.dtype == mx.bfloat16 and out.shape == (MODEL_VOCAB,)
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    keep = np.zeros(MODEL_VOCAB, bool)
    keep[[a, b]] = True
    got, want = np.array(out.astype(mx.float32)), np.array(logits.astype(mx.float32))
    np.testing.assert_array_equal(got[keep], want[keep])
    assert np.isneginf(got[~keep]).all()


def test_greedy_decoding_matches_a_recomputed_reference(tiny):
    """The processor hook of stream_generate (masks computed while the next step runs, each token
    accepted before the next mask) against a plain loop: the whole sequence through the model
    each step, the mask of a second constraint, arg-max."""
    model, tok = tiny
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    pattern = r"[a-z]{3}(-[0-9])?"
    got = generate(model, prompt, 6, processors=[GrammarConstraint.regex(tok, pattern)], eos_token_id=())
    ref, seq = GrammarConstraint.regex(tok, pattern), list(prompt)
    want = []
    for _ in range(6):
        logits = model(mx.array([seq]))[0, -1]
        token = int(mx.argmax(ref(logits)))
        ref.accept(token)
        want.append(token)
        seq.append(token)
    assert got == want


def test_batched_rows_get_their_own_processors(tiny):
    """A constrained row and a free row in one batch: the free row is exactly what it is alone."""
    model, tok = tiny
    prompts = [tok.encode("<|im_start|>user\nab<|im_end|>\n"), tok.encode("<|im_start|>user\ncd<|im_end|>\n")]
    c = GrammarConstraint.regex(tok, "[0-9]+")
    rows = list(stream_generate(model, mx.array(prompts), 12, processors=[[c], None], eos_token_id=()))
    constrained, free = [r[0] for r in rows], [r[1] for r in rows]
    assert re.fullmatch("[0-9]+", tok.decode(constrained))
    assert free == generate(model, prompts[1], 12, eos_token_id=())
    with pytest.raises(ValueError, match="one list per batch row"):
        list(stream_generate(model, mx.array(prompts), 2, processors=[[c]]))


def test_bad_grammars_are_refused_with_llguidance_s_reason(tiny):
    tok = tiny[1]
    with pytest.raises(GrammarError, match="frob"):
        GrammarConstraint.json_schema(tok, {"type": "frob"})
    with pytest.raises(GrammarError, match="unknown name"):
        GrammarConstraint.lark(tok, "start: missing_rule")
    with pytest.raises(GrammarError, match="unclosed group"):
        GrammarConstraint.regex(tok, "(ab")
    with pytest.raises(GrammarError, match="object"):
        GrammarConstraint.json_schema(tok, ["not", "a", "schema"])
    # strict refuses keywords llguidance does not implement; not strict ignores them
    with pytest.raises(GrammarError, match="uniqueItems"):
        GrammarConstraint.json_schema(tok, {"type": "array", "uniqueItems": True})
    GrammarConstraint.json_schema(tok, {"type": "array", "uniqueItems": True}, strict=False)


def test_the_llguidance_tokenizer_is_built_once_per_tokenizer(tiny):
    tok = tiny[1]
    assert ll_tokenizer(tok) is ll_tokenizer(tok)
    other = tiny_tokenizer()
    assert ll_tokenizer(other) is not ll_tokenizer(tok)
    assert ll_tokenizer(tok).vocab_size == tok.vocab_size


def test_smollm2_vocabulary(tiny):
    """The real byte-level BPE vocabulary (llguidance reads tokenizer.json itself): random logits,
    every sample valid under the schema, and the mask's tokens all decode to text that continues it."""
    tok = mn.models.load_tokenizer(smollm2_file())
    schema = SCHEMAS[0]
    rng = np.random.default_rng(0)
    for _ in range(4):
        c = GrammarConstraint.json_schema(tok, schema)
        ids = []
        while not c.done and len(ids) < 200:
            logits = c(mx.array(rng.standard_normal(tok.vocab_size).astype(np.float32) * 4))
            token = int(mx.random.categorical(logits, key=mx.random.key(int(rng.integers(1 << 30)))))
            if token in tok.eos_token_ids:
                break
            c.accept(token)
            ids.append(token)
        jsonschema.validate(json.loads(tok.decode(ids)), schema)
