"""build_data: the run's tokenizer, training iterator and validation batches, from the config.

Every source is reduced to two window sets (train and held-out validation) that can produce
any window by index; grain then shuffles window indices per epoch, batches them into global
batches and each process gathers only its own contiguous rows. Because the order is a pure
function of (train.seed, step), the iterator state is a single index: resuming from it
yields exactly the batches an uninterrupted run would have seen. A mixture of shard folders
(data/mixture.py) is one more grain MapDataset in front of the batching, so the same holds.

data.bos: every document starts with the tokenizer's BOS (then its text, then eos), so the
packed stream reads ... eos | bos doc eos | bos ...; packing starts a segment (position 0)
right after each eos, i.e. at each BOS. Shard folders record whether they were written so;
a folder that disagrees with data.bos, or a mixture whose folders disagree, is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib

import numpy as np

from titanax.config import Config, ConfigError
from titanax.data import corpus, shards
from titanax.data.errors import DataError
from titanax.data.example_rows import IGNORE_INDEX, ExampleRows, pack_example_rows
from titanax.data.example_source import example_rows, is_example_folder
from titanax.data.mixture import MixtureWindows
from titanax.data.packing import StreamWindows, TokenStream, pack
from titanax.data.tokenizer import Tokenizer, load_or_train

# Seed streams of the synthetic source, so validation never repeats training tokens.
_SYNTH_TRAIN, _SYNTH_VAL = 0, 1
_SYNTH_WINDOWS = 2**31 - 1  # "infinite": no window is ever reused within a run


class SyntheticWindows:
    """Uniform random token windows; window i is a pure function of (seed, stream, i)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, stream: int, n: int):
        self.vocab_size, self.seq_len, self.seed, self.stream, self.n = \
            vocab_size, seq_len, seed, stream, n

    def __len__(self) -> int:
        return self.n

    def rows(self, indices) -> np.ndarray:
        return np.stack([
            np.random.default_rng([self.seed, self.stream, int(i)]).integers(
                0, self.vocab_size, self.seq_len + 1, dtype=np.uint32)
            for i in indices])


@dataclasses.dataclass
class Data:
    cfg: Config
    tokenizer: Tokenizer | None
    train_windows: object  # StreamWindows | SyntheticWindows
    val_windows: object
    eos_id: int | None
    summary: str
    rows: slice  # this process's rows of every global batch

    def _local_rows(self) -> slice:
        return self.rows

    def _pack(self, windows) -> dict:
        if windows.ndim == 3:  # rows of whole examples (data/example_rows.py)
            return pack_example_rows(windows)
        masking = self.cfg.data.document_masking
        return pack(windows, self.eos_id, masking)

    def train_iterator(self):
        """Infinite iterator of this process's batches, with get_state()/set_state()."""
        import grain

        train = self.cfg.train
        rows = self._local_rows()
        windows = self.train_windows
        if isinstance(windows, MixtureWindows):  # each folder shuffled, then interleaved
            ds = windows.train_order(train.seed, self.cfg.data.shuffle)
        else:
            ds = grain.MapDataset.range(len(windows))
            if self.cfg.data.shuffle and not isinstance(windows, SyntheticWindows):
                # Shuffle then repeat: grain folds the epoch into the seed, so every epoch
                # gets its own (deterministic) order.
                ds = ds.shuffle(seed=train.seed % 2**32)
            ds = ds.repeat()
        ds = ds.batch(train.batch_size, drop_remainder=True)
        # Every process draws the same global index batch and gathers only its own rows.
        ds = ds.map(lambda idx: self._pack(windows.rows(idx[rows])))
        read = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
        return iter(ds.to_iter_dataset(read))

    def val_batches(self) -> list[dict]:
        """train.eval_batches fixed batches of held-out windows (fewer if the split is small);
        none when there is no validation split (examples with data.val_fraction=0).

        A split of fewer rows than train.batch_size is evaluated as one smaller batch: its rows
        and then filler rows that bear no loss (targets IGNORE_INDEX), so the batch keeps the
        compiled shape and sharding while val_loss is the mean over the held-out tokens alone
        (the eval step sums the loss and counts the loss-bearing tokens). The log says so."""
        if self.val_windows is None:
            return []
        g, width = self.cfg.train.batch_size, self.cfg.train.seq_len + 1
        held = len(self.val_windows)
        if held == 0:
            raise DataError(
                f"the validation split holds no window of train.seq_len+1={width} tokens; "
                f"lower train.seq_len, or raise data.val_fraction (now "
                f"{self.cfg.data.val_fraction}) or set it to 0 (no validation)")
        n = min(self.cfg.train.eval_batches, held // g)
        rows = self._local_rows()
        if n == 0:
            note = (f"data: the validation split holds {held} row(s) of {width} tokens, fewer "
                    f"than train.batch_size={g}: it is evaluated as one batch of those {held} "
                    "(the batch's other rows are filler without loss)")
            if note not in self.summary:
                self.summary += "\n  " + note
            mine = np.arange(g)[rows]
            real = mine[mine < held]
            part = [self._pack(self.val_windows.rows(real))] if len(real) else []
            return [_fill_batch(part, len(mine) - len(real), width - 1)]
        return [self._pack(self.val_windows.rows(np.arange(k * g, (k + 1) * g)[rows]))
                for k in range(n)]

    def describe(self) -> str:
        return self.summary


def _fill_batch(parts: list[dict], n_fill: int, seq_len: int) -> dict:
    """parts (packed batches) then n_fill rows that bear no loss (a segment of their own)."""
    fill = {"inputs": np.zeros((n_fill, seq_len), np.int32),
            "targets": np.full((n_fill, seq_len), IGNORE_INDEX, np.int32),
            "segment_ids": np.ones((n_fill, seq_len), np.int32),
            "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32),
                                         (n_fill, seq_len)).copy()}
    return {k: np.concatenate([p[k] for p in parts] + [v]) for k, v in fill.items()}


def build_data(cfg: Config, workdir: str | pathlib.Path, process_index: int = 0,
               process_count: int = 1, rows: slice | None = None) -> Data:
    """rows: this process's rows of each global batch (the loop derives them from the batch
    sharding); by default process i of n takes the i-th of n equal contiguous blocks."""
    if rows is None:
        if cfg.train.batch_size % process_count:
            raise ConfigError(f"train.batch_size: {cfg.train.batch_size} is not divisible by "
                              f"the {process_count} processes; use a multiple of "
                              f"{process_count}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} outside [0, {process_count})")
        local = cfg.train.batch_size // process_count
        rows = slice(process_index * local, (process_index + 1) * local)
    workdir = pathlib.Path(workdir)
    source = cfg.data.source
    check_source_kind(cfg)
    if source == "synthetic":
        parts = _synthetic(cfg)
    elif source == "embedded":
        parts = _embedded(cfg, workdir)
    elif len(cfg.data.folders()) == 1:
        parts = _shard_folder(cfg, pathlib.Path(cfg.data.folders()[0][0]))
    else:
        parts = _mixture(cfg)
    tokenizer, train_stream, val_stream, eos_id, summary = parts
    seq_len = cfg.train.seq_len
    if not isinstance(train_stream, TokenStream):  # already windows: synthetic, a mixture
        train_w, val_w = train_stream, val_stream
    else:
        train_w = StreamWindows(train_stream, seq_len)
        val_w = None if val_stream is None else StreamWindows(val_stream, seq_len)
    if len(train_w) == 0:
        raise DataError(f"data.source={source!r}: the training split has {len(train_stream)} "
                        f"tokens, less than one window of train.seq_len+1={seq_len + 1}; "
                        "lower train.seq_len or use more data")
    return Data(cfg, tokenizer, train_w, val_w, eos_id, summary, rows)


def with_epoch_steps(cfg: Config, workdir: str | pathlib.Path) -> tuple[Config, str]:
    """cfg with train.steps = ceil(train.epochs x training rows / batch_size), and the line
    that says so (train.epochs > 0): the examples (or windows), rows, batch and steps.

    Rows, not examples, are what a step takes: packed, 300 short chats can fill 2 rows of
    8193 tokens, and 3 epochs at batch 16 were ceil(3 x 2 / 16) = 1 step that showed every
    row 8 times (the data repeats to fill a batch). A training split of fewer rows than one
    batch is refused here (an example folder's already is, data/example_source.py)."""
    train_w = build_data(cfg, workdir).train_windows
    n, t = len(train_w), cfg.train
    what = (f"{train_w.n_examples:,} examples in {n:,} training rows"
            if isinstance(train_w, ExampleRows) else f"{n:,} training rows")
    if n < t.batch_size:
        raise DataError(f"train.epochs={t.epochs:g}: data.source={cfg.data.source} gives "
                        f"{what} of {t.seq_len + 1} tokens, fewer than one batch of "
                        f"train.batch_size={t.batch_size}, so every step would repeat rows; "
                        f"lower train.batch_size to {n} or less or train.seq_len, or use "
                        "more data")
    steps = max(1, math.ceil(t.epochs * n / t.batch_size))
    line = (f"train.epochs={t.epochs:g} -> train.steps={steps} ({what} of {t.seq_len + 1} "
            f"tokens, train.batch_size={t.batch_size} rows a step: "
            f"ceil({t.epochs:g} x {n:,} / {t.batch_size}))")
    return dataclasses.replace(cfg, train=dataclasses.replace(t, steps=steps)), line


def check_source_kind(cfg: Config) -> None:
    """What data.source's folders hold (text, or examples with loss masks: their meta.json)
    against data.format and data.packing, and against each other; one DataError line. Cheap
    (meta.json only): launch.train runs it before anything is compiled or written."""
    d = cfg.data
    metas = {pathlib.Path(f): shards.read_meta(f) for f, _ in d.folders()}
    kinds = {folder: is_example_folder(meta) for folder, meta in metas.items()}
    if not kinds:  # embedded, synthetic: text
        kinds = {d.source: False}
    if len(set(kinds.values())) > 1:
        raise DataError(f"data.source: mixes folders of fine-tuning examples "
                        f"({[str(f) for f, e in kinds.items() if e]}) with text folders "
                        f"({[str(f) for f, e in kinds.items() if not e]}); text has no loss "
                        "masks: prepare every folder with the same --format")
    if not any(kinds.values()):
        # synthetic: random tokens for benchmarks, whatever run they stand in for
        if d.format not in ("auto", "text") and d.source != "synthetic":
            flag = "chat" if d.format == "examples" else d.format
            raise DataError(f"data.format={d.format}: data.source={d.source} holds text, with "
                            "no loss masks; write its examples with `python -m "
                            f"launch.prepare_data --format {flag}` into a fresh --out folder, "
                            "or set data.format=auto to train on every token")
        if d.packing == "pad":
            raise DataError(f"data.packing=pad puts one example per row, but data.source="
                            f"{d.source} holds text (packed into windows); prepare examples "
                            "with `python -m launch.prepare_data --format chat|prompt_response`"
                            ", or set data.packing=pack")
        return
    _check_example_format(cfg, metas)


def _synthetic(cfg: Config):
    v, L, seed = cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed
    n_val = cfg.train.eval_batches * cfg.train.batch_size
    train = SyntheticWindows(v, L, seed, _SYNTH_TRAIN, _SYNTH_WINDOWS)
    val = SyntheticWindows(v, L, seed, _SYNTH_VAL, n_val)
    summary = (f"data: synthetic (uniform random tokens, seed {seed}), no documents, "
               f"vocab {v}")
    return None, train, val, None, summary


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Holds out every k-th document whole: no file is split between training and validation,
    and validation samples the library and its test suites in the proportions training sees."""
    n_val = min(len(docs) - 1, max(1, round(len(docs) * val_fraction)))
    stride = len(docs) // n_val
    val_ids = set(range(stride - 1, len(docs), stride)[:n_val])
    return ([d for i, d in enumerate(docs) if i not in val_ids],
            [docs[i] for i in sorted(val_ids)])


def _embedded(cfg: Config, workdir: pathlib.Path):
    data = cfg.data
    docs, fingerprint = corpus.load_with_fingerprint(data.embedded_max_bytes)
    if len(docs) < 2:
        raise DataError(f"data.embedded_max_bytes={data.embedded_max_bytes} selects "
                        f"{len(docs)} file(s) of {corpus.stdlib_root()}; at least 2 are needed "
                        "for a train/validation split; raise it")
    workdir.mkdir(parents=True, exist_ok=True)
    tok = load_or_train(data, cfg.model, workdir, docs=docs)
    bos_id = tok.require_bos() if data.bos else None
    train_docs, val_docs = split_documents(docs, data.val_fraction)
    n_val = len(val_docs)
    # ':bos' only when on: caches written before data.bos existed keep their names
    key = (f"{fingerprint}:{shards.file_sha256(tok.path)}:{n_val}:strided"
           f"{':bos' if data.bos else ''}")
    key = hashlib.sha256(key.encode())
    key = key.hexdigest()[:16]
    paths = [workdir / f"embedded_tokens_{key}_{split}.npy" for split in ("train", "val")]
    streams = _load_cached(paths)
    if streams is None:
        streams = [_tokenize(train_docs, tok, bos_id), _tokenize(val_docs, tok, bos_id)]
        for path, arr in zip(paths, streams):
            shards.save_npy_atomic(path, arr)
    train, val = streams
    summary = (f"data: embedded (Python stdlib sources, {len(docs)} documents: "
               f"{len(docs) - n_val} train / {n_val} val), train {len(train):,} tokens, "
               f"val {len(val):,} tokens, vocab {tok.vocab_size} ({tok.path})"
               f"{', bos per document' if data.bos else ''}")
    return tok, TokenStream([train]), TokenStream([val]), tok.eos_id, summary


def _load_cached(paths) -> list[np.ndarray] | None:
    if not all(p.is_file() for p in paths):
        return None
    try:
        return [np.load(p, mmap_mode="r", allow_pickle=False) for p in paths]
    except Exception:  # a damaged cache is rebuilt, not trusted
        return None


def _tokenize(docs: list[str], tok: Tokenizer, bos_id: int | None = None,
              chunk: int = 1024) -> np.ndarray:
    """Documents -> one uint32 stream, each document followed by eos (and preceded by bos_id
    when given)."""
    pieces = []
    head = [] if bos_id is None else [np.asarray([bos_id], dtype=np.uint32)]
    # Chunks keep the Python int lists small; encode_batch still uses every core per chunk.
    for i in range(0, len(docs), chunk):
        for ids in tok.encode_batch(docs[i:i + chunk]):
            pieces.extend(head)
            pieces.append(np.asarray(ids, dtype=np.uint32))
            pieces.append(np.asarray([tok.eos_id], dtype=np.uint32))
    return np.concatenate(pieces)


def _open_folder(cfg: Config, folder: pathlib.Path, alone: bool = True):
    """(meta, train stream, val stream) of one shard folder. The last val_fraction of its
    token stream is held out (shards are written in input order: the tail of the inputs).
    alone: the run's only folder (not one of a mixture's)."""
    meta, arrays = shards.open_shards(folder, cfg.model.vocab_size)
    if meta.get("complete") is False and not cfg.data.allow_partial:  # absent: older, whole
        raise DataError(f"data.source: {folder} is unfinished: its prepare_data was "
                        f"interrupted ({len(meta.get('done_inputs', []))} inputs done; "
                        "meta.json complete: false); re-run the same prepare_data command to "
                        "finish it, or set data.allow_partial=true to train on what it holds "
                        "(its validation split, the tail, moves once it is finished)")
    if is_example_folder(meta):  # whole examples in rows, not windows of a stream
        train, val, train.summary = example_rows(cfg, folder, meta, arrays,  # (its log line)
                                                 alone=alone)
        return meta, train, val
    stream = TokenStream(arrays, names=[str(folder / e["file"]) for e in meta["shards"]],
                         vocab_size=cfg.model.vocab_size)
    n = len(stream)
    if cfg.data.val_fraction == 0:  # no validation split
        return meta, stream, None
    n_val = max(1, int(n * cfg.data.val_fraction))
    return meta, stream.view(0, n - n_val), stream.view(n - n_val, n)


def _check_bos(cfg: Config, metas: dict) -> None:
    """Refuses folders written with and without BOS per document together, or against
    data.bos (folders from before meta.json recorded it were written without)."""
    flags = {folder: bool(meta.get("bos", False)) for folder, meta in metas.items()
             if not is_example_folder(meta)}  # examples: the chat template writes any BOS
    if not flags:
        return
    if len(set(flags.values())) > 1:
        with_ = [str(f) for f, b in flags.items() if b]
        without = [str(f) for f, b in flags.items() if not b]
        raise DataError(f"data.source: the mixture's folders disagree on BOS per document "
                        f"(with: {with_}, without: {without}); re-run `python -m "
                        "launch.prepare_data` for one side (with or without --bos) so they "
                        "agree")
    flag = next(iter(flags.values()))
    if flag != cfg.data.bos:
        how = "with" if flag else "without"
        what = (f"{next(iter(flags))} was" if len(flags) == 1 else
                f"every folder of data.source ({', '.join(map(str, flags))}) was")
        raise DataError(f"data.bos={str(cfg.data.bos).lower()}: {what} written {how} "
                        f"BOS per document (meta.json bos: {str(flag).lower()}); set "
                        f"data.bos={str(flag).lower()}, or re-run `python -m launch.prepare_data"
                        f"{'' if flag else ' --bos'}` into a fresh --out folder")


def _check_example_format(cfg: Config, metas: dict) -> None:
    """Every folder's examples of one kind, written with one template and loss rule, and of
    data.format's kind when it names one."""
    kinds = {(m["data_format"], m.get("train_on"), m.get("template_sha256"))
             for m in metas.values()}
    if len(kinds) > 1:
        raise DataError(f"data.source: the folders' examples differ in format, --train-on or "
                        f"chat template ({sorted(map(str, kinds))}); prepare them alike")
    fmt = next(iter(kinds))[0]
    if cfg.data.format not in ("auto", "examples", fmt):
        raise DataError(f"data.format={cfg.data.format}: data.source={cfg.data.source} holds "
                        f"{fmt} examples; set data.format={fmt} (or auto), or prepare the data "
                        f"with --format {cfg.data.format}")


def _folder_tokenizer(cfg: Config, folder: pathlib.Path) -> Tokenizer | None:
    # data.tokenizer, else the folder's own copy; a folder without one trains fine (no decode).
    has_tok = cfg.data.tokenizer or (folder / "tokenizer.json").is_file()
    return load_or_train(cfg.data, cfg.model, folder) if has_tok else None


def _check_tokenizer(cfg: Config, metas: dict) -> None:
    """Refuses shard folders written with another tokenizer than data.tokenizer (the run's,
    e.g. an imported model's): their token ids would mean other words, silently. Files that
    differ only in their bytes (reformatted JSON) but hold the same vocabulary pass."""
    if not cfg.data.tokenizer:
        return
    want = shards.file_sha256(cfg.data.tokenizer)
    vocab = None
    for folder, meta in metas.items():
        have = meta.get("tokenizer_sha256")
        if have is None or have == want:
            continue
        copy = pathlib.Path(folder) / "tokenizer.json"
        if copy.is_file():
            vocab = vocab or Tokenizer.load(cfg.data.tokenizer).vocab()
            if Tokenizer.load(copy).vocab() == vocab:
                continue
        also = ", and so does its tokenizer.json's vocabulary" if copy.is_file() else ""
        raise DataError(f"data.tokenizer: {folder} was tokenized with another tokenizer than "
                        f"data.tokenizer={cfg.data.tokenizer} (the sha256 in its meta.json "
                        f"differs{also}); re-run `python -m launch.prepare_data --tokenizer "
                        f"{cfg.data.tokenizer}` into a fresh --out folder, or point "
                        "data.tokenizer at the tokenizer the folder was written with")


def _shard_folder(cfg: Config, folder: pathlib.Path):
    meta, train, val = _open_folder(cfg, folder)
    _check_bos(cfg, {folder: meta})
    _check_tokenizer(cfg, {folder: meta})
    tok = _folder_tokenizer(cfg, folder)
    if isinstance(train, ExampleRows):
        return tok, train, val, meta.get("eos_id"), train.summary
    n_docs = sum(s.get("n_docs", 0) for s in meta["shards"])
    summary = (f"data: shards {folder} ({len(meta['shards'])} shards, {n_docs} documents), "
               f"train {len(train):,} tokens, val {len(val):,} tokens, vocab "
               f"{meta.get('vocab_size')}{', bos per document' if cfg.data.bos else ''}")
    return tok, train, val, meta.get("eos_id"), summary


def _mixture(cfg: Config):
    """data.source=a:0.7,b:0.3: each folder split on its own, then mixed (data/mixture.py)."""
    folders = [(pathlib.Path(f), w) for f, w in cfg.data.folders()]
    opened = {folder: _open_folder(cfg, folder, alone=False) for folder, _ in folders}
    metas = {folder: meta for folder, (meta, _, _) in opened.items()}
    _check_bos(cfg, metas)
    _check_tokenizer(cfg, metas)
    first, meta0 = next(iter(metas.items()))
    for folder, meta in metas.items():
        for key in ("tokenizer_sha256", "eos_id"):
            if meta.get(key) != meta0.get(key):
                raise DataError(f"data.source: {folder} and {first} were written with "
                                f"different tokenizers ({key} differs); tokenize every folder "
                                "of a mixture with the same tokenizer.json")
    if is_example_folder(meta0):  # all of them (check_source_kind)
        return _example_mixture(cfg, folders, opened, metas)
    seq_len, total = cfg.train.seq_len, sum(w for _, w in folders)
    train, val, lines = [], [], []
    for folder, w in folders:
        _, t, v = opened[folder]
        t, v = StreamWindows(t, seq_len), None if v is None else StreamWindows(v, seq_len)
        for split, windows, fix in (("training", t, "use more data"),
                                    ("validation", v or t, "raise data.val_fraction")):
            if len(windows) == 0:
                raise DataError(f"data.source: the {split} split of {folder} holds no window of "
                                f"train.seq_len+1={seq_len + 1} tokens; lower train.seq_len or "
                                f"{fix}")
        train.append(t)
        val.append(v)
        n_val = len(v) if v else 0
        lines.append(f"{folder} {w / total:.0%} ({len(t):,} train / {n_val:,} val windows)")
    weights = [w for _, w in folders]
    mix = MixtureWindows(train, weights)
    summary = (f"data: mixture of {len(folders)} shard folders: {', '.join(lines)}, vocab "
               f"{meta0.get('vocab_size')}{', bos per document' if cfg.data.bos else ''}")
    val_mix = None if val[0] is None else MixtureWindows(val, weights).val_windows()
    return _folder_tokenizer(cfg, first), mix, val_mix, meta0.get("eos_id"), summary


def _example_mixture(cfg: Config, folders, opened: dict, metas: dict):
    """A mixture of example folders: each folder's rows, interleaved by weight as windows are
    (data/mixture.py); validation only when every folder holds some out."""
    total = sum(w for _, w in folders)
    weights = [w for _, w in folders]
    train = [opened[f][1] for f, _ in folders]
    vals = [opened[f][2] for f, _ in folders]
    lines = [f"{f} {w / total:.0%} ({opened[f][1].describe()})" for f, w in folders]
    val = None if any(v is None for v in vals) else MixtureWindows(vals, weights).val_windows()
    first = folders[0][0]
    summary = (f"data: mixture of {len(folders)} example folders "
               f"({metas[first]['data_format']}): {', '.join(lines)}")
    return _folder_tokenizer(cfg, first), MixtureWindows(train, weights), val, \
        metas[first].get("eos_id"), summary
