"""Choosing the next token: `SamplingParams`, `Sampler`, `sample_batch`, `sample_logits`.

The one place sampling lives; `metalnn.generate`, `metalnn.llm.text_generation.TextStream` and the
server's worker all go through it. One step turns a sequence's logits ``[V]`` into a token in two
stages:

1. **processing** (deterministic, per sequence, in this order): the `LogitsProcessor` s (e.g. a
   grammar that masks tokens with ``-inf``), ``logit_bias`` (added, as OpenAI does),
   ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor`` over the prompt and
   the generated tokens: a logit ``l`` of a token already seen becomes ``l * r`` if ``l < 0`` else
   ``l / r``), then ``presence_penalty`` and ``frequency_penalty`` (OpenAI's formula over the
   generated tokens: ``l - count * frequency_penalty - (count > 0) * presence_penalty``). The result
   are the *processed logits*.
2. **choosing**: temperature 0 is greedy, exactly the arg-max of the processed logits. Otherwise the
   processed logits are divided by the temperature and truncated like transformers' warpers, in
   transformers' order: ``top_k`` (the k largest, ties kept), ``top_p`` (the smallest set of most
   likely tokens whose probability reaches p), ``min_p`` (tokens at least ``min_p`` times as likely
   as the most likely one); then a token is drawn.

Log-probabilities (``logprobs``) are the log-softmax of the *processed* logits, before temperature
and truncation. This is OpenAI's convention of reporting what the model assigns rather than the
sampler's reshaped distribution (so they do not change with the temperature, and a truncated token
still has its real probability), with the request's own deterministic adjustments applied: a token
a grammar forbids or a bias of -100 suppresses is reported as (nearly) impossible, as it is.

Randomness: a sequence with a ``seed`` owns a key made from it, split once per sampled step, so the
same request draws the same tokens whatever else is decoded in the same batch. Without a seed, MLX's
global random state is used.

A batch of sequences (`sample_batch`) builds every row's lazy result and evaluates them all at once;
rows with the same plain parameters (no processors, bias or penalties, and greedy or unseeded) are
computed together as one ``[G, V]`` operation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Protocol, Sequence

import mlx.core as mx
import numpy as np

#: The temperature of the server, the ``metalnn generate`` / ``chat`` commands and the chat page when
#: the model's checkpoint states no sampling of its own (``generation_config.json``, a GGUF file's
#: ``general.sampling.*``), used with `DEFAULT_TOP_P`. Greedy decoding (0) makes small models fall
#: into loops, repeating a sentence until the token limit (the degeneration described by Holtzman
#: et al., "The Curious Case of Neural Text Degeneration", 2019, which introduced top-p); a moderate
#: temperature with nucleus sampling avoids that while staying close to the most likely answer, and
#: is what common servers default to (llama.cpp: 0.8 with top-p 0.95). One value everywhere means the
#: same question gets an answer of the same kind in the server, the terminal and the page.
DEFAULT_TEMPERATURE = 0.7
#: the nucleus of `DEFAULT_TEMPERATURE`: the least likely 5% of the probability mass is never drawn
DEFAULT_TOP_P = 0.95
#: the most alternatives a step can report (OpenAI's limit)
MAX_TOP_LOGPROBS = 20
#: ``logit_bias`` values are within +-this (OpenAI's range)
MAX_LOGIT_BIAS = 100.0
#: ``presence_penalty`` / ``frequency_penalty`` are within +-this (OpenAI's range)
MAX_PENALTY = 2.0

_SEED_LIMIT = 2**64


def _number(name, value, *, low=None, high=None, low_open=False, what=None) -> float:
    """``value`` as a float, checked to be finite and within ``[low, high]`` (``(low, high]`` with
    ``low_open``); a ValueError names the field, the expected range and the given value."""
    expected = what or "a finite number" + (f" {'>' if low_open else '>='} {low}" if low is not None else "") + (
        f" and <= {high}" if high is not None else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"SamplingParams.{name}: expected {expected}, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or (low is not None and (v <= low if low_open else v < low)) or (
            high is not None and v > high):
        raise ValueError(f"SamplingParams.{name}: expected {expected}, got {value!r}")
    return v


def _integer(name, value, low, high=None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low or (
            high is not None and value > high):
        bound = f" and <= {high}" if high is not None else ""
        raise ValueError(f"SamplingParams.{name}: expected a whole number >= {low}{bound}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence chooses its tokens (see the module docstring for the order of the steps).

    ``SamplingParams()`` is greedy decoding, the library's default (`metalnn.generate`); what a
    server or command uses when the request does not say is `from_generation_config`.

    Attributes:
        temperature: 0 for greedy (arg-max); else the logits are divided by it before sampling.
        top_k: sample among the k most likely tokens (None: no limit).
        top_p: nucleus sampling, in ``(0, 1]`` (None or 1: no limit).
        min_p: drop tokens less likely than ``min_p`` times the most likely one, in ``[0, 1]``
            (None or 0: no limit).
        presence_penalty, frequency_penalty: OpenAI's penalties in ``[-2, 2]``, over the tokens
            generated so far.
        repetition_penalty: transformers' multiplicative penalty (> 0; 1: none), over the prompt
            and the generated tokens.
        logit_bias: ``{token id: bias}`` added to the logits, biases in ``[-100, 100]``.
        seed: seed of this sequence's own random key (reproducible samples); None: MLX's global
            random state.
        logprobs: report the chosen token's log-probability (`TokenChoice.logprob`).
        top_logprobs: also report the most likely ``0..20`` tokens of each step (needs ``logprobs``).
    Raises:
        ValueError: a value out of its range (the message names the field, what was expected and
            what was given).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        put("temperature", _number("temperature", self.temperature, low=0.0))
        if self.top_k is not None:
            put("top_k", _integer("top_k", self.top_k, 1))
        if self.top_p is not None:
            put("top_p", _number("top_p", self.top_p, low=0.0, high=1.0, low_open=True))
        if self.min_p is not None:
            put("min_p", _number("min_p", self.min_p, low=0.0, high=1.0))
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _number(name, getattr(self, name), low=-MAX_PENALTY, high=MAX_PENALTY))
        put("repetition_penalty", _number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"SamplingParams.logit_bias: expected a dict {{token id: bias}}, "
                                 f"got {type(self.logit_bias).__name__}")
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
                    raise ValueError(f"SamplingParams.logit_bias: expected token ids >= 0 as keys, got {token!r}")
                bias[int(token)] = _number(f"logit_bias[{token}]", value, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
            put("logit_bias", bias or None)
        if self.seed is not None:
            put("seed", _integer("seed", self.seed, 0, _SEED_LIMIT - 1))
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"SamplingParams.logprobs: expected True or False, got {self.logprobs!r}")
        put("top_logprobs", _integer("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS))
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"SamplingParams.top_logprobs: expected 0 when logprobs is False, "
                             f"got {self.top_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the penalties need the sequence's token counts."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @classmethod
    def from_generation_config(cls, config: dict | None, **overrides) -> "SamplingParams":
        """The parameters a model's checkpoint recommends, then ``overrides``.

        Args:
            config: the model's ``generation_config.json`` as a dict (``model.generation_config``
                from `metalnn.llm.models.load_pretrained`), or None. When it states any of
                ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, those define the
                sampling: ``do_sample: false`` is greedy, otherwise its ``temperature`` (1 when
                absent, as in transformers), ``top_k`` (0: none), ``top_p`` (1: none) and ``min_p``;
                a key it does not state means no limit. When it states none of them (or there is
                no config), `DEFAULT_TEMPERATURE` with `DEFAULT_TOP_P`. Its ``repetition_penalty``
                is taken either way.
            overrides: `SamplingParams` fields; a value of None means "the default" (as OpenAI
                treats a null), any other value replaces the config's.
        Raises:
            TypeError: an override that is not a field. ValueError: a value out of range.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"SamplingParams.from_generation_config: unknown fields {unknown}; expected some of "
                            f"{sorted(names)}")
        config = config or {}
        values: dict = {"temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P}
        if any(config.get(k) is not None for k in ("do_sample", "temperature", "top_k", "top_p", "min_p")):
            temperature = config.get("temperature")
            values = {"temperature": 0.0 if config.get("do_sample") is False else
                      (1.0 if temperature is None else float(temperature)),
                      "top_k": config.get("top_k") or None,
                      "top_p": None if config.get("top_p") in (None, 1, 1.0) else config.get("top_p"),
                      "min_p": config.get("min_p") or None}
        if config.get("repetition_penalty") is not None:
            values["repetition_penalty"] = config["repetition_penalty"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def describe(self) -> dict:
        """The sampling fields as a JSON-ready dict (for a server to say what its defaults are)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty}


class LogitsProcessor(Protocol):
    """A per-sequence change of the logits (e.g. a grammar constraint); one instance per sequence."""

    def __call__(self, logits: mx.array) -> mx.array:
        """``[V]`` float32 logits -> ``[V]`` (may set forbidden tokens to ``-inf``)."""

    def accept(self, token: int) -> None:
        """The token the sequence took (called once per step, after evaluation)."""


@dataclass
class TokenChoice:
    """One step's result for one sequence.

    Attributes:
        token: the chosen token id.
        logprob: its log-probability under the processed logits (None unless ``logprobs``).
        top_logprobs: the ``top_logprobs`` most likely ``(token id, log-probability)``, most likely
            first (None unless ``logprobs``; ``-inf`` for tokens that cannot be chosen at all).
    """

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Proposal:
    """The lazy result of one step for ``N`` rows computed together (nothing evaluated yet).

    Attributes:
        tokens: ``[N]`` int32.
        logprobs: ``[N]`` float32, when asked for.
        top_ids, top_logprobs: ``[N, k]`` int32 / float32, when asked for.
    """

    tokens: mx.array
    logprobs: mx.array | None = None
    top_ids: mx.array | None = None
    top_logprobs: mx.array | None = None

    def arrays(self) -> list:
        """The arrays to evaluate."""
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs) if a is not None]

    def choices(self) -> list[TokenChoice]:
        """One `TokenChoice` per row, once `arrays` are evaluated (one ``mx.eval`` for them all;
        an array not evaluated yet is evaluated on its own here)."""
        tokens = self.tokens.tolist()
        if self.logprobs is None:
            return [TokenChoice(t) for t in tokens]
        lps = self.logprobs.tolist()
        tops = ([list(zip(i, v)) for i, v in zip(self.top_ids.tolist(), self.top_logprobs.tolist())]
                if self.top_ids is not None else [[] for _ in tokens])
        return [TokenChoice(t, lp, top) for t, lp, top in zip(tokens, lps, tops)]


def truncate(x: mx.array, top_k: int | None = None, top_p: float | None = None,
             min_p: float | None = None) -> mx.array:
    """Temperature-scaled logits ``[..., V]`` with ``-inf`` outside what top-k, then top-p, then
    min-p keep (transformers' ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``; at
    least the most likely token always stays)."""
    vocab = x.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = mx.min(mx.topk(x, top_k, axis=-1), axis=-1, keepdims=True)
        x = mx.where(x < kth, -mx.inf, x)
    if top_p is not None and 0.0 < top_p < 1.0:
        ordered = -mx.sort(-x, axis=-1)  # most likely first
        probs = mx.softmax(ordered, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        kept = mx.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: the first has nothing before it
        x = mx.where(x < mx.take_along_axis(ordered, kept - 1, axis=-1), -mx.inf, x)
    if min_p is not None and min_p > 0.0:
        # p < min_p * p_max  <=>  logit < max logit + log(min_p) (the normalisation cancels)
        x = mx.where(x < mx.max(x, axis=-1, keepdims=True) + math.log(min_p), -mx.inf, x)
    return x


def _choose(x: mx.array, params: SamplingParams, key) -> mx.array:
    """Tokens ``[N]`` int32 from processed float32 logits ``[N, V]``."""
    if params.greedy:
        return mx.argmax(x, axis=-1).astype(mx.int32)
    scaled = truncate(x / params.temperature, params.top_k, params.top_p, params.min_p)
    return mx.random.categorical(scaled, axis=-1, key=key).astype(mx.int32)


def _propose(x: mx.array, params: SamplingParams, key) -> Proposal:
    """The `Proposal` of processed float32 logits ``[N, V]``."""
    tokens = _choose(x, params, key)
    if not params.logprobs:
        return Proposal(tokens)
    logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    k = min(params.top_logprobs, x.shape[-1])
    if not k:
        return Proposal(tokens, chosen)
    top = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logp, top, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return Proposal(tokens, chosen, mx.take_along_axis(top, order, axis=-1).astype(mx.int32),
                    mx.take_along_axis(values, order, axis=-1))


class Sampler:
    """One sequence's sampling state: its parameters, its random key, the counts of its tokens (for
    the penalties) and its processors.

    Args:
        params: the `SamplingParams`.
        prompt: the prompt's token ids (the repetition penalty covers them).
        processors: `LogitsProcessor` s of this sequence, applied in order before anything else.

    Each step: `propose` (lazy), evaluate, then `accept` the token taken (`sample_batch` does all
    three for a batch).
    """

    def __init__(self, params: SamplingParams, prompt: Sequence[int] = (), processors: Sequence = ()):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Sampler: params must be a SamplingParams, got {type(params).__name__}")
        self.params = params
        self.processors = tuple(processors)
        self.prompt = [int(t) for t in prompt] if params.repetition_penalty != 1.0 else []
        self._key = mx.random.key(params.seed) if params.seed is not None and not params.greedy else None
        self._vocab: int | None = None
        self._counts = None  # [V] float32, lazy: how often each token was generated (penalties only)
        self._early: list = []  # tokens accepted before the vocabulary size was known
        self._prompt_seen = None  # [V] bool (repetition penalty only)
        self._bias = None  # [V] float32

    @property
    def plain(self) -> bool:
        """No processors, bias or penalties: the processed logits are the logits."""
        return not (self.processors or self.params.logit_bias or self.params.penalized)

    def shared_key(self):
        """Rows with equal keys may be computed together (None: this row goes alone)."""
        p = self.params
        if not self.plain or (not p.greedy and p.seed is not None):
            return None
        choosing = (0.0,) if p.greedy else (p.temperature, p.top_k, p.top_p, p.min_p)
        return choosing + (p.logprobs, p.top_logprobs)

    def _prepare(self, vocab: int):
        if self._vocab == vocab:
            return
        if self._vocab is not None:
            raise ValueError(f"Sampler: the logits had {self._vocab} entries, now {vocab}")
        self._vocab = vocab
        p = self.params
        if p.logit_bias:
            bad = [t for t in p.logit_bias if t >= vocab]
            if bad:
                raise ValueError(f"logit_bias: token ids must be below the vocabulary size {vocab}, got {bad}")
            bias = np.zeros(vocab, np.float32)
            bias[list(p.logit_bias)] = list(p.logit_bias.values())
            self._bias = mx.array(bias)
        if p.penalized:
            self._counts = mx.zeros((vocab,), mx.float32)
            for token in self._early:
                self._counts = self._counts.at[token].add(1.0)
            self._early = []
        if p.repetition_penalty != 1.0:
            seen = np.zeros(vocab, bool)
            ids = np.asarray(self.prompt, np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise ValueError(f"Sampler: prompt token ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
            seen[ids] = True
            self._prompt_seen = mx.array(seen)

    def process(self, logits: mx.array) -> mx.array:
        """The processed logits: ``[V]`` (any float dtype) -> ``[V]`` float32 (lazy)."""
        if logits.ndim != 1:
            raise ValueError(f"Sampler: logits must be [vocab], got shape {tuple(logits.shape)}")
        self._prepare(logits.shape[0])
        x = logits.astype(mx.float32)
        for processor in self.processors:
            x = processor(x)
        if self._bias is not None:
            x = x + self._bias
        p = self.params
        if p.repetition_penalty != 1.0:
            seen = self._prompt_seen | (self._counts > 0)
            r = p.repetition_penalty
            x = mx.where(seen, mx.where(x < 0, x * r, x / r), x)
        if p.presence_penalty or p.frequency_penalty:
            x = x - self._counts * p.frequency_penalty - (self._counts > 0).astype(mx.float32) * p.presence_penalty
        return x

    def propose(self, logits: mx.array) -> Proposal:
        """This step's lazy `Proposal` (one row) from logits ``[V]``; splits the key of a seeded
        sampling sequence."""
        x = self.process(logits)
        key = None
        if self._key is not None:
            self._key, key = mx.random.split(self._key)
        return _propose(x[None], self.params, key)

    def accept(self, token) -> None:
        """Record the token this sequence took: an ``int``, or a lazy 0-d array (the counts stay
        lazy, so a decoder may queue its next step before the token is known; processors get the
        ``int``, which evaluates it)."""
        if self._counts is not None:
            self._counts = self._counts.at[token].add(1.0)
        elif self.params.penalized:
            self._early.append(token)
        if self.processors:
            token = int(token.item() if isinstance(token, mx.array) else token)
            for processor in self.processors:
                processor.accept(token)


class BatchProposal:
    """The lazy result of one step of a batch (`propose_batch`): ``tokens`` ``[B]`` int32, and the
    per-row `TokenChoice` s after evaluation (`choices`)."""

    def __init__(self, parts: list[tuple[list[int], Proposal]], rows: int):
        self.parts, self.rows = parts, rows
        if len(parts) == 1:
            self.tokens = parts[0][1].tokens
        else:
            order = [i for idx, _ in parts for i in idx]
            tokens = mx.concatenate([p.tokens for _, p in parts])
            if order != list(range(rows)):
                tokens = tokens[mx.array(np.argsort(order))]
            self.tokens = tokens
        self._arrays = [self.tokens] + [a for _, p in parts for a in p.arrays() if a is not self.tokens]

    def arrays(self) -> list:
        """The arrays to evaluate (the same list every call)."""
        return self._arrays

    def choices(self) -> list[TokenChoice]:
        """One `TokenChoice` per row, once `arrays` are evaluated."""
        out: list = [None] * self.rows
        for idx, proposal in self.parts:
            for i, choice in zip(idx, proposal.choices()):
                out[i] = choice
        return out


def propose_batch(samplers: Sequence[Sampler], logits: mx.array) -> BatchProposal:
    """Every row's lazy result for logits ``[B, V]`` (row ``i`` belongs to ``samplers[i]``); rows with
    equal `Sampler.shared_key` are computed as one ``[G, V]`` operation."""
    if logits.ndim != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"propose_batch: logits must be [B, vocab] with B = {len(samplers)} samplers, got shape "
                         f"{tuple(logits.shape)}")
    rows = logits.shape[0]
    parts, groups = [], {}
    for i, sampler in enumerate(samplers):
        key = sampler.shared_key()
        if key is None:
            parts.append(([i], sampler.propose(logits[i])))
        else:
            groups.setdefault(key, []).append(i)
    for idx in groups.values():
        if len(idx) == 1:
            parts.append((idx, samplers[idx[0]].propose(logits[idx[0]])))
            continue
        x = logits if len(idx) == rows else mx.take(logits, mx.array(idx), axis=0)
        parts.append((idx, _propose(x.astype(mx.float32), samplers[idx[0]].params, None)))
    return BatchProposal(parts, rows)


def sample_batch(samplers: Sequence[Sampler], logits: mx.array) -> list[TokenChoice]:
    """One step of a batch: logits ``[B, V]`` -> one `TokenChoice` per row. Builds every row's
    result, evaluates them with one ``mx.eval``, then `Sampler.accept` s each row's token."""
    batch = propose_batch(samplers, logits)
    mx.eval(batch.arrays())
    choices = batch.choices()
    for sampler, choice in zip(samplers, choices):
        sampler.accept(choice.token)
    return choices


def sample_logits(logits, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                  key=None):
    """Pick the next token from ``logits`` ``[B, vocab]`` -> ``[B]`` int32, statelessly.

    ``temperature == 0`` is greedy (arg-max). Otherwise the logits are divided by ``temperature``,
    restricted to the ``top_k`` largest and to the smallest set whose probability reaches ``top_p``
    (nucleus), then sampled with ``key`` (or MLX's global random state). For penalties, bias,
    log-probabilities and per-sequence keys use `Sampler`.
    """
    if temperature is None or temperature <= 0:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    x = truncate(logits.astype(mx.float32) / float(temperature), top_k, top_p)
    return mx.random.categorical(x, axis=-1, key=key).astype(mx.int32)
