"""The runs of a comparison: which folder is whose, when a finished run can be reused, and
running several at once.

A comparison (``rankwise compare``) marks each run folder it owns with ``compare_plan.json``:
the raw plan the run was made from and the SHA-256 of its *resolved* config
(:func:`config_hash`: every default filled in, local paths relative to the working folder,
``train.progress`` left out). A finished run is reused when its ``metrics.json`` is there and the
hash still matches, so the small files of a run (``compare_plan.json``, ``config.yaml``,
``metrics.json``, ``events.jsonl``; no weights) are enough to resume a long comparison on
another machine, and a changed setting or default never reuses a stale result. An interrupted
run of the same hash continues from its newest checkpoint; anything else is started again.

:func:`run_all` trains runs one after another or, with ``jobs > 1``, in that many worker
processes (spawned, so each starts clean), each with ``cores / jobs`` torch threads on CPU or
its own GPU (``CUDA_VISIBLE_DEVICES``) with CUDA; the parent prints one progress line per run.
One process (or worker) trains run after run with flat memory: nothing of a finished run stays
alive (the CPU memory meter used to keep every step's profiler events until a full garbage
collection, :mod:`rankwise.memory`; one compare grew to 24 GB over 9 MiniLM runs), so a long
comparison needs no fresh process per run
(``tests/recipes/test_compare_runs.py::test_one_compare_process_keeps_its_memory_flat...``).
Ctrl-C interrupts every worker (each writes its checkpoint) and leaves finished runs reusable.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from rankwise.core import atomic
from rankwise.errors import RankwiseError

PLAN = "compare_plan.json"
NOT_RESULTS = (("train", "progress"), ("train", "threads"))  # how a run reports, not what it computes
# Keys added after runs were recorded, at the value that changes nothing: left out of the hash,
# so a new feature's default does not make every recorded run stale.
NEUTRAL_NEW = ((("model", "add_tokens"), []), (("model", "add_special_tokens"), []),
               (("method", "trainable_tokens"), None), (("method", "target_parameters"), []),
               (("method", "use_dora"), False), (("train", "offload_activations"), False),
               (("method", "loftq_iter"), 1), (("method", "eva_rho"), 2.0),  # LoRA inits
               (("method", "corda_mode"), "ipm"),
               (("train", "fused_lora"), "auto"),
               (("train", "loss_chunk_tokens"), "auto"), (("optim", "per_layer"), False),  # memory
               (("optim", "state_bits"), None),
               (("data", "select"), lambda v: not v.get("method") and not v.get("from_")),  # all data
               (("data", "chosen_field"), "chosen"), (("data", "rejected_field"), "rejected"),  # dpo
               (("data", "schedule"), "none"), (("data", "schedule_linear"), None),  # skrull
               (("data", "schedule_bucket"), None),
               (("train", "compile"), False), (("train", "compile_buckets"), "pow2"),
               (("train", "distributed_step_timeout_s"), None),
               (("compress", "restore"), lambda v: not isinstance(v, dict) or not v.get("enabled")),  # RestoreLCC off
               (("data", "order"), "uniform"),  # grpo / gain-rl
               (("data", "question_free"), False), (("data", "question_free_eos"), False),  # qfft
               (("data", "split_long"), False), (("model", "init"), "auto"),  # pretraining
               (("model", "train_tokenizer"), None), (("model", "adapter"), None),
               (("optim", "loraplus_lr_ratio"), None), (("optim", "loraplus_lr_embedding"), 1e-6),
               (("train", "neftune_noise_alpha"), None))


def config_hash(raw: dict) -> str:
    """SHA-256 of the resolved run config of ``raw`` (see the module docstring).

    Raises:
        RankwiseError: If ``raw`` is not a valid run config.
    """
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.legacy import old_shape
    resolved = json.loads(json.dumps(build_run_config(copy.deepcopy(raw)).to_dict(), default=str))
    resolved = old_shape(resolved)  # the task as model.task + its side section: recorded runs still match
    for section, key in NOT_RESULTS:
        (resolved.get(section) or {}).pop(key, None)
    for (section, key), neutral in NEUTRAL_NEW:
        value = (resolved.get(section) or {}).get(key, neutral)
        if neutral(value) if callable(neutral) else value == neutral:
            (resolved.get(section) or {}).pop(key, None)
    cwd = Path.cwd().resolve()
    for section, key in (("model", "path"), ("data", "source"), ("data", "eval_source")):
        value = (resolved.get(section) or {}).get(key)
        if isinstance(value, str) and Path(value).is_absolute() and Path(value).is_relative_to(cwd):
            resolved[section][key] = Path(value).relative_to(cwd).as_posix()  # same on any checkout
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()


def read_plan(run_dir: Path) -> tuple[Any, str | None]:
    """``(raw plan, config hash)`` a folder was marked with (``(None, None)`` if unmarked; an
    older marker without a hash gives ``(plan, None)``)."""
    try:
        saved = json.loads((Path(run_dir) / PLAN).read_text())
    except (OSError, ValueError):
        return None, None
    if isinstance(saved, dict) and set(saved) == {"plan", "config_sha256"}:
        return saved["plan"], saved["config_sha256"]
    return saved, None


def _comparable(raw: Any) -> Any:
    """A plan in the new spelling, without the settings that do not change results
    (:data:`NOT_RESULTS`), so a comparison resumed with another ``--set train.threads=...``, or
    with its config moved from ``model.task`` to ``task:``, still owns its folders."""
    if not isinstance(raw, dict):
        return raw
    from rankwise.recipes.legacy import translate
    out = json.loads(json.dumps(translate(raw).data))  # the task's old spelling owns its folders too
    for section, key in NOT_RESULTS:
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
            if not out[section]:
                del out[section]
    return out


def check_owned(run_dir: Path, raw: dict) -> None:
    """Raise unless ``run_dir`` is absent, empty, or marked with this very plan (up to the
    settings that do not change results)."""
    run_dir = Path(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        if _comparable(read_plan(run_dir)[0]) != _comparable(raw):
            raise RankwiseError(f"{run_dir} holds a run that is not this comparison's (no matching "
                                f"{PLAN}); choose another --out or move that folder away")


def run_one(raw: dict, run_dir: Path, console, quiet: bool = False) -> dict:
    """Train one run of a comparison into ``run_dir``, or reuse / continue it (module docstring).

    Args:
        raw: The run's raw config.
        run_dir: Its folder.
        console: A ``rich`` console.
        quiet: No progress bar (a worker of :func:`run_all`; the parent reports progress).

    Returns:
        The run's ``metrics.json``.
    """
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.checkpoint import list_checkpoints
    from rankwise.recipes.train import train

    run_dir = Path(run_dir)
    cfg = build_run_config(copy.deepcopy(raw))
    if quiet:
        cfg.train.progress = False
    digest = config_hash(raw)
    check_owned(run_dir, raw)
    resume = False
    if run_dir.exists() and any(run_dir.iterdir()):
        same = read_plan(run_dir)[1] == digest
        if same and (run_dir / "metrics.json").is_file():
            console.print(f"{run_dir}: finished earlier with the same resolved config, reusing metrics.json")
            return json.loads((run_dir / "metrics.json").read_text())
        if same and list_checkpoints(run_dir):
            console.print(f"{run_dir}: interrupted earlier with the same resolved config, resuming")
            resume = True
        else:  # a stale or never-checkpointed run of this comparison: start it again
            shutil.rmtree(run_dir)
    if not resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic.write_json(run_dir / PLAN, {"plan": json.loads(json.dumps(raw)), "config_sha256": digest})
    return train(cfg, run_dir, resume=resume, console=console)


def _init_worker(threads: int, devices: Any) -> None:
    """Worker set-up: its share of the CPU threads, or one GPU of ``devices`` (a queue)."""
    import signal

    import torch
    if devices is not None:  # one GPU of the pool per worker (workers live for the whole run)
        os.environ["CUDA_VISIBLE_DEVICES"] = str(devices.get())
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _work(raw: dict, run_dir: str) -> dict:
    from rich.console import Console
    return run_one(raw, Path(run_dir), Console(stderr=True, quiet=True), quiet=True)


def _last_step(run_dir: Path) -> int:
    """The newest step in ``run_dir/events.jsonl`` (its tail only; 0 if none yet)."""
    path = run_dir / "events.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError, TypeError):
            continue
    return 0


def run_all(jobs: list[tuple[str, dict, Path]], n_jobs: int, console) -> list[dict]:
    """Run ``[(label, raw config, run folder)]`` and return their metrics in the same order.

    Args:
        jobs: The runs.
        n_jobs: How many at once (1: in this process, one after another).
        console: A ``rich`` console.

    Raises:
        RankwiseError: If ``n_jobs`` < 1 or a run fails (the first failure, naming its folder).
        KeyboardInterrupt: On Ctrl-C, after every worker wrote its checkpoint.
    """
    if n_jobs < 1:
        raise RankwiseError(f"--jobs: got {n_jobs}; expected an integer >= 1")
    if n_jobs == 1 or len(jobs) <= 1:
        out = []
        for label, raw, run_dir in jobs:
            console.print(f"[bold]{label}[/]")
            out.append(run_one(raw, run_dir, console))
        return out
    return _run_parallel(jobs, min(n_jobs, len(jobs)), console)


def _run_parallel(jobs: list[tuple[str, dict, Path]], n_jobs: int, console) -> list[dict]:
    import multiprocessing
    import signal
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rankwise.engine.threads import auto_threads
    from rankwise.recipes.config import build_run_config
    ctx = multiprocessing.get_context("spawn")
    devices = None
    if torch.cuda.is_available():
        devices = ctx.Queue()
        for k in range(n_jobs):
            devices.put(k % torch.cuda.device_count())
    threads = auto_threads(n_jobs)  # cores (affinity, cgroup quota) shared by the jobs
    results: dict[int, dict] = {}
    # workers live for the whole comparison (their memory stays flat from run to run; a fresh
    # worker per run, max_tasks_per_child=1, hung on Ctrl-C while replacements started)
    pool = ProcessPoolExecutor(n_jobs, mp_context=ctx, initializer=_init_worker,
                               initargs=(threads, devices))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as bars:
        tasks = {i: bars.add_task(label, total=build_run_config(copy.deepcopy(raw)).train.steps)
                 for i, (label, raw, _) in enumerate(jobs)}
        futures = {pool.submit(_work, raw, str(run_dir)): i for i, (_, raw, run_dir) in enumerate(jobs)}
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for fut in done:
                    i = futures[fut]
                    err = fut.exception()
                    if isinstance(err, KeyboardInterrupt):  # Ctrl-C reached the worker first
                        raise KeyboardInterrupt
                    if err is not None:
                        raise RankwiseError(f"{jobs[i][2]}: {err or type(err).__name__}") from None
                    results[i] = fut.result()
                    bars.update(tasks[i], completed=bars.tasks[tasks[i]].total)
                for fut in pending:
                    i = futures[fut]
                    bars.update(tasks[i], completed=_last_step(Path(jobs[i][2])))
        except BaseException:
            for p in list(getattr(pool, "_processes", {}).values()):  # each worker checkpoints
                if p.is_alive():
                    os.kill(p.pid, signal.SIGINT)
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    pool.shutdown(wait=True)
    return [results[i] for i in range(len(jobs))]


__all__ = ["PLAN", "config_hash", "read_plan", "check_owned", "run_one", "run_all"]
