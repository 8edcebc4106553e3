"""The rankwise Flower ServerApp: runs the configured strategy and evaluates centrally.

Writes into the run folder: ``rounds.jsonl`` (one line per round, round 0 = the initial
adapter), ``checkpoints/round-NNNN/`` after every round (a resumed run continues from the
newest, :mod:`rankwise.federated.checkpoint`) and ``metrics.json`` (final global eval metrics, ``rounds``, ``bytes_up``,
``bytes_down``). The folder comes from the run config key ``rankwise-out`` or the environment
variable ``RANKWISE_FED_OUT``.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from flwr.app import Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.core import atomic
from rankwise.engine import evaluate
from rankwise.engine.precision import autocast
from rankwise.engine.threads import use_threads
from rankwise.federated import keys
from rankwise.federated.checkpoint import load_round, save_round
from rankwise.federated.payload import to_record
from rankwise.federated.task import (build_session, initial_state, load_run, majority_share,
                                     partitions)
from rankwise.federated.wire import factor_roles, load_tensors, mark_wire

ENV_OUT = "RANKWISE_FED_OUT"
ENV_RESUME = "RANKWISE_FED_RESUME"  # "1": continue from the newest round checkpoint
OUT_KEY = keys.RUN_OUT
LOG = logging.getLogger("rankwise.federated")

app = ServerApp()


class TrueRounds(logging.Filter):
    """Flower's strategy loop numbers the rounds of the federation it runs from 1, and a resumed
    run starts one for the rounds left: its ``[ROUND 1/3]`` is round 4 of 6. On Flower's logger
    this filter makes those lines (and ``Number of rounds``) say the run's own numbers.

    Args:
        offset: Rounds completed before this federation started.
        total: The run's rounds.
    """

    def __init__(self, offset: int, total: int) -> None:
        super().__init__()
        self.offset, self.total = offset, total

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the round lines in place; every record passes."""
        msg, args = str(record.msg), record.args
        if "[ROUND" in msg and isinstance(args, tuple) and len(args) == 2:
            record.msg, record.args = "[ROUND %s/%s]", (int(args[0]) + self.offset, self.total)
        elif "Number of rounds" in msg and isinstance(args, tuple) and len(args) == 1:
            record.msg = msg.replace("%d", "%d of %d (resumed after round %d)")
            record.args = (args[0], self.total, self.offset)
        return True


class Evaluator:
    """Central evaluation of a strategy's views on the run's evaluation split (under
    ``train.precision``'s autocast and on ``train.threads`` threads, as ``rankwise train``
    evaluates).

    A view ``(tensors, config, partitions)`` is evaluated on all examples (``partitions`` is
    ``None``) or on the examples whose label belongs mostly to those partitions' training data
    (FedLEASE's per-cluster models); the reported accuracy is over all evaluated examples. The
    model a view needs comes from the strategy (``eval_model``, ``wire_parameters``).

    Args:
        cfg: The run config.
        fed: The federated settings.

    Attributes:
        majority: The share of the evaluation split's most frequent label (``None`` without
            labels): the accuracy a model that always predicts it gets.
    """

    def __init__(self, cfg, fed) -> None:
        self.cfg, self.fed = cfg, fed
        self.session = build_session(cfg, fed)
        self.names = [n for n, p in self.session.model.named_parameters() if p.requires_grad]
        mark_wire(self.session.model, self.names)
        self.roles = factor_roles(self.session.model)
        data = self.session.train_data
        parts = partitions(cfg, fed, data)
        self.owner: dict[int, int] = {}
        if data.labels is not None:
            counts: dict[int, dict[int, int]] = {}
            for k, idx in enumerate(parts):
                for i in idx:
                    counts.setdefault(data.labels[i], {}).setdefault(k, 0)
                    counts[data.labels[i]][k] += 1
            self.owner = {lab: max(c, key=c.get) for lab, c in counts.items()}
        self.majority = majority_share(self.session.eval_data.labels)

    def initial(self) -> dict:
        """The initial global adapter."""
        return initial_state(self.session)

    def __call__(self, strategy) -> dict[str, float]:
        """Evaluate every view of ``strategy``; return the example-weighted metrics
        (``eval_loss`` and the task's own, e.g. ``eval_accuracy``)."""
        ev, task = self.session.eval_data, self.session.task
        totals: dict[str, float] = {}
        count = 0
        for state, extra, parts in strategy.eval_views():
            model = strategy.eval_model(self.session.model, extra)
            load_tensors(strategy.wire_parameters(model), state)
            idx = list(range(len(ev)))
            if parts is not None and ev.labels is not None:
                idx = [i for i in idx if self.owner.get(ev.labels[i]) in parts]
            if not idx:
                continue
            t, device = self.cfg.train, self.session.device
            with use_threads(t.threads):  # under train.precision, as rankwise train evaluates
                res = evaluate(model, task, ev.subset(idx), t.eval_batch_size, device,
                               lambda: autocast(t.precision, device))
            for k, v in res.items():
                totals[k] = totals.get(k, 0.0) + v * len(idx)
            count += len(idx)
        return {k: v / max(count, 1) for k, v in totals.items()}


def build_strategy(cfg, fed, initial: dict, roles: dict[str, str]):
    """Instantiate the configured strategy with the run's local-training settings.

    Args:
        cfg: The run config.
        fed: The federated settings.
        initial: The initial global tensors.
        roles: ``{name: "A" | "B"}`` of the factors among them (from the server's model).

    Returns:
        The strategy.

    Raises:
        RankwiseError: Unknown strategy or bad strategy options.
    """
    entry = registry.get("strategy", fed.strategy_name())
    scfg = from_dict(entry.config_cls, {"name": entry.name, **fed.strategy_options()}, "federated.strategy")
    train_config = {keys.TRAIN_STEPS: fed.local_steps, keys.LEARNING_RATE: float(fed.lr or cfg.optim.lr)}
    return entry.builder(scfg, fed, initial, train_config, roles=roles)


def run_server(grid: Grid, config_path: str, out: str | Path, resume: bool = False) -> dict:
    """Run a whole federation on ``grid`` and write the run folder, with a checkpoint after
    every round (:mod:`rankwise.federated.checkpoint`).

    Args:
        grid: Flower's Grid (simulation or deployment).
        config_path: The run config with a ``federated`` section.
        out: The run folder.
        resume: Continue from the newest round checkpoint in ``out``.

    Returns:
        The metrics written to ``metrics.json``.

    Raises:
        RankwiseError: ``resume`` without a checkpoint, or one of another strategy.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, fed, _ = load_run(config_path)
    evaluator = Evaluator(cfg, fed)
    strategy = build_strategy(cfg, fed, evaluator.initial(), evaluator.roles)
    num_rounds = strategy.num_rounds(fed.rounds)
    lines: list[dict] = []
    prior = 0.0
    if resume:
        strategy.round_offset, lines, prior = load_round(out, strategy)
        LOG.info("resuming after round %d of %d", strategy.round_offset, num_rounds)
    began = time.perf_counter() - prior
    rounds_path = out / "rounds.jsonl"
    atomic.write_bytes(rounds_path, "".join(json.dumps(e) + "\n" for e in lines).encode())

    def evaluate_fn(server_round: int, _arrays) -> MetricRecord:
        if server_round == 0 and strategy.round_offset:  # evaluated before the interruption
            return MetricRecord({k: float(v) for k, v in lines[-1].items() if k.startswith("eval_")})
        server_round += strategy.round_offset
        metrics = evaluator(strategy)
        entry = dict(strategy.history[-1]) if server_round > 0 and strategy.history else {
            "round": 0, "bytes_up": 0, "bytes_down": 0}
        entry.update({k: round(v, 6) for k, v in metrics.items()})
        prev = lines[-1]["cum_bytes"] if lines else 0
        entry["cum_bytes"] = prev + entry["bytes_up"] + entry["bytes_down"]
        entry["time_s"] = round(time.perf_counter() - began, 2)
        lines.append(entry)
        with rounds_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        if server_round > 0:
            save_round(out, server_round, strategy, lines, time.perf_counter() - began,
                       keep=cfg.train.keep_checkpoints)
        LOG.info("round %d: %s", server_round, metrics)
        return MetricRecord({k: float(v) for k, v in metrics.items()})

    rounds = TrueRounds(strategy.round_offset, num_rounds)
    flower_log = logging.getLogger("flwr")
    if strategy.round_offset:  # a fresh run's numbers are already the run's
        flower_log.addFilter(rounds)
    try:
        strategy.start(grid=grid, initial_arrays=to_record(strategy.global_state),
                       num_rounds=num_rounds - strategy.round_offset, timeout=fed.round_timeout,
                       evaluate_fn=evaluate_fn)
    finally:
        flower_log.removeFilter(rounds)
    final = {k: v for k, v in lines[-1].items() if k.startswith("eval_")}
    metrics = {**final, "strategy": strategy.name, "rounds": num_rounds, "clients": fed.clients,
               "partition": fed.partition, "method": cfg.method.name,
               "bytes_up": sum(e["bytes_up"] for e in lines), "bytes_down": sum(e["bytes_down"] for e in lines),
               "initial_eval_accuracy": lines[0].get("eval_accuracy"),
               "majority_accuracy": evaluator.majority,
               "failed": sorted({n for e in lines for n in e.get("failed", [])}),
               "missing": sorted({n for e in lines for n in e.get("missing", [])}),
               "rejected": sorted({n for e in lines for n in e.get("rejected", [])}),
               "wall_time_s": round(time.perf_counter() - began, 2)}
    if strategy.round_offset:
        metrics["resumed_after_round"] = strategy.round_offset
    metrics["bytes_total"] = metrics["bytes_up"] + metrics["bytes_down"]
    metrics.update(strategy.run_metrics())
    atomic.write_json(out / "metrics.json", metrics)
    return metrics


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point (simulation and deployment)."""
    from rankwise.federated.client_app import ENV_CONFIG, RUN_CONFIG_KEY
    path = context.run_config.get(RUN_CONFIG_KEY) or os.environ.get(ENV_CONFIG)
    out = context.run_config.get(OUT_KEY) or os.environ.get(ENV_OUT)
    if not path or not out:
        raise RuntimeError(f"set {RUN_CONFIG_KEY!r} and {OUT_KEY!r} in the run config "
                           f"(or {ENV_CONFIG} and {ENV_OUT})")
    run_server(grid, str(path), str(out), resume=os.environ.get(ENV_RESUME) == "1")
