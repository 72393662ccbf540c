"""python -m launch.eval --workdir DIR --tasks NAME [NAME ...] [--include-path DIR ...]
                        [--step N] [--batch-size B] [--limit N] [--num-fewshot K] [--log-samples]
                        [--out DIR] [--apply-chat-template [--fewshot-as-multiturn]]
                        [--system-instruction TEXT] [--no-verify]
Evaluates a run's checkpoint with lm-evaluation-harness (the `eval` extra) through titanax's
adapter of its LM interface: parameters only, sharded over this machine's devices. Writes
DIR/eval/step<N>-<time>.json (or into --out), again after each task, so what finished is kept,
and prints lm-eval's table. Offline tasks shipped with titanax:
titanax_tiny_mc, titanax_tiny_ppl, titanax_tiny_gen; lm-eval's own (hellaswag, arc_easy, mmlu,
...) need its dataset hub. The step is first checked against its manifest (a damaged one: one
line, exit 1; --no-verify skips it); results written into the run folder are written holding
its lock (exit 75 beside a live run, nothing written)."""

from __future__ import annotations

import argparse

from launch.common import fail, stop

EXIT_LOCKED = 75  # as launch.train: another live command holds the run the results go into


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="run folder holding checkpoints/")
    p.add_argument("--tasks", required=True, nargs="+",
                   help="task names (space- or comma-separated)")
    p.add_argument("--include-path", action="append", default=[],
                   help="a folder of lm-eval task YAML (repeatable)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--limit", type=int, default=None, help="at most this many documents a task")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--log-samples", action="store_true",
                   help="also write every request's inputs and scores to the JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--apply-chat-template", action="store_true",
                   help="render each prompt through the run's chat template (lm-eval's "
                        "apply_chat_template; an Instruct model's way)")
    p.add_argument("--fewshot-as-multiturn", action="store_true",
                   help="few-shot examples as chat turns (with --apply-chat-template)")
    p.add_argument("--system-instruction", default=None, help="a system message for every prompt")
    p.add_argument("--no-verify", action="store_true",
                   help="skip checking the step's files against its manifest (CRC-32 of every "
                        "byte of the step, read once) before evaluating it")
    p.add_argument("--out", default=None,
                   help="folder for the results JSON (default DIR/eval; a read-only run "
                        "folder needs one)")
    args = p.parse_args(argv)
    tasks = [t for arg in args.tasks for t in arg.split(",") if t]
    if args.batch_size < 1:
        fail("--batch-size must be >= 1")
    if args.limit is not None and args.limit < 1:
        fail(f"--limit must be >= 1 (documents a task), got {args.limit}; leave it out for "
             "every document")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        fail("lm-evaluation-harness is not installed: pip install -c constraints.txt -e '.[eval]'")

    from lm_eval.utils import make_table

    from titanax.checkpoint.params_only import UnreadableCheckpoint
    from titanax.eval.run import evaluate
    from titanax.train.workdir_lock import WorkdirLocked

    try:
        results, path = evaluate(args.workdir, tasks, include_paths=args.include_path,
                                 step=args.step, batch_size=args.batch_size, limit=args.limit,
                                 num_fewshot=args.num_fewshot, log_samples=args.log_samples,
                                 seed=args.seed, out_dir=args.out,
                                 apply_chat_template=args.apply_chat_template,
                                 fewshot_as_multiturn=args.fewshot_as_multiturn,
                                 system_instruction=args.system_instruction,
                                 verify=not args.no_verify)
    except WorkdirLocked as e:  # results into a run a live command holds: nothing written
        fail(f"{e} (or write the results elsewhere with --out DIR)", EXIT_LOCKED)
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        fail(str(e))
    except UnreadableCheckpoint as e:
        stop(str(e))
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(f"[step {results['titanax']['step']} of {args.workdir}; results in {path}]")


if __name__ == "__main__":
    main()
