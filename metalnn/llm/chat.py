"""A multi-turn conversation with a model through its chat template: `ChatSession`.

>>> session = ChatSession(model, tokenizer, system="You are terse.", max_tokens=256)
>>> for piece in session.ask("What is the capital of France?"):
...     print(piece, end="", flush=True)
>>> session.history       # system, user and assistant messages; the next ask() continues it
>>> session.reset()       # back to the system message only

Every turn renders the whole history with the chat template, so the model sees the conversation
as it was trained to. An answer that is stopped early (`TextStream.close` / ``cancel``) enters the
history as far as it got.
"""

from __future__ import annotations

from .text_generation import TextStream


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
        self.reset()

    def reset(self):
        """Forget the conversation (the system message stays)."""
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str, **options) -> TextStream:
        """Add the user message ``text`` and return the stream of the assistant's answer, which
        joins the history when the stream ends. ``options`` override the session's for this turn."""
        message = {"role": "user", "content": text}
        prompt = self.tokenizer.apply_chat_template(self.history + [message], add_generation_prompt=True)
        self.history.append(message)
        settings = {**self.options, **options}
        return TextStream(self.model, self.tokenizer, prompt, settings.pop("max_tokens"), on_finish=self._answered,
                          **settings)

    def _answered(self, stream):
        self.history.append({"role": "assistant", "content": stream.text})
