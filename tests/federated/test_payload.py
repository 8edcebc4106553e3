"""Payload: records round-trip, byte counting from serialized records, validation, key rules."""
from __future__ import annotations

import torch

from rankwise.federated.payload import (from_record, layer_index, record_bytes, select_keys,
                                        to_record, validate_update)


def test_round_trip_casts_to_float32():
    state = {"a.lora_A.default.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}
    back = from_record(to_record(state))
    assert back["a.lora_A.default.weight"].dtype == torch.float32
    assert torch.equal(back["a.lora_A.default.weight"], torch.arange(6.0).reshape(2, 3))


def test_record_bytes_counts_serialized_payload_and_duplicates():
    one = to_record({"x": torch.zeros(100)})
    two = to_record({"x": torch.zeros(100), "y": torch.zeros(100)})
    b1, b2 = record_bytes(one), record_bytes(two)
    assert b1 > 400  # 100 float32 values plus headers
    assert 400 < b2 - b1 < b1 + 10  # the second, identical array is counted too


def test_validate_rejects_shape_keys_nan():
    exp = {"w": (2, 2)}
    assert validate_update({"w": torch.ones(2, 2)}, exp) == []
    assert "shape" in validate_update({"w": torch.ones(1, 2)}, exp)[0]
    probs = validate_update({"v": torch.ones(2, 2)}, exp)
    assert any("missing" in p for p in probs) and any("unexpected" in p for p in probs)
    bad = torch.ones(2, 2)
    bad[0, 1] = float("inf")
    bad[1, 1] = float("nan")
    assert "2 NaN/Inf" in validate_update({"w": bad}, exp)[0]


def test_select_keys_and_layer_index():
    names = ["bert.encoder.layer.0.q.lora_A.default.weight", "bert.encoder.layer.0.q.lora_B.default.weight",
             "bert.encoder.layer.1.q.lora_A.default.weight", "transformer.h.3.attn.lora_B.default.weight",
             "classifier.weight"]
    roles = {names[0]: "A", names[1]: "B", names[2]: "A", names[3]: "B"}
    assert [layer_index(n) for n in names] == [0, 0, 1, 3, None]
    assert select_keys(names, roles, "B") == [names[1], names[3], names[4]]
    assert select_keys(names, roles, "AB", [1]) == [names[2], names[4]]


def test_select_keys_reads_roles_not_names():
    # a factor named without "lora_" and a non-factor whose name contains it
    names = ["m.layer.0.down", "m.layer.0.up", "m.layer.0.lora_A.default.weight"]
    roles = {"m.layer.0.down": "A", "m.layer.0.up": "B"}
    assert select_keys(names, roles, "B") == ["m.layer.0.up", "m.layer.0.lora_A.default.weight"]
    assert select_keys(names, roles, "A") == ["m.layer.0.down", "m.layer.0.lora_A.default.weight"]
    assert select_keys(names, {}, "B") == names     # no roles: nothing is a factor


def test_average_present_weights_by_examples_per_key():
    from rankwise.federated.strategies.base import Update
    from rankwise.federated.strategies.lora_avg import average_present
    ups = [Update(1, {"w": torch.tensor([1.0]), "only1": torch.tensor([2.0])}, 3.0, {}),
           Update(2, {"w": torch.tensor([4.0])}, 1.0, {})]
    out = average_present(ups)
    assert out["w"].item() == 1.75 and out["only1"].item() == 2.0
