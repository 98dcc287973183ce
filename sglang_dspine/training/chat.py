"""Conversations as token ids: role normalisation, the chat template, and which tokens carry the loss.

A conversation is a list of messages with `role`/`content` (OpenAI style) or `from`/`value` (ShareGPT style,
as SpecForge's `conversations` files). It is rendered with a chat template: the tokenizer's own, or one
named by `--chat-template` (a Jinja file, a name the tokenizer carries, or a built-in: `chatml`, or `plain`
for the messages' text joined by blank lines, for base models). A tokenizer without a template is an error
naming that flag, never a silent plain-text rendering.

The loss covers what the assistant writes in each of its turns: everything after the template's assistant
opener (e.g. `<|im_start|>assistant\\n`) up to and including its end-of-turn marker (e.g. `<|im_end|>`). Both are
found by rendering two small probe conversations with the same template, so any template that renders
assistant turns between a fixed opener and closer works; one that does not (`plain`) is refused for
training with a clear error.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .jsonl import DataError

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "model": "assistant", "bot": "assistant", "system": "system"}

# Built-in templates (written here, not taken from any model): ChatML's usual layout, and plain text.
BUILTIN_TEMPLATES = {
    "chatml": ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "plain": "{% for m in messages %}{% if not loop.first %}{{ '\n\n' }}{% endif %}{{ m['content'] }}{% endfor %}",
}


def normalise_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """[{role, content}] from role/content or from/value messages; ShareGPT's role names mapped."""
    if not isinstance(messages, (list, tuple)):
        raise DataError(f"{where}: expected a list of messages, found {type(messages).__name__}")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise DataError(f"{where}: a message must be an object, found {type(m).__name__}")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role is None or content is None:
            raise DataError(f"{where}: a message needs `role`/`content` (or `from`/`value`), found keys {sorted(m)}")
        role = ROLE_ALIASES.get(str(role).lower(), str(role))
        out.append({"role": role, "content": str(content)})
    return out


def record_messages(record: dict[str, Any], where: str) -> list[dict[str, str]] | None:
    """The conversation of a record (`conversations` or `messages`), or None when it has neither."""
    raw = record.get("conversations")
    if raw is None:
        raw = record.get("messages")
    return None if raw is None else normalise_messages(raw, where)


# --------------------------------------------------------------------------------------------- template
def resolve_template(tokenizer, name: str | None, where: str = "--chat-template") -> str:
    """The Jinja text of the chat template to use: `name` as a file, a template the tokenizer names, or a
    built-in; without a name, the tokenizer's own (an error when it has none)."""
    own = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if name is None:
        if isinstance(own, dict):
            own = own.get("default")
        if not own:
            raise DataError(f"the tokenizer has no chat template; give {where} (a Jinja file, or one of "
                            f"{sorted(BUILTIN_TEMPLATES)}; `plain` joins the messages' text for a base model)")
        return own
    if os.path.isfile(name):
        with open(name, encoding="utf-8") as f:
            return f.read()
    if isinstance(own, dict) and name in own:
        return own[name]
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    named = sorted(own) if isinstance(own, dict) else []
    raise DataError(f"{where} {name}: not a file, and not a template name (built-in: {sorted(BUILTIN_TEMPLATES)}"
                    f"{'; the tokenizer has ' + str(named) if named else ''})")


@dataclass
class ChatFormat:
    """How conversations become token ids: the template text and its options."""

    template: str
    enable_thinking: bool | None = None  # passed to templates that read it (Qwen3's); None: their default
    last_turn_only: bool = False  # loss on the last assistant turn only (default: every assistant turn)

    def render(self, tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        kwargs = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        try:
            return tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # a template's own raise_exception (e.g. "no user query"), Jinja errors
            raise DataError(f"chat template: cannot render this conversation ({type(e).__name__}: {e})") from None


_A1, _A2, _U1, _U2 = "zqxAonezqx", "zqxAtwozqx", "zqxUonezqx", "zqxUtwozqx"


@dataclass
class TurnMarkers:
    opener: str  # text the template puts before every assistant turn's content
    closer: str  # the end-of-turn marker after it (stripped of whitespace)


def turn_markers(tokenizer, fmt: ChatFormat) -> TurnMarkers:
    """The assistant opener and closer of a template, from two probe conversations: the opener is what
    precedes an assistant's text both as the last turn and as an earlier one (Qwen3's template, for one,
    renders a think block only in the last), the closer what follows the last turn's text."""
    u = [{"role": "user", "content": _U1}]
    one = u + [{"role": "assistant", "content": _A1}]
    two = one + [{"role": "user", "content": _U2}, {"role": "assistant", "content": _A2}]
    n, t1, t2 = (fmt.render(tokenizer, m, False) for m in (u, one, two))
    i1, i2 = t1.find(_A1), t2.find(_A1)
    if not (t1.startswith(n) and t2.startswith(n)) or i1 < 0 or i2 < 0:
        raise DataError("chat template: cannot find where assistant turns start (a probe conversation's rendering "
                        "does not extend its prefix); give --chat-template")
    last, earlier = t1[len(n):i1], t2[len(n):i2]
    k = 0
    while k < min(len(last), len(earlier)) and last[k] == earlier[k]:
        k += 1
    opener = last[:k]
    closer = t1[i1 + len(_A1):].strip()
    if not opener.strip() or not closer:
        raise DataError("chat template: it marks no start or no end of an assistant turn, so assistant turns "
                        "cannot be told from the others; give --chat-template")
    return TurnMarkers(opener, closer)


def assistant_spans(text: str, count: int, markers: TurnMarkers) -> list[tuple[int, int]]:
    """Character spans of the first `count` assistant turns in a rendered conversation: after each opener,
    through its closer."""
    spans, cursor = [], 0
    for _ in range(count):
        o = text.find(markers.opener, cursor)
        if o < 0:
            raise DataError(f"chat template: found {len(spans)} assistant turns in the rendered conversation, "
                            f"expected {count}")
        start = o + len(markers.opener)
        c = text.find(markers.closer, start)
        end = c + len(markers.closer) if c >= 0 else len(text)  # a turn cut off at the end of the text
        spans.append((start, end))
        cursor = end
    return spans


def tokenize_conversation(messages: Sequence[dict[str, str]], tokenizer, fmt: ChatFormat,
                          markers: TurnMarkers | None = None, where: str = "record") -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a whole conversation; loss 1 on the assistant turns' tokens (the last one
    only with fmt.last_turn_only)."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}: training on conversations needs a fast tokenizer (character offsets)")
    messages = list(messages)
    n_assist = sum(m["role"] == "assistant" for m in messages)
    if n_assist == 0:
        raise DataError(f"{where}: the conversation has no assistant turn to learn from")
    try:
        text = fmt.render(tokenizer, messages, False)
        markers = markers or turn_markers(tokenizer, fmt)
        spans = assistant_spans(text, n_assist, markers)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    if fmt.last_turn_only:
        spans = spans[-1:]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    j = 0
    for i, (s, _e) in enumerate(enc["offset_mapping"]):
        while j < len(spans) and s >= spans[j][1]:
            j += 1
        if j < len(spans) and spans[j][0] <= s < spans[j][1]:
            mask[i] = 1
    return ids, mask
