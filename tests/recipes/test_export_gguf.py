"""Acceptance: ``rankwise export --format gguf|gguf-lora`` of a LoRA run on a tiny Llama with a
SentencePiece tokenizer, read back with ``gguf.GGUFReader``.

* the merged GGUF's tensors equal the merged export's (f32: bit for bit) after the converter's
  documented rotary permutation of q/k (``LlamaModel.permute``); q8_0 is within Q8_0's step;
* its tokenizer (tokens, scores, token types) is what the converter writes for the base, not the
  fallback whose scores are all -1000;
* the LoRA GGUF holds the PEFT export's A and B (B permuted for q/k) and its ``lora_alpha``;
* a DoRA run gets no LoRA GGUF (one line naming ``--format gguf``), and ``--strict vllm`` stops
  its PEFT export with nothing written.

libllama's logits (merged GGUF, and base GGUF + LoRA GGUF, against transformers) are measured by
``rankwise bench gguf-parity`` (``bench/rankwise_bench/gguf_parity.py``), which needs llama-cpp-python's compiled libllama.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from rankwise.cli import main
from rankwise.core import llama_cpp
from rankwise.errors import RankwiseError

gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")
pytestmark = [pytest.mark.slow, pytest.mark.integration]  # trains runs, starts the converters
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
         "Rankwise trains low-rank adapters on small models.", "Numbers 12345 and words!"] * 10
HEADS, KV_HEADS = 4, 2


def _cli(*args, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert (result.exit_code == 0) == ok, result.output
    return result


@pytest.fixture(scope="module")
def converters():
    try:
        return llama_cpp.find()
    except RankwiseError as err:
        pytest.skip(f"llama.cpp's converters are not installed ({err}); `make setup` fetches them")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, docstrings_jsonl, converters):
    """A SentencePiece tiny-Llama base, a LoRA run and a DoRA run on it, and their exports."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankwise.data.tokenizer import TokenizerTrainConfig, train_tokenizer
    root = tmp_path_factory.mktemp("gguf")
    tok = train_tokenizer(iter(TEXTS), TokenizerTrainConfig(vocab_size=320), root / "base")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=HEADS,
                                 num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(root / "base")
    for name, extra in (("lora", {}), ("dora", {"use_dora": True})):
        cfg = root / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({
            "model": {"path": str(root / "base"), "task": "causal-lm"},
            "data": {"source": str(docstrings_jsonl), "max_length": 32},
            "method": {"name": "lora", "r": 4, "alpha": 8, "targets": "all-linear", **extra},
            "optim": {"name": "adamw", "lr": 0.02},
            "train": {"steps": 3, "batch_size": 4, "save_every": 0, "progress": False}}))
        _cli("train", cfg, "--out", root / name)
    run = root / "lora"
    _cli("export", run, "--format", "merged", "--out", root / "merged")
    _cli("export", run, "--format", "peft", "--out", root / "peft")
    _cli("export", run, "--format", "gguf", "--outtype", "f32", "--out", root / "gguf")
    _cli("export", run, "--format", "gguf", "--outtype", "q8_0", "--out", root / "q8")
    lora = _cli("export", run, "--format", "gguf-lora", "--outtype", "f32", "--with-base",
                "--out", root / "gguf-lora")
    assert "llama-cli -m" in lora.output and "--lora" in lora.output
    return root


def _permuted(name: str, w: np.ndarray) -> np.ndarray:
    """The converter's q/k permutation (``LlamaModel.permute``) of a ``(out, ...)`` array."""
    heads = HEADS if ".q_proj" in name else KV_HEADS if ".k_proj" in name else None
    if heads is None:
        return w
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2).get_name(hf, try_suffixes=(".weight",))


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_merged_gguf_tensors_equal_the_merged_export(runs):
    merged = {k: v.numpy() for k, v in load_file(str(runs / "merged" / "model.safetensors")).items()}
    got = _tensors(runs / "gguf" / "model-f32.gguf")
    assert len(got) == len(merged)
    for hf, w in merged.items():
        t = got[_gguf_name(hf)]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(np.asarray(t.data).reshape(w.shape), _permuted(hf, w)), hf
    q8 = _tensors(runs / "q8" / "model-q8_0.gguf")
    hf = "model.layers.0.self_attn.q_proj.weight"
    t = q8[_gguf_name(hf)]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    w = _permuted(hf, merged[hf])
    err = np.abs(gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape) - w).max()
    assert 0 < err <= np.abs(w).max() / 127  # Q8_0: 8-bit steps of each 32-block's max / 127


def _field(reader, key):
    f = reader.fields[key]
    return [f.parts[i].tolist() for i in f.data]


def test_gguf_tokenizer_is_the_converters_for_the_base(runs):
    ours = gguf.GGUFReader(str(runs / "gguf" / "model-f32.gguf"))
    base = gguf.GGUFReader(str(runs / "gguf-lora" / "base-f32.gguf"))  # the base folder as trained
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert _field(ours, key) == _field(base, key), key
    scores = [s[0] for s in _field(ours, "tokenizer.ggml.scores")]
    types = [t[0] for t in _field(ours, "tokenizer.ggml.token_type")]
    assert max(scores) > -1000 and types[0] == gguf.TokenType.UNKNOWN  # SentencePiece's own vocab
    assert _field(ours, "tokenizer.ggml.model") == [list(b"llama")]


def test_lora_gguf_holds_the_peft_pairs(runs):
    peft = {k: v.numpy() for k, v in load_file(str(runs / "peft" / "adapter_model.safetensors")).items()}
    config = json.loads((runs / "peft" / "adapter_config.json").read_text())
    reader = gguf.GGUFReader(str(runs / "gguf-lora" / "adapter-f32.gguf"))
    got = {t.name: t for t in reader.tensors}
    assert len(got) == len(peft)
    assert _field(reader, "adapter.lora.alpha") == [[config["lora_alpha"]]]
    for key, w in peft.items():
        hf = key.removeprefix("base_model.model.").replace(".lora_A", "").replace(".lora_B", "")
        a_or_b = "lora_a" if ".lora_A." in key else "lora_b"
        want = _permuted(hf, w) if a_or_b == "lora_b" else w
        t = got[f"{_gguf_name(hf)}.{a_or_b}"]
        assert np.array_equal(np.asarray(t.data).reshape(w.shape), want), key


def test_dora_run_has_no_lora_gguf_and_strict_vllm_refuses_its_peft_export(runs):
    out = _cli("export", runs / "dora", "--format", "gguf-lora", "--out", runs / "dora-gguf", ok=False)
    assert "DoRA magnitudes" in out.output and "--format gguf" in out.output
    assert not (runs / "dora-gguf").exists()
    out = _cli("export", runs / "dora", "--format", "peft", "--strict", "vllm", "--out", runs / "dora-peft", ok=False)
    assert "vLLM would refuse this adapter (DoRA magnitudes" in out.output
    assert not (runs / "dora-peft").exists()
    out = _cli("export", runs / "dora", "--format", "peft", "--out", runs / "dora-peft")
    assert "vLLM: refuses it: DoRA magnitudes" in out.output
    record = json.loads((runs / "dora-peft" / "servability.json").read_text())
    assert record["servers"]["llama.cpp"]["loads"] == "no"
    assert (runs / "dora-peft" / "tokenizer.model").is_file()
