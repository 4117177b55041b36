"""A multi-turn conversation with a model through its chat template: `ChatSession`.

>>> session = ChatSession(model, tokenizer, system="You are terse.", max_tokens=256)
>>> for piece in session.ask("What is the capital of France?"):
...     print(piece, end="", flush=True)
>>> session.history       # system, user and assistant messages; the next ask() continues it
>>> session.reset()       # back to the system message only

Every turn renders the whole history with the chat template, so the model sees the conversation
as it was trained to. An answer that is stopped early (`TextStream.close` / ``cancel``) enters the
history as far as it got.

The conversation stays within the model's context length: when the prompt and ``max_tokens`` would
run past it, the oldest turns (a user message and the answer to it) are dropped first (the system
message stays; ``session.dropped`` tells how many messages the last `ChatSession.ask` dropped); if
the prompt still leaves less room than ``max_tokens``, that answer gets what room there is; a
message that leaves no room at all raises `ContextFull` (and the history stays as it was).
"""

from __future__ import annotations

from .text_generation import TextStream


class ContextFull(ValueError):
    """The new message with the system message (the oldest turns already dropped) fills the model's
    context length: no room is left for an answer.

    Attributes:
        prompt_tokens: the prompt's length with nothing left to drop.
        context_length: the model's context length.
    """

    def __init__(self, prompt_tokens: int, context_length: int):
        self.prompt_tokens, self.context_length = prompt_tokens, context_length
        super().__init__(f"the message is too long: with the system message and the chat template it takes "
                         f"{prompt_tokens} tokens, and the model's context length is {context_length} tokens")


class ChatSession:
    """The history of one conversation and the options its answers are generated with.

    Args:
        model: a `metalnn.llm.models.CausalLM`.
        tokenizer: its `metalnn.llm.tokenizer.Tokenizer`, with a chat template.
        system: an optional system message that starts the conversation (and survives `reset`).
        options: `TextStream` keywords for every answer (``max_tokens`` default 512, ``sampling``
            or ``temperature``, ``top_k``, ``top_p``, ``seed``; ``stop``).
    Raises:
        ValueError: the tokenizer has no chat template.
    """

    def __init__(self, model, tokenizer, *, system: str | None = None, **options):
        if not tokenizer.chat_template:
            raise ValueError("the model's tokenizer has no chat template, so it cannot chat (use plain "
                             "generation instead)")
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.options = {"max_tokens": 512, **options}
        self.history: list[dict] = []
        self.dropped = 0  # messages the last ask() dropped to fit the context
        self.reset()

    def reset(self):
        """Forget the conversation (the system message stays)."""
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str, **options) -> TextStream:
        """Add the user message ``text`` and return the stream of the assistant's answer, which
        joins the history when the stream ends. ``options`` override the session's for this turn.

        Within the model's context length (see the module's notes): older turns may be dropped
        (``self.dropped``), the answer's ``max_tokens`` lowered to the room left (the stream's
        ``max_tokens``). Raises `ContextFull` when the message leaves no room.
        """
        message = {"role": "user", "content": text}
        settings = {**self.options, **options}
        kept, prompt, max_tokens = self._fit(message, int(settings.pop("max_tokens")))
        self.dropped = len(self.history) - len(kept)
        self.history = kept + [message]
        return TextStream(self.model, self.tokenizer, prompt, max_tokens, on_finish=self._answered, **settings)

    def _fit(self, message: dict, max_tokens: int):
        """``(history kept, prompt ids, max_tokens)``: the oldest turns dropped until the prompt and
        ``max_tokens`` fit the context (or only the system messages are left)."""
        kept = list(self.history)
        render = lambda: self.tokenizer.apply_chat_template(kept + [message], add_generation_prompt=True)  # noqa: E731
        prompt = render()
        context = getattr(self.model, "context_length", None)  # None: a model that states none
        if context is None:
            return kept, prompt, max_tokens
        while len(prompt) + max_tokens > context:
            first = next((i for i, m in enumerate(kept) if m["role"] != "system"), None)
            if first is None:
                break
            end = next((i for i in range(first + 1, len(kept)) if kept[i]["role"] == "user"), len(kept))
            del kept[first:end]  # a user message and the answer to it
            prompt = render()
        room = context - len(prompt)
        if room < 1:
            raise ContextFull(len(prompt), context)
        return kept, prompt, min(max_tokens, room)

    def _answered(self, stream):
        self.history.append({"role": "assistant", "content": stream.text})
