"""A federation in this process, without Ray: the ServerApp's :func:`run_server` on a Grid
whose nodes call the ClientApp's handlers directly.

The strategy, the ClientApp code and the run folder are those of ``rankwise federated``; the
clients train one after another in this process (no parallelism, no Ray start-up). Tests use
it to check that runs reproduce and that a node served by another process ends the same; small
experiments use it where Ray's start-up would dominate.
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Iterable

from rankwise.federated import client_app, keys
from rankwise.federated.server_app import run_server
from rankwise.federated.task import load_run

_RUN_IDS = itertools.count(1)


class LocalGrid:
    """Just enough of Flower's ``Grid`` for rankwise strategies, with in-process nodes.

    Each node has its own Flower ``Context`` (``partition-id`` in its node config, the run
    config path in its run config, a ``state`` kept across rounds), as a SuperNode has.

    Args:
        config_path: The run config every node reads.
        node_ids: One node id per partition, in partition order (default ``1 .. clients``);
            Flower's simulation draws random ids, which a run's results must not depend on.
        run_id: The Flower run id the contexts carry (default: a fresh one per grid, so the
            ClientApp's process cache never mixes two runs).
    """

    def __init__(self, config_path: str | Path, node_ids: Iterable[int] | None = None,
                 run_id: int | None = None) -> None:
        from flwr.app import Context, RecordDict
        _, fed, _ = load_run(config_path)
        ids = list(node_ids) if node_ids is not None else list(range(1, fed.clients + 1))
        assert len(ids) == fed.clients, "one node id per partition"
        run_id = run_id if run_id is not None else os.getpid() * 1000 + next(_RUN_IDS)
        self.contexts = {
            node: Context(run_id=run_id, node_id=node, state=RecordDict(),
                          node_config={keys.PARTITION: k, "num-partitions": fed.clients},
                          run_config={client_app.RUN_CONFIG_KEY: str(Path(config_path).resolve())})
            for k, node in enumerate(ids)}

    def get_node_ids(self) -> list[int]:
        """The connected nodes."""
        return list(self.contexts)

    def serve(self, msg):
        """Run the ClientApp handler of ``msg``'s type on its node; an exception becomes an
        error reply, as Flower's ClientApp runtime sends one."""
        from flwr.app import Error, Message, MessageType
        handler = {MessageType.TRAIN: client_app.train, MessageType.QUERY: client_app.query}[
            msg.metadata.message_type.split(".")[0]]
        try:
            return handler(msg, self.contexts[msg.metadata.dst_node_id])
        except Exception as err:  # noqa: BLE001 - the server logs it as a failed node
            return Message(Error(code=2, reason=f"{type(err).__name__}: {err}"), reply_to=msg)

    def send_and_receive(self, messages: Iterable, timeout: float | None = None) -> list:
        """Deliver every message and return the replies (in message order)."""
        return [self.serve(m) for m in messages]


def run_inprocess(config_path: str | Path, out: str | Path, node_ids: Iterable[int] | None = None,
                  grid: LocalGrid | None = None, resume: bool = False) -> dict:
    """Run a whole federation in this process and write the run folder (as the ServerApp does).

    Args:
        config_path: A run config with a ``federated`` section.
        out: The run folder (``rounds.jsonl``, ``metrics.json``).
        node_ids: Node ids of the partitions (see :class:`LocalGrid`).
        grid: A prepared grid (e.g. a subclass that serves nodes from several caches).
        resume: Continue from the newest round checkpoint in ``out``.

    Returns:
        The run's ``metrics.json`` content.
    """
    from flwr.supercore.task_identity import TaskIdentity
    for name in ("run_id", "node_id", "task_id"):  # message ids need a task identity outside Flower
        if getattr(TaskIdentity, f"_{name}") is None:
            setattr(TaskIdentity, name, 0)
    grid = grid or LocalGrid(config_path, node_ids)
    return run_server(grid, str(config_path), out, resume=resume)
