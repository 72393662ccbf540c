"""Chat templates: a tokenizer folder's Jinja template, rendered as transformers'
`apply_chat_template` renders it, and the assistant spans a fine-tuning loss covers.

The template comes from the folder transformers saves it in: `chat_template.jinja`
(transformers 5) or `tokenizer_config.json`'s `chat_template` (4.x; a string, or a list of
named templates of which 'default' is taken). It renders in the sandboxed Jinja environment
transformers uses (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `tojson`,
`strftime_now`) with the folder's special tokens (`bos_token`, `eos_token`, ...) as variables,
and the text is tokenized without adding special tokens: the template writes them.

`assistant_spans` finds the tokens an SFT loss bears on without parsing the template: for
assistant turn i, from the end of the conversation rendered up to turn i with the generation
prompt (the role header is the prompt's) to the end of the conversation rendered through turn
i: the assistant's content and its end-of-turn token.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib
from collections.abc import Callable, Sequence

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                      "cls_token", "mask_token")


class ChatError(ValueError):
    """A conversation or template that cannot be rendered; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    source: str      # the Jinja template text
    where: str       # the file it came from, for messages
    special: tuple[tuple[str, str], ...] = ()  # (name, token text): bos_token, eos_token, ...

    @classmethod
    def from_folder(cls, folder) -> ChatTemplate | None:
        """The folder's chat template (a tokenizer folder, an HF model folder, or a run's
        hf_tokenizer/), or None when it has none."""
        folder = pathlib.Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = tuple((k, _token_text(config[k])) for k in SPECIAL_TOKEN_KEYS
                        if _token_text(config.get(k)) is not None)
        if (folder / "chat_template.jinja").is_file():
            return cls((folder / "chat_template.jinja").read_text(),
                       str(folder / "chat_template.jinja"), special)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers takes 'default'
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template:
            return None
        return cls(template, str(config_path), special)

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text, special tokens written out."""
        check_messages(messages)
        try:
            return _compile(self.source).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                tools=None, documents=None, **dict(self.special))
        except Exception as e:  # jinja2's TemplateError and the template's raise_exception
            raise ChatError(f"the chat template of {self.where} cannot render this "
                            f"conversation: {type(e).__name__}: {e}") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def check_messages(messages: Sequence[dict]) -> None:
    """A list of {'role', 'content'} with known roles and string contents, or ChatError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError(f"a conversation is a non-empty list of messages, got "
                        f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES \
                or not isinstance(m.get("content"), str):
            raise ChatError(f"message {i} must be {{'role': one of {list(ROLES)}, 'content': "
                            f"a string}}, got {str(m)[:200]}")


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}, which transformers' templates may mark
        the assistant's text with: rendered as its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def assistant_spans(template: ChatTemplate, messages: Sequence[dict],
                    encode: Callable[[str], list[int]]) -> tuple[list[int], list[bool]]:
    """(token ids of the whole conversation, per token: does the loss bear on it). The loss
    covers each assistant turn's tokens after its role header, through its end-of-turn token.
    ChatError when the template's renderings are not prefixes of each other (the spans could
    not be found by position) or no assistant turn exists."""
    ids = encode(template.render(messages))
    mask = [False] * len(ids)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ChatError("the conversation has no assistant message: nothing to train on")
    for i in turns:
        start = encode(template.render(messages[:i], add_generation_prompt=True)) if i else []
        end = encode(template.render(messages[:i + 1]))
        if ids[:len(start)] != start or ids[:len(end)] != end or len(end) < len(start):
            raise ChatError(f"the chat template of {template.where} does not render the "
                            f"conversation up to message {i} as a prefix of the whole one; its "
                            "assistant spans cannot be found (train on every token instead)")
        for t in range(len(start), len(end)):
            mask[t] = True
    return ids, mask
