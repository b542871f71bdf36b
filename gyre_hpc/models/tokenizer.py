"""A model directory's tokenizer and chat template, loaded without any hub access.

Reads ``tokenizer.json`` (the ``tokenizers`` format every supported family ships) and the chat
template from ``chat_template.jinja`` or ``tokenizer_config.json``, and renders the template in a
sandboxed Jinja environment, the way Hugging Face does.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _token(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or ``{"content": …}``."""
    return value["content"] if isinstance(value, dict) else value


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class ChatTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = model_dir / "chat_template.jinja"
        template = template_path.read_text() if template_path.exists() else config.get("chat_template")
        if not template:
            raise ValueError(f"{model_dir}: no chat template (chat_template.jinja or tokenizer_config.json)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False, **kw)
        self.template = env.from_string(template)
        self.eos_token = _token(config.get("eos_token")) or "<|im_end|>"
        self.bos_token = _token(config.get("bos_token")) or ""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it are recognised, none are added."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            raise KeyError(token)
        return tid

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        # What Hugging Face hands every template (Llama 3's use bos_token, raise_exception and
        # strftime_now): any family's own template renders as transformers would render it.
        return self.template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            raise_exception=_raise,
            strftime_now=lambda fmt: time.strftime(fmt),
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's length in characters: a text of n characters is at least
        n / max_token_chars tokens, known without tokenising it."""
        return max(len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True))
