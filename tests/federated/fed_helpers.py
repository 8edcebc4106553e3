"""Helpers for the federated tests: a fake Flower Grid and reply builders (no Ray)."""
from __future__ import annotations

import torch


class FakeGrid:
    """Just enough of ``flwr.serverapp.Grid`` for ``configure_train``: nodes (a list, partition =
    position, or ``{node: partition}``) that answer the server's ``identify`` query."""

    def __init__(self, nodes):
        self.partition = dict(nodes) if isinstance(nodes, dict) else {n: k for k, n in enumerate(nodes)}
        self.nodes = list(self.partition)

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Message, MetricRecord, RecordDict

        from rankwise.federated import keys
        out = []
        for m in messages:
            assert dict(m.content.config_records[keys.CONFIG])[keys.PHASE] == keys.IDENTIFY
            metrics = MetricRecord({keys.PARTITION: self.partition[m.metadata.dst_node_id]})
            out.append(Message(content=RecordDict({keys.METRICS: metrics}), reply_to=m))
        return out


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


def lora_names(layers: int = 2) -> list[tuple[str, str]]:
    """``(A name, B name)`` per layer of :func:`lora_state`."""
    out = []
    for i in range(layers):
        p = f"bert.encoder.layer.{i}.attention.self.query"
        out.append((f"{p}.lora_A.default.weight", f"{p}.lora_B.default.weight"))
    return out


def lora_roles(layers: int = 2) -> dict[str, str]:
    """The roles of :func:`lora_state`'s factors, built explicitly (no name matching)."""
    return {name: role for pair in lora_names(layers) for name, role in zip(pair, "AB")}


def lora_state(seed: int = 0, layers: int = 2, d: int = 4, r: int = 2, head: bool = False) -> dict:
    """A LoRA-like state dict named like a BERT model's parameters."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for a, b in lora_names(layers):
        out[a] = torch.randn(r, d, generator=g)
        out[b] = torch.randn(d, r, generator=g)
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


def write_toy_data(path, n: int = 160, seed: int = 0):
    """A 4-class JSONL text set whose classes differ by vocabulary (fast to tokenize)."""
    import json
    import random
    rng = random.Random(seed)
    vocab = {0: "socket stream loop await task future", 1: "header message mime parse email address",
             2: "logger handler level format record emit", 3: "element tree node parse attribute xml"}
    with open(path, "w") as f:
        for i in range(n):
            y = i % 4
            words = rng.choices(vocab[y].split(), k=6) + rng.choices("the a of to in is".split(), k=3)
            rng.shuffle(words)
            f.write(json.dumps({"text": " ".join(words), "label": ["net", "mail", "log", "xml"][y]}) + "\n")
    return path


def toy_config(data_path, **federated) -> dict:
    """A raw run config: tiny BERT + LoRA on the toy data, with ``federated`` overrides."""
    return {"model": {"path": "tiny-bert"}, "data": {"source": str(data_path), "max_length": 16},
            "method": {"name": "lora", "r": 4, "alpha": 8}, "optim": {"name": "adamw", "lr": 0.01},
            "train": {"batch_size": 8, "eval_batch_size": 128},
            "federated": {"clients": 2, "rounds": 2, "local_steps": 2, "client_cpus": 2, **federated}}
