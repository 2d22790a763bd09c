"""``POST /tokenize`` and ``/detokenize`` (vLLM's shapes) for every served model, with the model's
own tokenizer file and, for a chat, its own chat template.

A prompt is tokenized as the tokenizer file says (``add_special_tokens``, default true: the
embedding model's ``[CLS] ... [SEP]``); messages are rendered with the generation model's
``chat_template.jinja`` (Jinja2 in a sandbox, as transformers renders it:
``tests/unit/test_openai_gateway_tokenize.py`` checks the two agree) and tokenized without added
special tokens, which is what the engine does with a chat (``add_special_tokens`` default false).
The answer's ``count`` is what the model would see before truncation and ``max_model_len`` the
model's context, so a client can check a text fits before it sends it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai_gateway.completions import plain_message
from openai_gateway.embeddings import utf8
from openai_gateway.errors import bad_request, too_large

MAX_DETOKENIZE_IDS = 65536


@dataclass
class ModelTokenizer:
    """One model's tokenizer, its context length and (generation) its chat template."""

    tokenizer: Any  # tokenizers.Tokenizer, without truncation or padding
    max_model_len: int
    template: Any = None  # a compiled Jinja2 template, for models that chat
    special: dict[str, str] | None = None  # bos_token, eos_token for the template

    @classmethod
    def load(cls, tokenizer_file: Path, max_model_len: int, template_file: Path | None = None) -> ModelTokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_file))
        tok.no_truncation()
        tok.no_padding()
        template = special = None
        if template_file is not None and template_file.is_file():
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            template = env.from_string(template_file.read_text(encoding="utf-8"))
            config_file = template_file.parent / "tokenizer_config.json"
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
            special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        return cls(tok, max_model_len, template, special)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The chat as the model's template writes it."""
        from jinja2 import TemplateError

        if self.template is None:
            raise bad_request("this model has no chat template: send prompt, not messages", param="messages")
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **(self.special or {}))
        except (ValueError, TemplateError) as exc:  # the template's own raise_exception, or its errors on these messages
            raise bad_request(f"the chat template refused the messages: {exc}", param="messages") from None

    def tokenize(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[str]]:
        encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(encoding.ids), list(encoding.tokens)

    def detokenize(self, ids: list[int]) -> str:
        vocab = self.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise bad_request(f"tokens[{i}] is {t}, outside the vocabulary [0, {vocab})", param=f"tokens[{i}]")
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _token_text(value: Any) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken's ``content``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def tokenize_body(tok: ModelTokenizer, req: Any, max_chars: int, max_messages: int) -> dict[str, Any]:
    """The answer of one checked ``/tokenize`` request (``req``: a TokenizeRequest)."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        if len(req.prompt) > max_chars:
            raise too_large(
                f"prompt has {len(req.prompt)} characters; the limit is {max_chars} (--max-prompt-chars)", param="prompt"
            )
        utf8(req.prompt, "prompt")
        text = req.prompt
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
    else:
        if len(req.messages) > max_messages:
            raise too_large(f"messages has {len(req.messages)} items; the limit is {max_messages}", param="messages")
        messages = [plain_message(m, i) for i, m in enumerate(req.messages)]
        text = tok.render(messages, req.add_generation_prompt)
        if len(text) > max_chars:
            raise too_large(f"the messages render to {len(text)} characters; the limit is {max_chars}", param="messages")
        add_special = bool(req.add_special_tokens)
    ids, strs = tok.tokenize(text, add_special)
    return {
        "count": len(ids),
        "max_model_len": tok.max_model_len,
        "tokens": ids,
        "token_strs": strs if req.return_token_strs else None,
    }


def detokenize_body(tok: ModelTokenizer, req: Any) -> dict[str, Any]:
    """The answer of one ``/detokenize`` request (``req``: a DetokenizeRequest)."""
    if len(req.tokens) > MAX_DETOKENIZE_IDS:
        raise too_large(f"tokens has {len(req.tokens)} ids; the limit is {MAX_DETOKENIZE_IDS}", param="tokens")
    return {"prompt": tok.detokenize(list(req.tokens))}
