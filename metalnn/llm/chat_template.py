"""Chat templates: Jinja templates that turn a list of messages into a model's prompt text.

Rendered as Hugging Face transformers renders them: a sandboxed Jinja environment (templates
come from model files, i.e. untrusted) with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML, and the globals
``raise_exception(message)`` and ``strftime_now(format)``. The template sees ``messages``,
``tools``, ``documents``, ``add_generation_prompt`` and the special tokens (``bos_token``,
``eos_token``, ...), plus any extra keyword given.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache


class ChatTemplateError(ValueError):
    """A chat template failed to compile or raised (``raise_exception``) while rendering."""


def _plain(value):
    """A copy made only of JSON types (templates must not reach into arbitrary Python objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def compile_template(source: str):
    """The compiled Jinja template for ``source`` (cached)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e} (line {e.lineno})") from None


def render(template: str, messages, *, add_generation_prompt: bool = True, tools=None, documents=None,
           **variables) -> str:
    """Render ``template`` for ``messages`` (``[{"role": ..., "content": ...}, ...]``).

    Args:
        template: the Jinja source (``tokenizer_config.json``'s ``chat_template`` or a GGUF's
            ``tokenizer.chat_template``).
        messages: the conversation.
        add_generation_prompt: end with the header of an assistant turn.
        tools, documents: passed to templates that support them.
        variables: more template variables (``bos_token``, ``eos_token``, ...).
    Raises:
        ChatTemplateError: the template does not compile or calls ``raise_exception``.
    """
    import jinja2

    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"chat template: message {i} must be a dict with 'role' and 'content', got {m!r}")
    try:
        return compile_template(template).render(messages=_plain(list(messages)), tools=_plain(tools),
                                                 documents=_plain(documents),
                                                 add_generation_prompt=bool(add_generation_prompt),
                                                 **_plain(variables))
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from None
