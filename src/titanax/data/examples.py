"""Fine-tuning examples: a record of chat or instruction data -> its token ids and, per token,
whether the loss bears on it (launch.prepare_data --format chat|prompt_response).

  chat             {"messages": [{"role", "content"}, ...]}, rendered through the tokenizer
                   folder's chat template; the loss covers each assistant turn after its role
                   header, through its end-of-turn token (data/chat.py assistant_spans).
  prompt_response  {"prompt": str, "response": str}: one user turn and one assistant turn
                   through the template when the folder has one, else prompt + response + eos
                   (the loss on the response and its eos).

train_on='all' puts the loss on every token instead (the ids are the same). Rendered text is
tokenized without added special tokens, with the template's special tokens as their ids
(Tokenizer.encode_rendered), as transformers' apply_chat_template does.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from titanax.data.chat import ChatError, ChatTemplate, assistant_spans
from titanax.data.errors import DataError

FORMATS = ("text", "chat", "prompt_response")
EXAMPLE_FORMATS = FORMATS[1:]
TRAIN_ON = ("assistant", "all")
# The record fields each example format reads (jsonl keys, table columns).
FIELDS = {"chat": ("messages",), "prompt_response": ("prompt", "response")}


@dataclasses.dataclass(frozen=True)
class ExampleEncoder:
    fmt: str                       # one of EXAMPLE_FORMATS
    tok: object                    # data.tokenizer.Tokenizer
    template: ChatTemplate | None  # the tokenizer folder's; required for chat
    train_on: str = "assistant"
    bos: bool = False              # without a template: start each example with BOS

    def __post_init__(self):
        if self.fmt not in EXAMPLE_FORMATS:
            raise DataError(f"--format {self.fmt!r}: examples are one of {list(EXAMPLE_FORMATS)}")
        if self.train_on not in TRAIN_ON:
            raise DataError(f"--train-on {self.train_on!r}: one of {list(TRAIN_ON)}")
        if self.fmt == "chat" and self.template is None:
            raise DataError("--format chat needs a chat template beside the tokenizer "
                            "(chat_template.jinja, or tokenizer_config.json's chat_template); "
                            "use the tokenizer folder of an Instruct model, or --format "
                            "prompt_response")
        if self.bos and self.template is not None:
            raise DataError("--bos: the chat template writes its own BOS; leave --bos out")
        if self.bos:
            self.tok.require_bos("--bos")

    def identity(self) -> dict:
        """What meta.json records, so that a resumed or mixed folder must agree."""
        src = self.template.source if self.template is not None else ""
        return {"data_format": self.fmt, "train_on": self.train_on,
                "template_sha256": hashlib.sha256(src.encode()).hexdigest() if src else None}

    def encode(self, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(uint32 ids, uint8 loss mask) of one record; DataError naming `where` (file:line)
        for a record that is not an example of this format."""
        try:
            ids, mask = self._encode(record)
        except ChatError as e:
            raise DataError(f"{where}: {e}") from None
        if self.train_on == "all":
            mask = [True] * len(ids)
        return np.asarray(ids, np.uint32), np.asarray(mask, np.uint8)

    def _encode(self, record: dict) -> tuple[list[int], list[bool]]:
        if self.fmt == "chat":
            return assistant_spans(self.template, record["messages"], self.tok.encode_rendered)
        prompt, response = record["prompt"], record["response"]
        for name, value in (("prompt", prompt), ("response", response)):
            if not isinstance(value, str):
                raise ChatError(f"'{name}' must be text, got {type(value).__name__}")
        if self.template is not None:
            turns = [{"role": "user", "content": prompt},
                     {"role": "assistant", "content": response}]
            return assistant_spans(self.template, turns, self.tok.encode_rendered)
        head = [self.tok.bos_id] if self.bos else []
        p, r = self.tok.encode(prompt), self.tok.encode(response) + [self.tok.eos_id]
        return head + p + r, [False] * (len(head) + len(p)) + [True] * len(r)
