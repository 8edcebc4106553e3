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
from rankwise.federated.moe import is_moe, mark_wire, to_moe, wire_parameters
from rankwise.federated.payload import from_record, to_record
from rankwise.federated.task import (Client, build_client, layer_importance, load_run,
                                     load_tensors, local_train)

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


def _ensure_structure(client: Client, cfg_rec: dict) -> None:
    if keys.CLUSTER in cfg_rec and not is_moe(client.model):
        to_moe(client.model, int(cfg_rec[keys.NUM_EXPERTS]), int(cfg_rec[keys.CLUSTER]),
               int(cfg_rec[keys.TOP_M]))


def get_client(ctx: Context) -> Client:
    """This node's client: from the process cache, else rebuilt and restored from ``Context.state``."""
    path = config_path(ctx)
    _, _, key = load_run(path)
    pid = _partition_id(ctx)
    client = _CLIENTS.get((key, pid))
    if client is not None and client.rounds_trained and keys.STATE not in ctx.state.array_records:
        client = None  # a new run with the same config in this process: start fresh
    if client is None:
        client = build_client(path, pid)
        mark_wire(client.model, client.names)
        if _STRUCTURE in ctx.state.config_records:
            _ensure_structure(client, dict(ctx.state.config_records[_STRUCTURE]))
        if keys.STATE in ctx.state.array_records:
            load_tensors(client.model, from_record(ctx.state.array_records[keys.STATE]))
        _CLIENTS[(key, pid)] = client
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
        mine = fingerprint({k: p.detach() for k, p in wire_parameters(client.model).items()})
        if mine != expected:
            raise RuntimeError(f"initial adapter fingerprint {mine} differs from the server's {expected}: "
                               "every node must use the same run config (model, method, train.seed)")


@app.train()
def train(msg: Message, ctx: Context) -> Message:
    """Load the received global tensors, train the planned ones, reply with them.

    Returns:
        A reply with the trained tensors (``arrays``) and ``metrics`` (examples, loss, partition;
        LEFF rounds add the per-layer importance).

    Raises:
        RuntimeError: On purpose when this partition is configured to ``crash``.
    """
    client = get_client(ctx)
    fault = client.fed.faults.get(str(client.partition_id))
    if fault == "crash":
        raise RuntimeError(f"fault injection: partition {client.partition_id} crashes")
    cfg_rec = dict(msg.content.config_records[keys.CONFIG])
    _check_sync(client, ctx, cfg_rec)
    _ensure_structure(client, cfg_rec)
    load_tensors(client.model, from_record(msg.content.array_records[keys.ARRAYS]))
    ctx.state[_SYNC] = ConfigRecord({keys.SYNC_ROUND: int(cfg_rec[keys.ROUND])})
    sent, metrics = local_train(client, cfg_rec)
    if cfg_rec.get(keys.TRAIN_LAYERS):
        metrics[keys.IMPORTANCE] = layer_importance(client)
    ctx.state[keys.STATE] = to_record(wire_parameters(client.model))
    if keys.CLUSTER in cfg_rec:
        ctx.state[_STRUCTURE] = ConfigRecord({k: cfg_rec[k] for k in (keys.CLUSTER, keys.NUM_EXPERTS, keys.TOP_M)})
    if fault:
        sent = _corrupt(sent, fault)
    content = RecordDict({keys.ARRAYS: to_record(sent), keys.METRICS: MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.query()
def query(msg: Message, ctx: Context) -> Message:
    """LEFF stage 1: report capacity (layers this node can train) and per-layer importance.

    Capacity comes from ``node_config["capacity"]`` when the SuperNode sets it, else from the
    strategy's ``capacities`` list indexed by partition id.
    """
    client = get_client(ctx)
    caps = list(msg.content.config_records[keys.CONFIG].get(keys.CAPACITIES, [1]))
    cap = int(ctx.node_config.get(keys.CAPACITY, caps[client.partition_id % len(caps)]))
    metrics = {keys.CAPACITY: cap, keys.IMPORTANCE: layer_importance(client),
               keys.PARTITION: client.partition_id}
    return Message(content=RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)


__all__ = ["app", "get_client", "config_path"]
