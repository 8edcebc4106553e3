"""Fixtures for the federated tests: Flower message identity and a temporary FLWR_HOME."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("flwr")


@pytest.fixture(autouse=True)
def _flower_identity(tmp_path_factory, monkeypatch):
    """Messages need a run/task identity outside a Flower process; FLWR_HOME stays in tmp."""
    from flwr.supercore.task_identity import TaskIdentity
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    monkeypatch.setenv("FLWR_HOME", str(tmp_path_factory.getbasetemp() / "flwr-home"))
    yield


@pytest.fixture
def fed():
    """Default federated settings with min_clients=2."""
    from rankwise.federated.config import FederatedConfig
    return FederatedConfig(clients=3, min_clients=2)


os.environ.setdefault("RAY_DEDUP_LOGS", "0")
