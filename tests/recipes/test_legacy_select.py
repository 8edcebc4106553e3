"""``data.select``'s old flat spelling (``method: less`` and every rule's keys in one mapping)
reads as the new one for one release, and a resolved config hashes as it did before the change:
the hashes below were computed by the code before the ``select-rule`` kind, so recorded
comparison runs with a selection are still reused."""
from __future__ import annotations

import pytest

from rankwise.recipes import legacy, legacy_select
from rankwise.recipes.config import build_run_config
from rankwise.recipes.runs import config_hash

LLAMA = {"path": "tiny-llama"}

# (old spelling, new spelling, config_hash before the change; same for both)
CASES = [
    (None, None, "df3f770dd3c8c87dcb812c5f07141f504c0fc3731fa04a15fd260b57f9072842"),
    ({"method": "less", "budget": 0.2, "target": "demo:email", "proj_dim": 128},
     {"name": "less", "budget": 0.2, "target": "demo:email", "proj_dim": 128},
     "e17edd9bd368c392794fb539a1ff45cd3b76b1c8bfddda0ea5cd13c56e1ff37e"),
    ({"method": "qcs-proxy", "target": "t.jsonl", "qcs_steps": 5, "weights": True, "token_floor": 0.2},
     {"name": "qcs-proxy", "target": "t.jsonl", "steps": 5, "weights": True, "token_floor": 0.2},
     "d7c2bf75343fbdb2b58fd1b27b9a555f6eb109d2466e585eca3cdd0947eb2013"),
    ({"from": "sel"}, {"from": "sel"}, "405079700c45f6f0d640b3b0ad01036e2e06b02bd93643805f50c6752f2badfc"),
    ({"method": "influence", "target": "t", "influence_eta": 0.5, "landmarks": 8, "warmup_steps": 3},
     {"name": "influence", "target": "t", "eta": 0.5, "landmarks": 8, "warmup_steps": 3},
     "6a74706e98f3d74ccafe96cee270d9d0c1c823d0b4fe9a4fe8053e664096de28"),
    ({"method": "random", "budget": 7, "seed": 3}, {"name": "random", "budget": 7, "seed": 3},
     "382b78d83cfc6b674fc22f2d21a8cfe9696f5a6c3a4ba8c40f6f19679eefc44b"),
]


def _raw(select) -> dict:
    return {"model": LLAMA, "data": {"source": "demo", **({} if select is None else {"select": select})}}


@pytest.mark.parametrize("old, new, digest", CASES)
def test_both_spellings_resolve_alike_and_hash_as_before_the_change(old, new, digest):
    assert build_run_config(_raw(old), notice=False).to_dict() == build_run_config(_raw(new)).to_dict()
    assert config_hash(_raw(old)) == config_hash(_raw(new)) == digest


def test_a_run_folders_flat_config_reads_back():
    """A ``config.yaml`` written before the change holds all 21 flat keys."""
    flat = dict(legacy_select.OLD_DEFAULTS)
    assert build_run_config(_raw(flat), notice=False).data.select is None
    got = build_run_config(_raw({**flat, "method": "influence", "target": "t", "from_": "sel",
                                 "influence_l2": 2.0, "qcs_steps": 9}), notice=False).data.select
    assert (got.name, got.target, got.from_, got.l2, got.eta, got.landmarks) == ("influence", "t", "sel", 2.0, 1.0, 64)
    got = build_run_config(_raw({**flat, "from_": "sel", "weights": True}), notice=False).data.select
    assert (got.name, got.from_, got.weights) == ("reuse", "sel", True)


def test_old_select_is_the_flat_layout_of_every_rule():
    assert legacy_select.old_select(None) == legacy_select.OLD_DEFAULTS
    shaped = legacy.old_shape(build_run_config(_raw({"name": "qcs-proxy", "target": "t", "lr": 0.5})).to_dict())
    want = {**legacy_select.OLD_DEFAULTS, "method": "qcs-proxy", "target": "t", "qcs_lr": 0.5}
    assert shaped["data"]["select"] == want and list(shaped["data"]["select"]) == list(want)


@pytest.mark.parametrize("old, notice", [
    ({"method": "less", "target": "t", "qcs_lr": 0.3},
     "notice: data.select.method is the old spelling of data.select.name, read until the next release; "
     "write data.select: {name: less, target: t}"),
    ({"budget": 0.3}, "notice: data.select without a rule's name is the old spelling, read until the next "
                      "release; write data.select: null (or leave it out)"),
    ({"name": "qcs", "target": "t"},
     "notice: data.select.name 'qcs' is now 'qcs-proxy': a one-step quadratic proxy of QCS, not the paper's "
     "bi-level method (docs/select.md); write data.select: {name: qcs-proxy, target: t}"),
])
def test_the_notice_is_one_line_naming_the_new_spelling(old, notice, capsys, monkeypatch):
    monkeypatch.setattr(legacy, "_SHOWN", set())
    build_run_config(_raw(old))
    assert capsys.readouterr().err.splitlines() == [notice]
    build_run_config(_raw({"name": "less", "target": "t"}))  # the new spelling: no notice
    assert capsys.readouterr().err == ""
    data, said = legacy_select.select_spelling(_raw("qcs"))  # a bare old name
    assert data["data"]["select"] == "qcs-proxy" and said.endswith("write data.select: qcs-proxy")
