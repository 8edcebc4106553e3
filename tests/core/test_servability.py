"""Servability rules: each rule fires on the adapter it describes (refusal or notice), PEFT
folders rankwise writes trip exactly the rules they should, PEFT's own hotswap refuses what the
``peft-hotswap`` rules refuse, and the README's table is the one :func:`table` computes."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import rankwise
from rankwise.core import servability as sv
from rankwise.errors import RankwiseError
from rankwise.testing import randomize_trainable, tiny_llama_lm

A = sv._example
DORA = A({"use_dora": True}, ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",))
HEAD = A({"modules_to_save": ["lm_head"]}, ("base_model.model.lm_head.weight",))
TOKENS = A({"trainable_token_indices": [5]}, ("base_model.model.model.embed_tokens.token_adapter."
                                              "trainable_tokens_delta",))
# (server, rule, an adapter it applies to, verdict)
CASES = [
    ("vllm", "dora", DORA, "refused"),
    ("vllm", "modules_to_save", HEAD, "refused"),
    ("vllm", "classification head", A({"modules_to_save": ["score"]}), "needs"),
    ("vllm", "trainable tokens", TOKENS, "refused"),
    ("vllm", "bias", A({"bias": "lora_only"}), "refused"),
    ("vllm", "bias", A({"lora_bias": True}), "refused"),
    ("vllm", "init", A({"init_lora_weights": "pissa"}), "refused"),
    ("vllm", "rank", A({"r": 40}), "needs"),
    ("vllm", "max rank", A({"r": 8, "rank_pattern": {"q_proj": 1024}}), "refused"),
    ("vllm", "patterns", A({"alpha_pattern": {"q_proj": 4.0}}), "needs"),
    ("llama.cpp", "dora", DORA, "refused"),
    ("llama.cpp", "modules_to_save", HEAD, "refused"),
    ("llama.cpp", "trainable tokens", TOKENS, "refused"),
    ("llama.cpp", "bias", A({"bias": "all"}), "refused"),
    ("llama.cpp", "experts", A({"target_parameters": ["mlp.experts.gate_up_proj"]}), "refused"),
    ("llama.cpp", "rslora", A({"use_rslora": True}), "refused"),
    ("llama.cpp", "alpha_pattern", A({"alpha_pattern": {"q_proj": 4.0}}), "refused"),
    ("peft-hotswap", "dora", DORA, "refused"),
    ("peft-hotswap", "modules_to_save", HEAD, "refused"),
    ("peft-hotswap", "trainable tokens", TOKENS, "refused"),
    ("peft-hotswap", "same settings", A(), "needs"),
    ("peft", "versions", TOKENS, "needs"),
]
UNTIED = A({"trainable_token_indices": {"model.embed_tokens": [5], "lm_head": [5]}})
EXPERTS = A({"target_parameters": ["mlp.experts.gate_up_proj"]})


def test_every_rule_has_a_case():
    assert {(r.server, r.name) for r in sv.RULES} == {(s, n) for s, n, _, _ in CASES}


@pytest.mark.parametrize("server,rule,adapter,verdict", CASES, ids=lambda x: x if isinstance(x, str) else "")
def test_rule_fires_with_its_verdict(server, rule, adapter, verdict):
    found = [f for f in sv.check(adapter) if (f.server, f.rule) == (server, rule)]
    assert [f.verdict for f in found] == [verdict]
    line = next(ln for ln in sv.summary(sv.check(adapter)) if ln.startswith(f"  {sv.SERVERS[server]}:"))
    assert found[0].reason in line
    if verdict == "refused":  # --strict SERVER stops it, naming the reason and the fix
        with pytest.raises(RankwiseError, match=re.escape(found[0].reason)):
            sv.enforce(sv.check(adapter), [server])
        assert "refuses it" in line
    else:
        sv.enforce(sv.check(adapter), [server])
        assert "loads it" in line


def test_plain_lora_loads_everywhere_and_vllm_rank_flag_is_the_next_allowed_value():
    assert sv.verdicts(sv.check(A()))["vllm"]["loads"] == "yes"
    assert sv.verdicts(sv.check(A()))["llama.cpp"]["loads"] == "yes"
    assert "--max-lora-rank 64" in sv._vllm_rank(A({"r": 40}))
    assert sv._vllm_rank(A({"r": 16})) is None  # vLLM's default max_lora_rank is 16
    with pytest.raises(RankwiseError, match="expected one of vllm, llama.cpp, peft-hotswap"):
        sv.enforce([], ["vLLM"])


@pytest.mark.parametrize("adapter,needs", [
    (A(), ("0.13", ())), (DORA, ("0.13", ())), (HEAD, ("0.13", ())), (TOKENS, ("0.15", ())),
    (UNTIED, ("0.15", ("0.16", "0.17"))), (EXPERTS, ("0.17", ())),
    (A({**UNTIED.config, **EXPERTS.config}), ("0.18", ())),
    (sv.Adapter({"peft_type": "PROMPT_TUNING"}, ("prompt_embeddings",)), ("0.13", ())),
    (sv.Adapter({"peft_type": "PROMPT_TUNING", "modules_to_save": ["classifier"]}, ()), ("0.14", ())),
])
def test_the_peft_versions_each_feature_needs(adapter, needs):
    """What tests/adapters/test_peft_versions.py measured, as the export prints it."""
    assert sv.peft_needs(adapter) == needs
    line = next(ln for ln in sv.summary(sv.check(adapter)) if ln.startswith("  PEFT:"))
    assert f"loads it; peft >= {needs[0]}" in line
    assert (" except " + " and ".join(needs[1]) in line) == bool(needs[1])


def _export(tmp_path: Path, name: str, **kw) -> Path:
    model = tiny_llama_lm()
    rankwise.apply(model, "lora", r=4, targets=["q_proj", "v_proj"], **kw)
    randomize_trainable(model)
    return rankwise.export_peft(model, tmp_path / name)


@pytest.mark.parametrize("kw,rules", [
    ({}, set()),
    ({"use_dora": True}, {"dora"}),
    ({"use_rslora": True}, {"rslora"}),
    ({"modules_to_save": ["lm_head"]}, {"modules_to_save"}),
], ids=["lora", "dora", "rslora", "head"])
def test_rankwise_peft_folders_trip_exactly_their_rules(tmp_path, kw, rules):
    found = sv.check(sv.read_folder(_export(tmp_path, "p", **kw)))
    refused = {f.rule for f in found if f.verdict == "refused"}
    assert refused == rules


def test_trainable_token_export_trips_the_token_rules(tmp_path):
    from rankwise.core.tokens import add_trainable_tokens
    model = tiny_llama_lm()
    rankwise.apply(model, "lora", r=4, targets=["q_proj"])
    add_trainable_tokens(model, [3, 4], "default")
    randomize_trainable(model)
    found = sv.check(sv.read_folder(rankwise.export_peft(model, tmp_path / "t")))
    assert {(f.server, f.rule) for f in found if f.verdict == "refused"} == {
        ("vllm", "trainable tokens"), ("llama.cpp", "trainable tokens"), ("peft-hotswap", "trainable tokens")}


def test_peft_hotswap_refuses_what_the_rules_refuse(tmp_path):
    """PEFT itself: a plain adapter swaps in exactly; DoRA / a trained head do not swap."""
    peft = pytest.importorskip("peft")
    from peft.utils.hotswap import hotswap_adapter
    first, second = _export(tmp_path, "a"), _export(tmp_path, "b")
    x = torch.tensor([[1, 3, 4, 5]])
    ref = peft.PeftModel.from_pretrained(tiny_llama_lm(), str(second))(x).logits
    model = peft.PeftModel.from_pretrained(tiny_llama_lm(), str(first))
    hotswap_adapter(model, str(second), adapter_name="default", torch_device="cpu")
    assert torch.equal(model(x).logits, ref)
    for kw in ({"use_dora": True}, {"modules_to_save": ["lm_head"]}):
        folder = _export(tmp_path, "c" + str(len(kw)) + next(iter(kw)), **kw)
        assert sv.verdicts(sv.check(sv.read_folder(folder)))["peft-hotswap"]["loads"] == "no"
        model = peft.PeftModel.from_pretrained(tiny_llama_lm(), str(folder))
        with pytest.raises((KeyError, ValueError, RuntimeError)):
            hotswap_adapter(model, str(folder), adapter_name="default", torch_device="cpu")


def test_readme_table_is_the_rules_table():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert sv.table() in readme, "regenerate it: python -m rankwise.core.servability"
