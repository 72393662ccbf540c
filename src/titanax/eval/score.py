"""The loss and per-token log-probabilities of given texts under a run's checkpoint
(launch.score), computed as a transformers user computes them:

  ids = tokenizer(text)["input_ids"]        # the tokenizer's own post-processor adds BOS
  logits = model(ids).logits                # where it says so (a Llama 3 tokenizer.json does)
  logprob[t] = log_softmax(logits[t - 1])[ids[t]]          for t = 1 .. len(ids) - 1
  loss = -mean(logprob)  (= model(ids, labels=ids).loss),  perplexity = exp(loss)

A chat is rendered through the run's chat template and tokenized without added special
tokens, as apply_chat_template(messages, tokenize=True) and the SFT data path (data/chat.py)
do. Its `loss` covers every predicted token, as model(ids, labels=ids).loss; beside it,
`assistant_loss` covers only the tokens fine-tuning trains on (each assistant turn after its
role header, through its end of turn: data/chat.py assistant_spans, transformers'
return_assistant_tokens_mask), as a loss with labels=-100 outside the replies computes it.

The model runs through eval/scoring.py's batched scoring (lengths padded to a few buckets),
parameters only, sharded over the given devices as launch.generate and launch.eval do."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

__all__ = ["ScoreError", "Scored", "Scorer", "format_report", "read_inputs", "score"]


class ScoreError(ValueError):
    """Input that cannot be scored; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Scored:
    """One text: its token ids and their text, log p(ids[t] | ids[:t]) for t >= 1, and (a
    chat with an assistant reply) per predicted token whether fine-tuning's loss bears on it."""
    ids: list[int]
    pieces: list[str]
    logprobs: list[float]           # len(ids) - 1 entries
    assistant: list[bool] | None    # len(ids) - 1 entries, or None

    @property
    def loss(self) -> float:
        return -math.fsum(self.logprobs) / len(self.logprobs)

    @property
    def assistant_loss(self) -> float | None:
        picked = [lp for lp, a in zip(self.logprobs, self.assistant or (), strict=False) if a]
        return -math.fsum(picked) / len(picked) if picked else None

    def to_dict(self) -> dict:
        out = {"loss": self.loss, "perplexity": _exp(self.loss), "tokens": len(self.ids),
               "predicted_tokens": len(self.logprobs)}
        if self.assistant is not None:
            out.update(assistant_loss=self.assistant_loss,
                       assistant_perplexity=_exp(self.assistant_loss),
                       assistant_tokens=sum(self.assistant))
        rows = [{"id": self.ids[0], "token": self.pieces[0], "logprob": None}]
        for t, lp in enumerate(self.logprobs):
            row = {"id": self.ids[t + 1], "token": self.pieces[t + 1], "logprob": lp}
            if self.assistant is not None:
                row["assistant"] = self.assistant[t]
            rows.append(row)
        return {**out, "token_logprobs": rows}


def _exp(x: float | None) -> float | None:
    if x is None:
        return None
    return math.exp(x) if x < 700 else math.inf


def _record(value, where: str, chat: bool):
    """A text (str) or a conversation (a list of messages) from one input record."""
    if not chat:
        if not isinstance(value, dict) or "text" not in value:
            raise ScoreError(f"{where}: no \"text\" field; each line must be a JSON object "
                             "{\"text\": \"...\"} (for chats, {\"messages\": [...]} with --chat)")
        value = value["text"]
        if not isinstance(value, str):
            raise ScoreError(f"{where}: \"text\" must be a string, got {type(value).__name__}")
        if not value:
            raise ScoreError(f"{where}: the text is empty; give a non-empty text")
        return value
    if isinstance(value, dict) and "messages" in value:
        return value["messages"]
    if isinstance(value, dict) and {"prompt", "response"} <= value.keys():
        return [{"role": "user", "content": value["prompt"]},
                {"role": "assistant", "content": value["response"]}]
    if isinstance(value, list):
        return value
    raise ScoreError(f"{where}: no \"messages\" field; with --chat each line (or --text) must be "
                     "{\"messages\": [{\"role\": ..., \"content\": ...}, ...]} (or "
                     "{\"prompt\": ..., \"response\": ...}); score plain text without --chat")


def read_inputs(*, text: str | None = None, path=None, chat: bool = False) -> list:
    """The texts (or, chat, the conversations) to score: `text` (a conversation given as JSON:
    a list of messages or {"messages": [...]}), or every non-blank line of the jsonl `path`.
    ScoreError naming the line and the fix for anything else."""
    if (text is None) == (path is None):
        raise ScoreError("give the text to score with --text TEXT or --input FILE.jsonl "
                         "(one of them, not both)")
    if text is not None:
        if not chat:
            return [_record({"text": text}, "--text", chat)]
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise ScoreError("--chat --text: give the conversation as JSON, e.g. '[{\"role\": "
                             "\"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
                             "\"content\": \"hello\"}]'") from None
        return [_record(value, "--text", chat)]
    path = pathlib.Path(path)
    if not path.is_file():
        raise ScoreError(f"--input {path}: no such file; give a .jsonl file, one JSON object "
                         "a line")
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ScoreError(f"{path}:{n}: not JSON ({e.msg}); each line must be one JSON "
                             "object") from None
        records.append(_record(value, f"{path}:{n}", chat))
    if not records:
        raise ScoreError(f"--input {path}: no lines to score; give one JSON object a line")
    return records


class Scorer:
    """A run's checkpoint and tokenizer, ready to score texts (see the module's docstring)."""

    def __init__(self, workdir, *, step: int | None = None, devices=None, batch_size: int = 8,
                 verify: bool = True):
        import jax
        from tokenizers import Tokenizer as HFTokenizer

        from titanax.data.chat import ChatTemplate
        from titanax.data.tokenizer import Tokenizer
        from titanax.generate import find_tokenizer, load_for_inference

        self.cfg, self.graphdef, self.params, self.step = load_for_inference(
            workdir, step, devices=jax.local_devices() if devices is None else devices,
            verify=verify)
        tok_path = find_tokenizer(self.cfg, workdir)
        if tok_path is None:
            raise ScoreError(f"no tokenizer.json for the run in {workdir} (synthetic data has "
                             "none); scoring needs text")
        self.tok = Tokenizer.load(tok_path)  # encode_rendered: a chat template's output
        # As transformers' tokenizer(text): special tokens written in the text are recognised,
        # and the post-processor adds BOS where the tokenizer.json says so.
        self.hf_tok = HFTokenizer.from_file(str(tok_path))
        self.template = ChatTemplate.from_folder(tok_path.parent)
        self.tok_folder = tok_path.parent
        self.batch_size = batch_size

    def encode(self, record) -> tuple[list[int], list[bool] | None]:
        """(ids, per token: assistant, or None) of a text or a conversation."""
        if isinstance(record, str):
            return self.hf_tok.encode(record, add_special_tokens=True).ids, None
        from titanax.data.chat import ChatError, assistant_spans

        if self.template is None:
            raise ScoreError(f"--chat: the run's tokenizer folder {self.tok_folder} has no "
                             "chat template (chat_template.jinja or tokenizer_config.json's "
                             "chat_template); score plain text without --chat")
        try:
            if any(isinstance(m, dict) and m.get("role") == "assistant" for m in record):
                return assistant_spans(self.template, record, self.tok.encode_rendered)
            return self.tok.encode_rendered(self.template.render(record)), None
        except ChatError as e:
            raise ScoreError(str(e)) from None

    def score(self, records: list) -> list[Scored]:
        """Each record (a text, or a conversation) scored, in order. ScoreError for one that
        gives fewer than two tokens or more than the model's max_seq_len."""
        encoded = []
        for i, record in enumerate(records, 1):
            try:
                encoded.append(self.encode(record))
            except ScoreError as e:
                raise ScoreError(f"text {i}: {e}") from None
        limit = self.cfg.model.max_seq_len
        for i, (ids, _) in enumerate(encoded, 1):
            if len(ids) < 2:
                raise ScoreError(f"text {i} is {len(ids)} token(s): nothing to predict (the "
                                 "first token has no prefix); give a longer text")
            if len(ids) > limit:
                raise ScoreError(f"text {i} is {len(ids)} tokens, more than the model's "
                                 f"max_seq_len={limit}; shorten it or split it")
        logprobs = self._logprobs([ids for ids, _ in encoded])
        return [Scored(ids, [self.hf_tok.decode([t], skip_special_tokens=False) for t in ids],
                       lp, None if mask is None else mask[1:])
                for (ids, mask), lp in zip(encoded, logprobs, strict=True)]

    def _logprobs(self, rows: list[list[int]]) -> list[list[float]]:
        """log p(row[t] | row[:t]) for t >= 1 of every row, longest rows batched together."""
        from titanax.eval.scoring import bucket, pad_batch, token_scores

        batch = min(self.batch_size, len(rows))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        out = [None] * len(rows)
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            length = bucket(max(len(rows[i]) - 1 for i in chunk), self.cfg.model.max_seq_len)
            inputs = pad_batch([rows[i][:-1] for i in chunk], batch, length, self.tok.eos_id)
            targets = pad_batch([rows[i][1:] for i in chunk], batch, length, self.tok.eos_id)
            logp, _ = token_scores(self.graphdef, self.params, inputs, targets)
            for r, i in enumerate(chunk):
                out[i] = [float(x) for x in logp[r, :len(rows[i]) - 1]]
        return out


def score(workdir, records: list, *, step: int | None = None, devices=None,
          verify: bool = True) -> dict:
    """{"workdir", "step", "texts": [Scored.to_dict() of each record]}: what launch.score
    prints and writes with --json."""
    scorer = Scorer(workdir, step=step, devices=devices, verify=verify)
    return {"workdir": str(pathlib.Path(workdir).absolute()), "step": scorer.step,
            "texts": [s.to_dict() for s in scorer.score(records)]}


def format_report(report: dict) -> str:
    """The report as text: per text a summary line, then one line per token (its log-prob,
    '-' for the first, which has no prefix; '*' marks a chat's assistant tokens)."""
    lines = []
    for i, t in enumerate(report["texts"], 1):
        head = (f"text {i}: loss {t['loss']:.6f}, perplexity {t['perplexity']:.4f}, "
                f"{t['tokens']} tokens ({t['predicted_tokens']} predicted)")
        if t.get("assistant_loss") is not None:
            head += (f"; assistant tokens: loss {t['assistant_loss']:.6f}, perplexity "
                     f"{t['assistant_perplexity']:.4f}, {t['assistant_tokens']} predicted")
        lines.append(head)
        for row in t["token_logprobs"]:
            lp = "-" if row["logprob"] is None else f"{row['logprob']:.6f}"
            mark = "  *" if row.get("assistant") else ""
            lines.append(f"  {lp:>12}  {json.dumps(row['token'], ensure_ascii=False)}{mark}")
    lines.append(f"[step {report['step']} of {report['workdir']}]")
    return "\n".join(lines)
