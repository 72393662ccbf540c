"""python -m launch.generate --workdir DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
[--top-k K] [--top-p P] [--chat [--system TEXT]] [--step N] [--no-verify]
Samples from the run's latest checkpoint with a KV cache (T=0: greedy; top-k and top-p as
transformers' generate applies them). --chat sends the prompt as a user message through the
run's chat template (an imported Instruct model's) and prints the reply. Restores the
parameters only (no optimizer state), sharded over this machine's devices; writes nothing.
The step is first checked against its manifest (every byte read once, CRC-32): a damaged one
is refused in one line naming the file, exit 1; --no-verify skips the check."""

from __future__ import annotations

import argparse
import sys

from launch.common import fail, stop


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.generate", description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens holding P of the probability "
                        "(1: all)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--chat", action="store_true",
                   help="render --prompt as a user message with the run's chat template and "
                        "the assistant's turn opened; stops at the end of the turn")
    p.add_argument("--system", default=None, help="a system message before it (with --chat)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the compute dtype to sample in (default: the run's execution.dtype; an "
                        "imported model's is the one its config.json names)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-verify", action="store_true",
                   help="skip checking the step's files against its manifest (CRC-32 of every "
                        "byte of the step, read once) before sampling from it")
    args = p.parse_args(argv)
    _check_flags(args)

    import jax

    from titanax.checkpoint.params_only import UnreadableCheckpoint
    from titanax.config import ConfigError
    from titanax.data.tokenizer import Tokenizer
    from titanax.generate import find_tokenizer, generate, load_for_inference

    try:
        cfg, graphdef, params, step = load_for_inference(args.workdir, args.step,
                                                         devices=jax.local_devices(),
                                                         dtype=args.dtype,
                                                         verify=not args.no_verify)
    except (FileNotFoundError, ConfigError) as e:
        fail(str(e))
    except UnreadableCheckpoint as e:
        stop(str(e))
    tok_path = find_tokenizer(cfg, args.workdir)
    if tok_path is None:
        fail(f"no tokenizer.json for the run in {args.workdir} (synthetic data has none); "
             "generation needs text")
    from titanax.hf.source import eos_ids

    tok = Tokenizer.load(tok_path)
    if args.chat:
        ids = _chat_ids(tok, tok_path, args.prompt, args.system)
    else:
        # A run trained with BOS at each document start is prompted the same way.
        ids = ([tok.bos_id] if cfg.data.bos and tok.bos_id is not None else []) + \
            tok.encode(args.prompt)
    stop_ids = eos_ids(args.workdir, tok.eos_id)  # an imported Instruct model's whole eos list
    try:
        new, printed = [], 0
        sys.stdout.write("" if args.chat else args.prompt)
        for t in generate(cfg, graphdef, params, ids, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed, eos_id=stop_ids,
                          top_k=args.top_k, top_p=args.top_p):
            new.append(t)
            # Decode the whole continuation each time: byte-level BPE tokens are not always
            # whole characters. A trailing U+FFFD may be a character still incomplete: it is
            # held back until the next token completes it (or the end), so what is printed
            # is exactly the decoded continuation.
            text = tok.decode(new)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
        sys.stdout.write(tok.decode(new)[printed:] + "\n")
    except ValueError as e:
        fail(str(e))
    print(f"[{len(new)} tokens from step {step} of {args.workdir}]", file=sys.stderr)


def _check_flags(args) -> None:
    """Before the checkpoint is read (minutes at 70B): one error line per bad flag."""
    if args.max_new_tokens <= 0:
        fail("--max-new-tokens must be > 0")
    if args.temperature < 0:
        fail(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.top_k < 0:
        fail(f"--top-k must be >= 0 (0: every token), got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        fail(f"--top-p must be in (0, 1] (1: every token), got {args.top_p}")
    if args.system is not None and not args.chat:
        fail("--system needs --chat (a system message is part of a chat)")


def _chat_ids(tok, tok_path, prompt: str, system: str | None) -> list[int]:
    """The prompt as a user turn (after the system message) through the chat template beside
    the run's tokenizer, the assistant's turn opened; the template writes the special tokens."""
    from titanax.data.chat import ChatError, ChatTemplate

    template = ChatTemplate.from_folder(tok_path.parent)
    if template is None:
        fail(f"--chat: the run's tokenizer folder {tok_path.parent} has no chat template "
             "(chat_template.jinja or tokenizer_config.json's chat_template); import an "
             "Instruct model's folder, or sample without --chat")
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}]
    try:
        return tok.encode_rendered(template.render(messages, add_generation_prompt=True))
    except ChatError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
