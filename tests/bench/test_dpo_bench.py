"""The measuring shared by ``bench dpo`` and ``bench grpo``: the peer's PEFT LoRA starts from our
factors, both sides step from the same step index, the timed repetitions alternate which side
goes first, ratios are rankwise over TRL, and rows are written one at a time so an interrupted run
measures only what is missing."""
from __future__ import annotations

import json

import torch

from rankwise.testing import same_factors
from rankwise_bench import dpo


def test_interleaved_alternates_the_order_and_reports_rankwise_over_trl():
    calls = []

    def side(name, loss, floats):
        def step(k):
            calls.append((name, k))
            sum(range(200_000))  # some CPU time for process_time() to see
            torch.ones(floats)   # a transient of floats * 4 bytes for the memory meter
            return loss + k
        return step

    row = dpo.interleaved(side("rankwise", 1.0, 1000), side("trl", 1.25, 4000), warmup=2, reps=4)
    timed = [c for c in calls if 2 <= c[1] < 6]
    assert [n for n, _ in timed] == ["rankwise", "trl", "trl", "rankwise"] * 2
    assert [k for _, k in timed] == [2, 2, 3, 3, 4, 4, 5, 5]      # the same step on both sides
    assert calls[-2:] == [("rankwise", 6), ("trl", 6)]             # one more each, under the meter
    assert row["first_loss"] == {"rankwise": 1.0, "trl": 1.25}
    assert row["max_loss_diff_timed_steps"] == 0.25
    s = row["step_cpu_s"]
    assert row["step_time_ratio"] == s["rankwise"] / s["trl"]
    assert row["peak_step_mb"] == {"rankwise": 4000 / 2**20, "trl": 16000 / 2**20} and row["memory_ratio"] == 0.25


def test_rows_are_written_one_by_one_and_kept_by_the_next_run(tmp_path):
    setup = {"pairs": 4, "base_dtypes": list(dpo.BASES)}

    def row(ratio):
        return {"step_cpu_s": {"rankwise": ratio, "trl": 1.0}, "step_time_ratio": ratio,
                "peak_step_mb": {"rankwise": 10 * ratio, "trl": 10.0}, "memory_ratio": ratio,
                "first_loss": {"rankwise": 2.0, "trl": 2.0}, "max_loss_diff_timed_steps": 0.0}

    measured = []

    def measure(kind):
        measured.append(kind)
        if kind == "nf4":
            raise KeyboardInterrupt  # a run stopped during its last row
        return row({"float32": 0.5, "bfloat16": 0.25}[kind])

    try:
        dpo.record_rows(tmp_path, {}, setup, 0.0, measure, lambda res: "\n".join(dpo.vs_trl_table(res["rows"])))
    except KeyboardInterrupt:
        pass
    res = json.loads((tmp_path / "results.json").read_text())
    assert sorted(res["rows"]) == ["bfloat16", "float32"] and res["step_time_ratio"] == 0.5
    kept = dpo.measured_rows(tmp_path, {**setup, "base_dtypes": ["float32"]})  # same setup otherwise
    assert sorted(kept) == ["bfloat16", "float32"]
    assert dpo.measured_rows(tmp_path, {**setup, "pairs": 8}) == {}              # another setup: none

    measured.clear()
    dpo.record_rows(tmp_path, kept, setup, 0.0, lambda kind: measure(kind) if kind != "nf4" else row(0.75),
                    lambda res: "\n".join(dpo.vs_trl_table(res["rows"])))
    assert measured == []  # only nf4 was missing, and it came from the lambda's own row
    lines = (tmp_path / "results.md").read_text().splitlines()
    assert [ln.split(" | ")[0] for ln in lines[2:8]] == ["| float32"] * 2 + ["| bfloat16"] * 2 + ["| nf4"] * 2
    assert lines[2].endswith("| 0.500 | <= 1.0 |") and lines[7].endswith("| 0.750 | <= 1.0 |")
    assert lines[-1].startswith("float32: first-step loss rankwise 2.000000, TRL 2.000000")
    assert "(measured ?)" in lines[-1]  # these rows carry no date


def test_the_peer_starts_from_our_factors():
    import peft

    from rankwise.adapters.lora import LoraConfig, apply_lora
    from rankwise.core.protocol import adapter_modules, factors
    ours = dpo._base(64, "float32")
    apply_lora(ours, LoraConfig(r=dpo.R, alpha=dpo.ALPHA, targets=dpo.TARGETS, dropout=0.0))
    torch.nn.init.normal_(next(m for _, m in adapter_modules(ours)).lora_B["default"].weight)  # B != 0
    peer = peft.get_peft_model(dpo._base(64, "float32"), peft.LoraConfig(
        r=dpo.R, lora_alpha=dpo.ALPHA, target_modules=dpo.TARGETS, lora_dropout=0.0))
    same_factors(ours, peer)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.allclose(ours(input_ids=ids).logits, peer(input_ids=ids).logits, atol=1e-6)
    named = dict(peer.named_modules())
    assert len(list(adapter_modules(ours))) == 4 * len(dpo.TARGETS)
    for path, mod in adapter_modules(ours):
        assert torch.equal(named["base_model.model." + path].lora_A["default"].weight, factors(mod, "default")[0])
