"""python -m launch.score --workdir DIR (--text TEXT | --input FILE.jsonl) [--chat] [--step N]
                         [--json OUT] [--no-verify]
The loss, perplexity and per-token log-probabilities of a text, or of every line of a jsonl
({"text": ...}), under the run's checkpoint, as transformers computes them: the tokenizer's
ids (BOS where the tokenizer adds it), log p(token | the tokens before it), the loss their
negative mean. --chat scores conversations ({"messages": [...]} lines, or --text as a JSON list
of messages) rendered through the run's chat template, and reports the loss over the assistant
tokens beside the loss over all. Parameters only, sharded over this machine's devices;
writes nothing but --json (titanax/eval/score.py; docs/guides/evaluate.md)."""

from __future__ import annotations

import argparse
import json
import pathlib

from launch.common import fail, stop


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.score", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="run folder holding checkpoints/")
    p.add_argument("--text", default=None, help="the text to score (with --chat: JSON messages)")
    p.add_argument("--input", default=None, metavar="FILE.jsonl",
                   help="score every line: {\"text\": ...} (with --chat {\"messages\": [...]})")
    p.add_argument("--chat", action="store_true",
                   help="conversations through the run's chat template")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the report here")
    p.add_argument("--no-verify", action="store_true",
                   help="skip checking the step's files against its manifest (CRC-32 of every "
                        "byte of the step, read once) before scoring with it")
    args = p.parse_args(argv)

    from titanax.eval.score import ScoreError, format_report, read_inputs, score

    if not pathlib.Path(args.workdir).is_dir():
        fail(f"--workdir {args.workdir}: no such folder; give a run folder (one that "
             "launch.train or launch.import_hf wrote)")
    if args.json and not pathlib.Path(args.json).absolute().parent.is_dir():
        fail(f"--json {args.json}: its folder does not exist; create it or give another path")
    try:
        records = read_inputs(text=args.text, path=args.input, chat=args.chat)
    except ScoreError as e:
        fail(str(e))

    from titanax.checkpoint.params_only import UnreadableCheckpoint
    from titanax.config import ConfigError

    try:
        report = score(args.workdir, records, step=args.step, verify=not args.no_verify)
    except (FileNotFoundError, ConfigError, ScoreError) as e:
        fail(str(e))
    except UnreadableCheckpoint as e:
        stop(str(e))
    print(format_report(report))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
