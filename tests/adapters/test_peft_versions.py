"""The PEFT versions rankwise claims, tested: every kind of ``--format peft`` export (LoRA on
Llama, GPT-2's Conv1D and a BERT classifier with its head, DoRA, a trained ``lm_head``, the
PiSSA / OLoRA / CorDA rank-2r conversion, EVA's per-layer ranks, new tokens with a tied and an
untied head, LoRA on fused MoE expert parameters, prompt tuning with and without a head) is
loaded by ``PeftModel.from_pretrained`` in each PEFT of :data:`peft_versions.PINS` (the oldest
that ``pyproject.toml`` admits and each minor version where a feature starts or stops loading,
each paired with a transformers of its time) and in the venv's own (the newest), one subprocess
per version loading them all.

Numbers asserted: where the export's servability line says that PEFT version loads it
(``servability.peft_needs``), its logits equal rankwise's to 1e-5 (fp32; measured at most
6.9e-7); where it names another PEFT, that version refuses it or computes other logits (peft
0.14 drops ``trainable_token_indices`` with a warning: max difference 2.2). The bases (saved by
transformers 5) give the same logits in each paired transformers (1e-5; GPT-OSS from 4.55).
LoftQ's export is plain LoRA on a 4-bit base (the same file as LoRA): no case of its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import peft_versions
from rankwise import registry
from rankwise.adapters.lora import LoraConfig, apply_lora
from rankwise.adapters.lora.peft import export_peft
from rankwise.adapters.prompt import PromptTuningConfig, apply_prompt_tuning
from rankwise.adapters.prompt.peft import export_prompt_peft
from rankwise.configs import from_dict
from rankwise.core import servability
from rankwise.core.ops import mark_trainable
from rankwise.core.protocol import transform_inputs
from rankwise.core.tokens import add_trainable_tokens
from rankwise.recipes.tokens import resize_for_tokens
from rankwise.testing import VOCAB, randomize_trainable, tiny_batch, tiny_bert_cls, tiny_gpt2_lm, tiny_llama_lm

pytestmark = [pytest.mark.slow, pytest.mark.integration]
WORKER = Path(__file__).with_name("peft_versions_worker.py")
NEWEST = "installed"  # the venv's own peft
NEW = [VOCAB, VOCAB + 1]
IDS = torch.tensor([[3, VOCAB, 5, VOCAB + 1, 9, 2, 7, 1], [VOCAB + 1, 1, 4, 7, VOCAB, 8, 3, 6]])


def _lora(build, **kw):
    model = build()
    apply_lora(model, LoraConfig(**kw), batches=[tiny_batch("llama", seed=20)])
    randomize_trainable(model)
    return model


def _tokens(build):
    model = build()
    resize_for_tokens(model, VOCAB + 2, NEW)
    entry = registry.get("method", "lora")
    entry.apply(model, from_dict(entry.config_cls, {"name": "lora", "r": 2, "targets": "all-linear"}, "method"),
                "default")
    add_trainable_tokens(model, NEW)  # every added token trains: any init of the new rows works
    mark_trainable(model)
    randomize_trainable(model)
    return model


def _prompt(build):
    model = build()
    apply_prompt_tuning(model, PromptTuningConfig(num_virtual_tokens=3, init="random"))
    randomize_trainable(model)
    return model


def tiny_gpt_oss():
    """The 2-layer GPT-OSS of the expert tests: fused (E, in, out) expert parameters."""
    from test_lora_experts import tiny_moe
    return tiny_moe("gpt-oss")


def _moe():
    from test_lora_experts import PARAMS
    model = tiny_gpt_oss()
    apply_lora(model, LoraConfig(r=2, alpha=4.0, targets=["q_proj"], target_parameters=PARAMS))
    randomize_trainable(model)
    return model


# name -> (the base's builder, the adapted model's)
CASES = {
    "lora": (tiny_llama_lm, lambda: _lora(tiny_llama_lm, r=2, alpha=4, targets="all-linear", use_rslora=True,
                                          rank_pattern={"q_proj": 4}, alpha_pattern={"v_proj": 3.0})),
    "lora-gpt2-conv1d": (tiny_gpt2_lm, lambda: _lora(tiny_gpt2_lm, r=4, alpha=16, targets=["c_attn", "c_fc"])),
    "lora-bert-classifier": (tiny_bert_cls, lambda: _lora(tiny_bert_cls, r=4, alpha=8, targets=["query", "value"])),
    "lora-lm-head": (tiny_llama_lm, lambda: _lora(tiny_llama_lm, r=2, targets=["q_proj"], modules_to_save=["lm_head"])),
    "dora": (tiny_llama_lm, lambda: _lora(tiny_llama_lm, r=2, alpha=4, targets="all-linear", use_dora=True)),
    "pissa": (tiny_llama_lm, lambda: _lora(tiny_llama_lm, r=2, alpha=4, init="pissa")),
    "olora": (tiny_llama_lm, lambda: _lora(tiny_llama_lm, r=2, alpha=4, init="olora", use_rslora=True)),
    "corda": (tiny_llama_lm, lambda: _lora(tiny_llama_lm, r=2, alpha=4, init="corda")),
    "eva": (tiny_llama_lm, lambda: _lora(tiny_llama_lm, r=2, targets=["q_proj", "v_proj", "up_proj"], init="eva")),
    "tokens-tied-head": (tiny_gpt2_lm, lambda: _tokens(tiny_gpt2_lm)),
    "tokens-untied-head": (tiny_llama_lm, lambda: _tokens(tiny_llama_lm)),
    "moe-experts": (tiny_gpt_oss, _moe),
    "prompt-tuning": (tiny_llama_lm, lambda: _prompt(tiny_llama_lm)),
    "prompt-tuning-bert-classifier": (tiny_bert_cls, lambda: _prompt(tiny_bert_cls)),
}
AUTO = {"lora-bert-classifier": "AutoModelForSequenceClassification",
        "prompt-tuning-bert-classifier": "AutoModelForSequenceClassification"}


def _base_folder(root: Path, build, bases: dict) -> Path:
    name = build.__name__
    if name not in bases:
        bases[name] = root / f"base-{name}"
        build().save_pretrained(bases[name])
    return bases[name]


@torch.no_grad()
def _data(model, path: Path, ids: torch.Tensor) -> Path:
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    logits = model(**transform_inputs(model, batch)).logits.float()
    save_file({**batch, "logits": logits.contiguous()}, str(path))
    return path


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every export, its base folder, rankwise's logits and the PEFT it says it needs."""
    root = tmp_path_factory.mktemp("peft-versions")
    bases, cases, needs = {}, {}, {}
    for name, (build, adapted) in CASES.items():
        model = adapted().eval()
        base = _base_folder(root, build, bases)
        vocab = VOCAB + 2 if name.startswith("tokens") else None
        ids = IDS if vocab else IDS % VOCAB
        writer = export_prompt_peft if name.startswith("prompt") else export_peft
        folder = writer(model, root / name, base_model_name_or_path=str(base))
        needs[name] = servability.peft_needs(servability.read_folder(folder))
        cases[name] = {"base": str(base), "adapter": str(folder), "vocab": vocab,
                       "auto": AUTO.get(name, "AutoModelForCausalLM"), "data": str(_data(model, root / f"{name}.st", ids))}
        key = Path(base).name
        if key not in cases:  # the base alone: transformers of another version reads transformers 5's folder
            cases[key] = {**cases[name], "adapter": None, "vocab": None,
                          "data": str(_data(build().eval(), root / f"{key}.st", IDS % VOCAB))}
            # GPT-OSS (fused experts) is in transformers >= 4.55: none of the pairs before peft 0.17
            needs[key] = ("0.17", ()) if build is tiny_gpt_oss else None
    manifest = root / "manifest.json"
    manifest.write_text(json.dumps({"cases": cases}))
    return manifest, needs


def _load_all(manifest: Path, version: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if version != NEWEST:
        env["PYTHONPATH"] = str(peft_versions.site(version))  # before the venv's site-packages
    out = manifest.with_name(f"result-{version}.json")
    proc = subprocess.run([sys.executable, str(WORKER), str(manifest), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _loads(version: str, need: tuple[str, tuple[str, ...]] | None) -> bool:
    """Whether the export says peft ``version`` loads it (``need``: :func:`servability.peft_needs`)."""
    minor = version.rsplit(".", 1)[0] if version.count(".") == 2 else version
    oldest, broken = need or (servability.PEFT_FLOOR, ())
    return servability._minor(version) >= servability._minor(oldest) and minor not in broken


@pytest.mark.parametrize("version", [*peft_versions.PINS, NEWEST])
def test_each_export_loads_in_the_peft_it_names(version, request):
    if version != NEWEST and not (peft_versions.site(version) / "peft").is_dir():
        pytest.skip(f"peft {version} is not fetched: run `make setup` (python tests/adapters/peft_versions.py)")
    manifest, needs = request.getfixturevalue("matrix")  # built once, only when a version runs
    result = _load_all(manifest, version)
    if version != NEWEST:
        assert result["peft"] == version and result["peft_file"].startswith(str(peft_versions.site(version)))
    got = result["peft"]
    wrong = {}
    for name, need in needs.items():
        r = result["cases"][name]
        if not _loads(got, need):  # refused, or (peft 0.14 on token rows) loaded as another model
            if "error" not in r and r["max_diff"] <= 1e-5:
                wrong[name] = f"peft {got} gives its logits though the export says it needs {need}: {r}"
        elif "error" in r or r["max_diff"] > 1e-5:
            wrong[name] = r
    assert not wrong, f"peft {got} + transformers {result['transformers']}: {json.dumps(wrong, indent=1)}"
