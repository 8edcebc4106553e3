"""Helpers for the federated tests: a fake Flower Grid and reply builders (no Ray)."""
from __future__ import annotations

import torch


class FakeGrid:
    """Just enough of ``flwr.serverapp.Grid`` for ``configure_train``."""

    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)


def reply(msg, state: dict, n: int = 10, **metrics):
    """A client's reply to ``msg`` with tensors ``state`` and ``n`` examples."""
    from flwr.app import Message, MetricRecord, RecordDict

    from rankwise.federated import keys
    from rankwise.federated.payload import to_record
    content = RecordDict({keys.ARRAYS: to_record(state),
                          keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: n, **metrics})})
    return Message(content=content, reply_to=msg)


def error_reply(msg, reason="boom"):
    """A reply carrying a ClientApp error."""
    from flwr.app import Error, Message
    return Message(Error(code=0, reason=reason), reply_to=msg)


def lora_state(seed: int = 0, layers: int = 2, d: int = 4, r: int = 2, head: bool = False) -> dict:
    """A LoRA-like state dict named like a BERT model's parameters."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        p = f"bert.encoder.layer.{i}.attention.self.query"
        out[f"{p}.lora_A.default.weight"] = torch.randn(r, d, generator=g)
        out[f"{p}.lora_B.default.weight"] = torch.randn(d, r, generator=g)
    if head:
        out["classifier.weight"] = torch.randn(3, d, generator=g)
    return out


def received(msg) -> dict:
    """The tensors a message carries."""
    from rankwise.federated import keys
    from rankwise.federated.payload import from_record
    return from_record(msg.content.array_records[keys.ARRAYS])


def config_of(msg) -> dict:
    """The ConfigRecord of a message as a dict."""
    from rankwise.federated import keys
    return dict(msg.content.config_records[keys.CONFIG])
