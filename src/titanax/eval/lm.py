"""lm-evaluation-harness's LM interface over a titanax model: loglikelihood,
loglikelihood_rolling and generate_until, batched over the scoring functions of scoring.py.

Tokenization follows lm-eval's `hf` model (HFLM) step for step, so a checkpoint and its
launch.export_hf folder see the same token ids: TemplateLM splits context and continuation,
the tokenizer's own post-processor adds BOS where the tokenizer says so (a Llama 3
tokenizer.json does; titanax's small BPE does not), an empty context is the BOS token (EOS when
there is none), and long inputs are cut from the left to the model's max_seq_len."""

from __future__ import annotations

import jax
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from titanax.eval.scoring import bucket, next_tokens, pad_batch, token_scores


class TitanaxLM(TemplateLM):
    """`graphdef`, `params` as generate.load_for_inference gives them (sharded over the local
    devices); `tokenizer` a `tokenizers.Tokenizer`; bos_id may be None."""

    def __init__(self, cfg, graphdef, params, tokenizer, *, eos_id: int, bos_id: int | None,
                 batch_size: int = 16, max_gen_toks: int = 256, seed: int = 0,
                 chat=None, tokenizer_name: str = "titanax"):
        """chat: the run's data.chat.ChatTemplate (for lm-eval's --apply_chat_template), or
        None; tokenizer_name: what lm-eval fingerprints its request caches by."""
        super().__init__()
        self._chat, self._tokenizer_name = chat, tokenizer_name
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.cfg, self.graphdef, self.params = cfg, graphdef, params
        self.tokenizer = tokenizer
        self._eos, self._bos = eos_id, bos_id
        self.batch_size = batch_size
        self.max_length = cfg.model.max_seq_len
        self.max_gen_toks = max_gen_toks
        self._key = jax.random.key(seed)

    @property
    def eot_token_id(self) -> int:
        return self._eos if self._bos is None else self._bos

    @property
    def prefix_token_id(self) -> int:
        return self._eos if self._bos is None else self._bos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        if add_special_tokens is None:
            # As HFLM: a string that already starts with BOS gets no second one.
            add_special_tokens = not string.startswith(self.tok_decode([self.prefix_token_id]))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

    def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- chat templates (lm-eval's apply_chat_template), as HFLM renders them ---------------
    @property
    def tokenizer_name(self) -> str:
        return self._tokenizer_name

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self._chat.source if chat_template and self._chat is not None else ""

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        if self._chat is None:
            raise ValueError("the run's tokenizer folder has no chat template: evaluate "
                             "without --apply-chat-template")
        return self._chat.render(chat_history, add_generation_prompt=add_generation_prompt)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum of log p(continuation), all greedy) per (key, context ids, continuation ids),
        longest first so each batch pads little; results in the requests' order."""
        order = sorted(range(len(requests)),
                       key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out = [None] * len(requests)
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm,
                          desc="loglikelihood batches"):
            chunk = order[start:start + self.batch_size]
            # The last max_length+1 tokens: inputs all but the last, targets all but the first.
            whole = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):] for i in chunk]
            length = bucket(max(len(w) - 1 for w in whole), self.max_length)
            inputs = pad_batch([w[:-1] for w in whole], self.batch_size, length, self._eos)
            targets = pad_batch([w[1:] for w in whole], self.batch_size, length, self._eos)
            logp, greedy = token_scores(self.graphdef, self.params, inputs, targets)
            for row, (i, w) in enumerate(zip(chunk, whole, strict=True)):
                n, c = len(w) - 1, len(requests[i][2])
                out[i] = (float(logp[row, n - c:n].sum(dtype="float64")),
                          bool(greedy[row, n - c:n].all()))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Each document's total log-likelihood over disjoint windows of max_length tokens,
        the first conditioned on the prefix token (lm-eval's rolling windows, as HFLM)."""
        windows, owner = [], []
        for r, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm),
                                strict=True):
            totals[r] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        """Greedy (or, with do_sample, sampled) continuations that stop at EOS, at any of the
        request's `until` strings (cut off, as HFLM does) or after max_gen_toks tokens."""
        collator = Collator([req.args for req in requests],
                            sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                            group_by="gen_kwargs", group_fn=lambda a: a[1])
        results = []
        eos_text = self.tok_decode([self._eos], skip_special_tokens=False)
        for chunk in tqdm(collator.get_batched(n=self.batch_size), disable=disable_tqdm,
                          desc="generate_until batches"):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            texts = self._generate_batch(list(contexts), until, kwargs["max_gen_toks"],
                                         float(kwargs.get("temperature", 0.0) or 0.0))
            for context, gen_kwargs, text in zip(contexts, all_kwargs, texts, strict=True):
                text = postprocess_generated_text(text, until, None)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                results.append(text)
        return collator.get_original(results)

    def _generate_batch(self, contexts: list[str], until: list[str], max_new: int,
                        temperature: float) -> list[str]:
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a prompt in the "
                             f"model's max_seq_len={self.max_length}")
        prompts = [self.tokenizer.encode(c).ids[-(self.max_length - max_new):] for c in contexts]
        length = bucket(max(map(len, prompts)) + max_new, self.max_length)
        tokens = pad_batch(prompts, self.batch_size, length, self._eos)
        lengths = [len(p) for p in prompts] + [1] * (self.batch_size - len(prompts))
        new = [[] for _ in prompts]
        done = [False] * len(prompts)
        for _ in range(max_new):
            self._key, key = jax.random.split(self._key)
            nxt = next_tokens(self.graphdef, self.params, tokens, lengths,
                              temperature=temperature, key=key)
            for b, token in enumerate(nxt[:len(prompts)]):
                if done[b]:
                    continue
                if int(token) == self._eos:
                    done[b] = True
                    continue
                tokens[b, lengths[b]] = token
                lengths[b] += 1
                new[b].append(int(token))
                done[b] = any(s and s in self.tok_decode(new[b]) for s in until)
            if all(done):
                break
        return [self.tok_decode(ids) for ids in new]
