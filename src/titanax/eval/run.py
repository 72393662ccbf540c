"""One evaluation of a run's checkpoint: restore the parameters (sharded over the local devices,
as launch.generate does), wrap them in TitanaxLM, run lm-eval's simple_evaluate on the named
tasks, and write the results to WORKDIR/eval/step<N>-<time>.json."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time

TASKS_DIR = pathlib.Path(__file__).resolve().parent / "tasks"


def task_manager(include_paths=(), tasks=()):
    """lm-eval's TaskManager over titanax's offline tasks and `include_paths`; lm-eval's own
    task catalogue (thousands of YAML files, seconds to index) only when a requested task is
    not found in those folders."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR), *(str(p) for p in include_paths)]
    for p in paths[1:]:
        if not pathlib.Path(p).is_dir():
            raise FileNotFoundError(f"--include-path {p}: no such folder")
    local = TaskManager(include_path=paths, include_defaults=False)
    if all(t in local.all_tasks for t in tasks):
        return local
    manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; titanax's offline tasks: "
                         f"{sorted(local.all_tasks)}; add folders of task YAML with "
                         f"--include-path")
    return manager


# datasets' packaged builders: they read files the task must name (dataset_kwargs' data_files,
# or a data_dir), e.g. `dataset_path: json`. Without them datasets fails only after the model
# has loaded, with tracebacks; check_task_files refuses at task load instead.
_FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "xml")


def check_task_files(manager, tasks) -> None:
    """ValueError naming the task's YAML and the missing key, for a requested task (or a task
    of a requested group) whose dataset_path is a file builder given no data_files."""
    from lm_eval.tasks._yaml_loader import load_yaml

    seen, todo = set(), list(tasks)
    while todo:
        name = todo.pop()
        entry = manager.task_index.get(name) if isinstance(name, str) else None
        if entry is None or name in seen or entry.yaml_path is None:
            continue
        seen.add(name)
        try:
            cfg = load_yaml(entry.yaml_path, resolve_func=False, recursive=True)
        except Exception:  # lm-eval reports a YAML it cannot read itself
            continue
        members = cfg.get("task")
        if isinstance(members, list):  # a group: its tasks named by string
            todo.extend(m for m in members if isinstance(m, str))
            continue
        kwargs = cfg.get("dataset_kwargs") or {}
        if (cfg.get("dataset_path") in _FILE_BUILDERS and "custom_dataset" not in cfg
                and not (isinstance(kwargs, dict) and ("data_files" in kwargs
                                                       or "data_dir" in kwargs))):
            raise ValueError(
                f"task {name!r} ({entry.yaml_path}): dataset_path: {cfg['dataset_path']} reads "
                "local files, but the task names none (no dataset_kwargs.data_files); add "
                "dataset_kwargs: {data_files: {test: /path/to/test.jsonl}} (its split named "
                "as test_split), or use custom_dataset as titanax's tasks do")


def load_model(workdir, *, step=None, batch_size=16, devices=None, seed=0, chat=False,
               verify=True):
    """(TitanaxLM, step) for the run in `workdir`. chat: the run's chat template is needed
    (ValueError naming the folder when its tokenizer has none). verify: the step's files are
    checked against its manifest first (generate.load_for_inference; DamagedCheckpoint)."""
    import jax
    from tokenizers import Tokenizer as HFTokenizer

    from titanax.data.tokenizer import Tokenizer
    from titanax.eval.lm import TitanaxLM
    from titanax.generate import find_tokenizer, load_for_inference

    cfg, graphdef, params, step = load_for_inference(
        workdir, step, devices=jax.local_devices() if devices is None else devices,
        verify=verify)
    tok_path = find_tokenizer(cfg, workdir)
    if tok_path is None:
        raise FileNotFoundError(f"no tokenizer.json for the run in {workdir} (synthetic data has "
                                "none); evaluation needs text")
    from titanax.data.chat import ChatTemplate

    template = ChatTemplate.from_folder(tok_path.parent)
    if chat and template is None:
        raise ValueError(f"--apply-chat-template: the run's tokenizer folder {tok_path.parent} "
                         "has no chat template (chat_template.jinja or tokenizer_config.json's "
                         "chat_template)")
    ids = Tokenizer.load(tok_path)  # the run's eos/bos, found as training found them
    # A plain tokenizers.Tokenizer, as transformers loads it: special tokens written in the text
    # are recognised, and the post-processor adds BOS where the tokenizer says so.
    lm = TitanaxLM(cfg, graphdef, params, HFTokenizer.from_file(str(tok_path)),
                   eos_id=ids.eos_id, bos_id=ids.bos_id, batch_size=batch_size, seed=seed,
                   chat=template, tokenizer_name=str(tok_path.parent).replace("/", "__"))
    return lm, step


def _writable(out_dir: pathlib.Path) -> None:
    """Fails now, not after hours of evaluation, where the results cannot be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".probe{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"cannot write the results to {out_dir} ({e.strerror}); give "
                         "--out DIR, a writable folder") from None


def _merge(into: dict, results: dict) -> dict:
    """lm-eval's results of one more task added to those so far (its per-task tables)."""
    for key, value in results.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key].update(value)
        else:
            into[key] = value
    return into


class TaskDataUnavailable(ValueError):
    """A task's dataset could not be loaded: the hub is unreachable and it is not cached."""


def _no_task_data(task: str, e: ConnectionError) -> str:
    from datasets import config as datasets_config

    return (f"task {task!r}: {str(e).splitlines()[0]}: lm-eval reads this task's data from the "
            f"Hugging Face Hub; run it once with network to fill the cache "
            f"({datasets_config.HF_DATASETS_CACHE}; HF_HOME moves it), after which "
            "HF_DATASETS_OFFLINE=1 / HF_HUB_OFFLINE=1 runs read it alone, or give a local "
            "task with --include-path")


def evaluate(workdir, tasks: list[str], *, include_paths=(), step=None, batch_size=16,
             limit=None, num_fewshot=None, log_samples=False, devices=None, seed=0,
             out_dir=None, apply_chat_template=False, fewshot_as_multiturn=False,
             system_instruction=None, verify=True):
    """(results as lm-eval returns them, path of the JSON written). The JSON holds lm-eval's
    results, configs and versions, the checkpoint step, and (log_samples) every request's
    scores. It is written after each task (titanax.tasks_done lists those in it so far), so
    a failure or a kill midway keeps what was finished. out_dir: default WORKDIR/eval.
    apply_chat_template, fewshot_as_multiturn, system_instruction: lm-eval's own options
    (prompts rendered through the run's chat template, as for an Instruct model).
    verify: the step's files are checked against its manifest before its weights are used."""
    if not tasks:
        raise ValueError("name at least one task (--tasks)")
    manager = task_manager(include_paths, tasks)
    check_task_files(manager, tasks)  # before the model loads: seconds, not minutes
    if fewshot_as_multiturn and not apply_chat_template:
        raise ValueError("--fewshot-as-multiturn needs --apply-chat-template")
    out_dir = pathlib.Path(out_dir) if out_dir is not None else pathlib.Path(workdir) / "eval"
    # Results written into a run folder (the default, WORKDIR/eval) are written holding its
    # lock, as training holds it: beside a live run, WorkdirLocked before anything is read or
    # written (launch.eval: exit 75; --out elsewhere evaluates beside it).
    from titanax.config import ConfigError
    from titanax.train.workdir_lock import enclosing_run, workdir_lock

    run = enclosing_run(out_dir)
    with contextlib.ExitStack() as held:
        if run is not None:
            try:
                held.enter_context(workdir_lock(run))
            except ConfigError:  # a read-only run folder: the error names --out
                _writable(out_dir)
        return _evaluate(workdir, tasks, manager, out_dir, step=step, batch_size=batch_size,
                         limit=limit, num_fewshot=num_fewshot, log_samples=log_samples,
                         devices=devices, seed=seed, apply_chat_template=apply_chat_template,
                         fewshot_as_multiturn=fewshot_as_multiturn,
                         system_instruction=system_instruction, verify=verify)


def _evaluate(workdir, tasks, manager, out_dir, *, step, batch_size, limit, num_fewshot,
              log_samples, devices, seed, apply_chat_template, fewshot_as_multiturn,
              system_instruction, verify):
    from lm_eval import evaluator
    from lm_eval.utils import handle_non_serializable

    lm, step = load_model(workdir, step=step, batch_size=batch_size, devices=devices, seed=seed,
                          chat=apply_chat_template, verify=verify)
    _writable(out_dir)
    path = out_dir / f"step{step}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    results: dict = {}
    for i, task in enumerate(tasks):
        try:
            _merge(results, evaluator.simple_evaluate(
                model=lm, tasks=[task], task_manager=manager, limit=limit,
                num_fewshot=num_fewshot, log_samples=log_samples, random_seed=seed,
                apply_chat_template=apply_chat_template,
                fewshot_as_multiturn=fewshot_as_multiturn,
                system_instruction=system_instruction,
                numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed))
        except ConnectionError as e:  # datasets: the hub unreachable, or offline and not cached
            raise TaskDataUnavailable(_no_task_data(task, e)) from None
        results["titanax"] = {"workdir": str(pathlib.Path(workdir).absolute()), "step": step,
                              "tasks_done": tasks[:i + 1], "tasks": list(tasks)}
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
        os.replace(tmp, path)  # a crash mid-write never leaves half a results file
    return results, path
