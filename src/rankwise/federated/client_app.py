"""The rankwise Flower ClientApp: local training of the adapter tensors a round asks for.

A client is identified by ``node_config["partition-id"]`` (set by the simulation engine, or by
``flower-supernode --node-config "partition-id=K num-partitions=N"``). It keeps its model in a
per-process cache and, so that nothing is lost when a new process serves it, its adapter in
``Context.state``. It only ever sends the tensors named by the round's plan.

The run config path comes from the app's run config key ``rankwise-config`` (deployment:
``[tool.flwr.app.config]`` / ``flwr run --run-config``) or the environment variable
``RANKWISE_FED_CONFIG`` (``rankwise federated`` sets it for the simulation).
"""
from __future__ import annotations

import os

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from rankwise.federated import keys
from rankwise.federated.payload import from_record, to_record
from rankwise.federated.task import Client, build_client, load_run, local_train
from rankwise.federated.wire import load_tensors

ENV_CONFIG = "RANKWISE_FED_CONFIG"
RUN_CONFIG_KEY = keys.RUN_CONFIG_FILE
_STRUCTURE = keys.STATE_STRUCTURE
_SYNC = keys.STATE_SYNC
_CLIENTS: dict[tuple[str, int], Client] = {}

app = ClientApp()


def config_path(ctx: Context) -> str:
    """The run config file of this run (see module docstring).

    Raises:
        RuntimeError: If neither the run config nor the environment names one.
    """
    path = ctx.run_config.get(RUN_CONFIG_KEY) or os.environ.get(ENV_CONFIG)
    if not path:
        raise RuntimeError(f"no run config: set {RUN_CONFIG_KEY!r} in [tool.flwr.app.config] "
                           f"or the environment variable {ENV_CONFIG}")
    return str(path)


def _partition_id(ctx: Context) -> int:
    if keys.PARTITION not in ctx.node_config:
        raise RuntimeError("this SuperNode has no partition-id; start it with "
                           "--node-config 'partition-id=K num-partitions=N'")
    return int(ctx.node_config[keys.PARTITION])


def get_client(ctx: Context) -> Client:
    """This node's client: the process cache's model (else a new one) set to the node's own
    adapter from ``Context.state``.

    The state is loaded every time, not only when the model is rebuilt: the simulation may
    have served this node from another process since this one last did, and this process's
    copy then holds tensors the server will not send again (what the node received or trained
    elsewhere). A cached client of another run is replaced.
    """
    path = config_path(ctx)
    _, _, key = load_run(path)
    pid = _partition_id(ctx)
    client = _CLIENTS.get((key, pid))
    if client is not None and (client.run_id != ctx.run_id or (
            client.rounds_trained and keys.STATE not in ctx.state.array_records)):
        client = None  # a new run with the same config in this process: start fresh
    if client is None:
        client = build_client(path, pid)
        client.run_id = ctx.run_id
        _CLIENTS[(key, pid)] = client
    if _STRUCTURE in ctx.state.config_records:  # the model structure its strategy gave it
        client.strategy.prepare_model(client.model, dict(ctx.state.config_records[_STRUCTURE]))
    if keys.STATE in ctx.state.array_records:
        load_tensors(client.params(), from_record(ctx.state.array_records[keys.STATE]))
    return client


def _corrupt(sent: dict, kind: str) -> dict:
    """Fault injection (``federated.faults``): make a malformed update on purpose."""
    name = next(iter(sent))
    if kind == "nan":
        sent[name] = sent[name].clone().fill_(float("nan"))
    elif kind == "shape":
        sent[name] = sent[name][:-1].clone()
    elif kind == "keys":
        sent[name + ".bad"] = sent.pop(name)
    return sent


def _check_sync(client: Client, ctx: Context, cfg_rec: dict) -> None:
    """Refuse to train on an adapter copy that differs from what the server assumes.

    Raises:
        RuntimeError: Marked ``rankwise-resync`` when this node's copy is older/newer than the
            server believes (the server then sends everything), or when the initial adapter's
            fingerprint differs from the server's (a different model, method or seed).
    """
    from rankwise.federated.strategies.base import fingerprint
    stored = int(ctx.state.config_records[_SYNC][keys.SYNC_ROUND]) if _SYNC in ctx.state.config_records else 0
    if cfg_rec.get(keys.FULL_SYNC):
        return
    if stored != int(cfg_rec.get(keys.SYNC_ROUND, 0)):
        raise RuntimeError(f"{keys.RESYNC_REASON}: this node holds the adapter of round {stored}, "
                           f"the server assumed round {cfg_rec.get(keys.SYNC_ROUND)}")
    expected = cfg_rec.get(keys.INIT_FINGERPRINT)
    if expected and stored == 0:
        mine = fingerprint({k: p.detach() for k, p in client.params().items()})
        if mine != expected:
            raise RuntimeError(f"initial adapter fingerprint {mine} differs from the server's {expected}: "
                               "every node must use the same run config (model, method, train.seed)")


@app.train()
def train(msg: Message, ctx: Context) -> Message:
    """Load the received global tensors, train the planned ones, reply with them.

    The strategy's class-level hooks restructure the model (``prepare_model``), choose what
    trains and add loss terms (inside :func:`local_train`), and add metrics (``client_metrics``).

    Returns:
        A reply with the trained tensors (``arrays``) and ``metrics`` (examples, loss, partition,
        and the strategy's own entries).

    Raises:
        RuntimeError: On purpose when this partition is configured to ``crash``.
    """
    client = get_client(ctx)
    fault = client.fed.faults.get(str(client.partition_id))
    if fault == "crash":
        raise RuntimeError(f"fault injection: partition {client.partition_id} crashes")
    cfg_rec = dict(msg.content.config_records[keys.CONFIG])
    _check_sync(client, ctx, cfg_rec)
    strategy = client.strategy
    strategy.prepare_model(client.model, cfg_rec)
    load_tensors(client.params(), from_record(msg.content.array_records[keys.ARRAYS]))
    ctx.state[_SYNC] = ConfigRecord({keys.SYNC_ROUND: int(cfg_rec[keys.ROUND])})
    before = strategy.pre_train_metrics(client, cfg_rec)  # on the global model just received
    sent, metrics = local_train(client, cfg_rec)
    metrics.update(before)
    metrics.update(strategy.client_metrics(client, cfg_rec))
    ctx.state[keys.STATE] = to_record(client.params())
    structure = strategy.model_structure(cfg_rec)
    if structure:
        ctx.state[_STRUCTURE] = ConfigRecord(structure)
    if fault:
        sent = _corrupt(sent, fault)
    content = RecordDict({keys.ARRAYS: to_record(sent), keys.METRICS: MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.query()
def query(msg: Message, ctx: Context) -> Message:
    """Answer a strategy's query (LEFF stage 1: capacity and per-layer importance) with the
    strategy's ``answer_query`` hook; the partition id is always included. An ``identify``
    query (the server ordering nodes by partition) is answered without building the model."""
    cfg = dict(msg.content.config_records[keys.CONFIG]) if keys.CONFIG in msg.content.config_records else {}
    if cfg.get(keys.PHASE) == keys.IDENTIFY:
        metrics = {keys.PARTITION: _partition_id(ctx)}
        return Message(content=RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)
    client = get_client(ctx)
    metrics = {**client.strategy.answer_query(client, cfg, dict(ctx.node_config)),
               keys.PARTITION: client.partition_id}
    return Message(content=RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)


__all__ = ["app", "get_client", "config_path"]
