"""Every config section is declared one way: a typed dataclass built and checked once by
``build_run_config`` (``federated:`` and ``compress:`` included), problems of all sections
reported together."""
from __future__ import annotations

import pytest

from rankwise.compress.config import CompressConfig
from rankwise.errors import RankwiseError
from rankwise.federated.config import FederatedConfig
from rankwise.recipes.config import build_run_config


def test_federated_and_compress_are_typed_sections_present_only_when_given():
    cfg = build_run_config({"federated": {"clients": 3}, "compress": {"method": "wanda", "sparsity": 0.5}})
    assert isinstance(cfg.federated, FederatedConfig) and cfg.federated.clients == 3
    assert cfg.federated.rounds == FederatedConfig().rounds          # defaults from the dataclass
    assert isinstance(cfg.compress, CompressConfig) and cfg.compress.method == "wanda"
    assert cfg.to_dict()["federated"]["clients"] == 3                 # config.yaml holds it resolved
    plain = build_run_config({})
    assert plain.federated is None and plain.compress is None
    assert "federated" not in plain.to_dict() and "compress" not in plain.to_dict()


def test_problems_of_every_section_are_reported_once_and_together():
    with pytest.raises(RankwiseError) as err:
        build_run_config({"federated": {"clients": 0, "rounds": 0}, "compress": {"method": "wanda", "sparsty": 0.5},
                          "train": {"steps": 0}})
    msg = str(err.value)
    assert msg.count("clients: got 0") == 1 and "rounds: got 0" in msg
    assert "sparsty" in msg and "sparsity" in msg                     # the suggestion
    assert "steps" in msg


def test_compress_section_needs_a_known_method():
    with pytest.raises(RankwiseError, match="compress.method is required"):
        build_run_config({"compress": {"sparsity": 0.5}})
    with pytest.raises(RankwiseError, match="compress.method"):
        build_run_config({"compress": {"method": "wandaa"}})
