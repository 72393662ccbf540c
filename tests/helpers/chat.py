"""What the chat and fine-tuning tests share: Llama 3's chat template and special tokens, and
a small byte-level BPE that has them."""

from __future__ import annotations

import pathlib

# Llama 3's chat format (its template without the tool-calling branches).
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>")


def special_tokenizer(path: pathlib.Path, text: str, vocab: int = 300) -> pathlib.Path:
    """tokenizer.json at path: a BPE trained on text, with SPECIALS added as special tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from titanax.data.tokenizer import train_bpe

    train_bpe([text * 20], vocab, path)
    hf = HFTokenizer.from_file(str(path))
    hf.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    hf.save(str(path))
    return path
