"""Render chat ``messages`` with a model's Jinja chat template (HuggingFace conventions).

Rendered in a sandbox: templates come from model directories, which are data, not code.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvfleet.errors import InvalidArgument


def _raise(message: str):
    raise InvalidArgument(f"messages: {message}", field="messages")


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja source (from ``chat_template.jinja`` or ``tokenizer_config.json``).
        special: ``bos_token`` / ``eos_token`` strings the template may reference.
    """

    def __init__(self, source: str, special: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        self._template = env.from_string(source)
        self._special = dict(special or {})

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (list of ``{"role", "content"}``).

        Raises:
            InvalidArgument: the template rejects the conversation (e.g. role order).
        """
        try:
            return self._template.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         **self._special)
        except InvalidArgument:
            raise
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"messages: chat template failed: {exc}",
                                  field="messages") from exc
