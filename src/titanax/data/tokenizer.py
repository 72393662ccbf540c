"""Byte-level BPE tokenizer: a thin wrapper over HF `tokenizers`, plus training and caching.

The wrapper never lets the tokenizer add special tokens on its own (a Llama 3 tokenizer.json
has a post-processor that prepends <|begin_of_text|>): the data pipeline places eos itself,
so that token streams mean the same thing whatever tokenizer file produced them.
"""

from __future__ import annotations

import json
import os
import pathlib

from titanax.config import ConfigError, DataConfig, ModelConfig

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
# Accepted end-of-document tokens for tokenizer files trained elsewhere (Llama 3, GPT-2,
# SentencePiece-style conversions), in order of preference.
_EOS_CANDIDATES = (EOS, "<|endoftext|>", "</s>", "<eos>")
_BOS_CANDIDATES = (BOS, "<s>", "<bos>")

# Training text cap: BPE merges are settled long before 8 MB of Python source (measured:
# 8 MB vs the full 24 MB changes the token count of the corpus by ~1%), and it keeps
# training at ~2 s on 2 cores instead of ~8 s.
TRAIN_MAX_CHARS = 8_000_000


class Tokenizer:
    """encode/decode with the ids of the two special tokens the pipeline needs."""

    def __init__(self, hf_tokenizer, path: str | pathlib.Path):
        self._tok = hf_tokenizer
        # Text that happens to contain "<|end_of_text|>" must not produce the real eos id:
        # special tokens are only ever placed by the pipeline.
        hf_tokenizer.encode_special_tokens = True
        self._rendering = None  # encode_rendered's tokenizer, made on first use
        self.path = str(path)
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = _first_id(hf_tokenizer, _EOS_CANDIDATES)
        self.bos_id = _first_id(hf_tokenizer, _BOS_CANDIDATES)
        if self.eos_id is None:
            raise ConfigError(f"data.tokenizer: {self.path} has no end-of-document token (looked "
                              f"for {list(_EOS_CANDIDATES)}); add one as a special token")

    def vocab(self) -> dict[str, int]:
        """token -> id, added tokens included: what two tokenizers must share to agree."""
        return self._tok.get_vocab(with_added_tokens=True)

    def require_bos(self, setting: str = "data.bos=true") -> int:
        """The BOS id, or a clear error when this tokenizer has none."""
        if self.bos_id is None:
            raise ConfigError(f"{setting}: the tokenizer {self.path} has no beginning-of-"
                              f"document token (looked for {list(_BOS_CANDIDATES)}); add one "
                              "as a special token, or turn BOS off")
        return self.bos_id

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        p = pathlib.Path(path)
        if not p.is_file():
            raise ConfigError(f"data.tokenizer: {str(p)!r} does not exist; point it at a "
                              "tokenizer.json, or leave it empty to train one on the embedded "
                              "corpus")
        try:
            hf = HFTokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ConfigError(f"data.tokenizer: cannot read {str(p)!r} as a HF tokenizer.json "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        return cls(hf, p)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_rendered(self, text: str) -> list[int]:
        """A chat template's output: the special tokens the template wrote (<|eot_id|>, ...)
        become their ids, as transformers' apply_chat_template tokenizes them. Only for text
        the template produced: in the user's own text (encode) they stay plain characters."""
        if self._rendering is None:
            from tokenizers import Tokenizer as HFTokenizer

            self._rendering = HFTokenizer.from_str(self._tok.to_str())
            self._rendering.encode_special_tokens = False
        return self._rendering.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Parallel over the batch in Rust (all cores); the _fast variant skips character
        # offsets, which we never use, and is ~2x faster.
        encoded = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encoded]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _first_id(hf, candidates) -> int | None:
    for name in candidates:
        i = hf.token_to_id(name)
        if i is not None:
            return i
    return None


def train_bpe(docs: list[str], vocab_size: int, path: str | pathlib.Path) -> Tokenizer:
    """Trains a byte-level BPE on docs and saves it to path (written atomically).

    Trains on an evenly strided subset of at most TRAIN_MAX_CHARS characters, so the cost
    stays small whatever the corpus size; the subset is deterministic (every k-th document).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + 2:
        raise ConfigError(f"model.vocab_size: a byte-level BPE needs at least 258 entries (256 "
                          f"bytes + 2 special tokens), got {vocab_size}")
    total = sum(len(d) for d in docs)
    stride = max(1, -(-total // TRAIN_MAX_CHARS))
    subset = docs[::stride]

    hf = HFTokenizer(models.BPE())
    # No prefix space: source code is not prose, and a leading space would change line 1.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        # All 256 byte symbols, even unseen ones, so any text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(subset, trainer, length=len(subset))
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    hf.save(str(tmp))
    os.replace(tmp, path)  # a crash mid-write never leaves a truncated tokenizer.json
    return Tokenizer(hf, path)


def load_or_train(data_cfg: DataConfig, model_cfg: ModelConfig,
                  workdir: str | pathlib.Path, docs: list[str] | None = None) -> Tokenizer:
    """The run's tokenizer: data.tokenizer if set; else a shard folder's own tokenizer.json;
    else (embedded) a byte-level BPE trained on the embedded corpus.

    The trained one is cached at WORKDIR/tokenizer.json and reused when its vocab matches
    model.vocab_size. `docs` (the embedded corpus) may be passed to avoid reading it twice.
    """
    if data_cfg.tokenizer:
        tok = Tokenizer.load(data_cfg.tokenizer)
        check_vocab(tok, model_cfg)
        return tok
    if data_cfg.source == "synthetic":
        raise ConfigError("data.tokenizer: data.source='synthetic' has no tokenizer; set "
                          "data.tokenizer to a tokenizer.json if one is needed")
    if data_cfg.source != "embedded":  # a shard folder carries the tokenizer that wrote it
        # (a mixture: its first folder's; the pipeline checks they all used the same one)
        shipped = pathlib.Path(data_cfg.folders()[0][0]) / "tokenizer.json"
        if not shipped.is_file():
            raise ConfigError(f"data.tokenizer: {shipped} does not exist; set data.tokenizer "
                              "to the tokenizer.json the shards were written with")
        tok = Tokenizer.load(shipped)
        check_vocab(tok, model_cfg)
        return tok
    cached = pathlib.Path(workdir) / "tokenizer.json"
    # A small corpus can run out of merges below the requested vocab, so the requested size
    # is recorded next to the file; without that record, only an exact size match is reused.
    sidecar = cached.with_name("tokenizer_meta.json")
    if cached.is_file():
        try:
            tok = Tokenizer.load(cached)
            requested = json.loads(sidecar.read_text()).get("requested_vocab_size") \
                if sidecar.is_file() else tok.vocab_size
            if requested == model_cfg.vocab_size and tok.vocab_size <= model_cfg.vocab_size:
                return tok
        except (ConfigError, ValueError, OSError):
            pass  # unreadable cache: retrain over it
    if docs is None:
        from titanax.data import corpus

        docs = corpus.load_documents(data_cfg.embedded_max_bytes)
    tok = train_bpe(docs, model_cfg.vocab_size, cached)
    sidecar.write_text(json.dumps({"requested_vocab_size": model_cfg.vocab_size}) + "\n")
    check_vocab(tok, model_cfg)
    return tok


def check_vocab(tok: Tokenizer, model_cfg: ModelConfig) -> None:
    if tok.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"model.vocab_size: the tokenizer {tok.path} has {tok.vocab_size} "
                          f"tokens but model.vocab_size={model_cfg.vocab_size}; set "
                          f"model.vocab_size >= {tok.vocab_size} (or use a smaller tokenizer)")
