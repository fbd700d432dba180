"""Fine-tuning rows: chat conversations and prompt / completion pairs, tokenized with a loss mask.

``data.format: chat``: each row holds ``messages``, a list of ``{role, content}``; the conversation is
rendered with the tokenizer's own chat template (``apply_chat_template``) and the loss is taken on the
assistant turns only. ``data.format: prompt_completion``: each row holds ``prompt`` and ``completion``
strings; the tokens are the prompt's, the completion's and eos, the loss on the completion and eos.

The mask is stored beside the tokens (a second indexed dataset, ``mask.bin`` / ``mask.idx``: one uint8 per
token, the same documents) so the rows carry it whatever their packing, and labels are -100 where it is 0.

Which tokens are an assistant turn's is found by rendering the conversation's prefixes: the turn spans
from the end of the conversation before it rendered with the generation prompt (the assistant header)
to the end of the conversation through it (its content and the template's end-of-turn marker, which the
model must learn to emit). Written by hand because transformers' ``return_assistant_tokens_mask`` needs
``{% generation %}`` markers that most published templates (Llama 3, Qwen, Mistral) do not carry; a
template whose prefixes are not prefixes of the whole rendering is refused naming the row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tessera.errors import DataError

ROLES = ("system", "user", "assistant", "tool", "developer")
#: the row kinds a source can hold, and the fields each reads
KINDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion")}


def _fail(where: str, why: str, fix: str) -> DataError:
    return DataError(f"{where}: {why}", field="data.format", value=where.rsplit(":", 1)[0], fix=fix)


def check_messages(value: Any, where: Callable[[], str], *, no_assistant: str) -> list[dict[str, str]] | None:
    """A ``messages`` value checked: a non-empty list of ``{role, content}`` with known roles and string
    contents. Without an assistant turn: None (``no_assistant: skip``) or an error."""
    if not isinstance(value, list) or not value:
        raise _fail(
            where(), "'messages' is not a non-empty list of {role, content}", "fix or remove that row"
        )
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise _fail(where(), f"message {i} has no string 'content'", "fix or remove that row")
        if m.get("role") not in ROLES:
            raise _fail(
                where(),
                f"message {i} has the role {m.get('role')!r}, not one of {', '.join(ROLES)}",
                "fix that row's role",
            )
    if not any(m["role"] == "assistant" for m in value):
        if no_assistant == "skip":
            return None
        raise _fail(
            where(),
            "a conversation without an assistant turn (nothing to train on)",
            "remove it, or set data.chat.no_assistant=skip (--no-assistant skip) to skip such rows with a count",
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def check_pair(value: tuple[Any, Any], where: Callable[[], str]) -> tuple[str, str] | None:
    prompt, completion = value
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise _fail(where(), "'prompt' and 'completion' must both be strings", "fix or remove that row")
    if not completion:
        raise _fail(where(), "an empty completion (nothing to train on)", "fix or remove that row")
    return prompt, completion


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], np.ndarray]:
    """(token ids, mask) of a conversation: the template's rendering, 1 on each assistant turn's tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the tokenizer has no chat template",
            field="data.tokenizer",
            value=str(getattr(tokenizer, "name_or_path", "")),
            fix="use a tokenizer directory whose tokenizer_config.json (or chat_template.jinja) has a chat_template, "
            "or data.format=prompt_completion",
        )
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = (
            tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
            if k
            else ""
        )
        end = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
        if not (full.startswith(start) and full.startswith(end) and len(start) <= len(end)):
            raise ValueError("the chat template does not render a conversation's prefixes as its prefixes")
        spans.append((len(start), len(end)))
    enc = tokenizer.backend_tokenizer.encode(full, add_special_tokens=False)
    starts = np.array([a for a, _ in enc.offsets], dtype=np.int64)
    mask = np.zeros(len(enc.ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return list(enc.ids), mask
