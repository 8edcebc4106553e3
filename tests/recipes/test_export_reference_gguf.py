"""The GGUF export on a real pretrained base with a real SentencePiece tokenizer: the committed
reference base ``bench/reference-base/model`` (a 6-layer Llama, 6.45M parameters, tied
embeddings, an 8,192-piece SentencePiece vocabulary with ``tokenizer.model``).

A LoRA trained for 2 steps on it is exported with ``rankwise export --format merged|peft|gguf|
gguf-lora --with-base`` and the files are read back with ``gguf.GGUFReader``:

* the merged folder keeps the base's ``tokenizer.model`` byte for byte and tokenizes as the base;
* the merged GGUF holds one tensor per tensor of the merged export, under the converter's names,
  with the same shapes and (f32, after the converter's q/k rotary permutation) the same values;
  its LoRA changed the weights it targets (the GGUF is not the base's);
* its vocabulary is the SentencePiece model's own: 8,192 pieces, scores, ``<unk>`` typed unknown,
  equal to what the converter writes for the base folder;
* the LoRA GGUF holds the PEFT export's pairs and ``lora_alpha``.
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

gguf = pytest.importorskip("gguf", reason="the gguf package reads the files back: pip install 'rankwise[gguf]'")
spm = pytest.importorskip("sentencepiece", reason="llama.cpp's converter reads tokenizer.model with it")
pytestmark = [pytest.mark.slow, pytest.mark.integration]  # trains a run, starts the converters
BASE = Path(__file__).parents[2] / "bench" / "reference-base" / "model"
VOCAB, LAYERS, HEADS, KV_HEADS = 8192, 6, 4, 2
PROMPTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
           "Return the number of items in the queue (not reliable!).", "x = {'k': [1, 2.5, None]}"]


def _cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def exports(tmp_path_factory, docstrings_jsonl):
    """A 2-step LoRA run on the reference base and its merged, PEFT and GGUF exports."""
    if not (BASE / "model.safetensors").is_file():
        pytest.skip(f"no reference base at {BASE} (`make reference-base` builds it)")
    try:
        llama_cpp.find()
    except RankwiseError as err:
        pytest.skip(f"llama.cpp's converters are not installed ({err}); `make setup` fetches them")
    root = tmp_path_factory.mktemp("reference-gguf")
    (root / "run.yaml").write_text(yaml.safe_dump({
        "model": {"path": str(BASE), "task": "causal-lm"},
        "data": {"source": str(docstrings_jsonl), "max_length": 32},
        "method": {"name": "lora", "r": 4, "alpha": 8, "targets": ["q_proj", "k_proj", "v_proj"]},
        "optim": {"name": "adamw", "lr": 0.02},
        "train": {"steps": 2, "batch_size": 2, "save_every": 0, "progress": False}}))
    _cli("train", root / "run.yaml", "--out", root / "run")
    for fmt, extra in (("merged", ()), ("peft", ()), ("gguf", ("--outtype", "f32")),
                       ("gguf-lora", ("--outtype", "f32", "--with-base"))):
        _cli("export", root / "run", "--format", fmt, *extra, "--out", root / fmt)
    return root


def _field(reader, key):
    f = reader.fields[key]
    return [f.parts[i].tolist() for i in f.data]


def _permuted(name: str, w: np.ndarray) -> np.ndarray:
    """The converter's q/k permutation (``LlamaModel.permute``) of a ``(out, ...)`` array."""
    heads = HEADS if ".q_proj" in name else KV_HEADS if ".k_proj" in name else None
    if heads is None:
        return w
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS).get_name(hf, try_suffixes=(".weight",))


def _f32(w) -> np.ndarray:
    return w.float().numpy()  # the base and its merged export are bf16


def test_merged_export_keeps_tokenizer_model_and_tokenizes_as_the_base(exports):
    from transformers import AutoTokenizer
    merged = exports / "merged"
    assert (merged / "tokenizer.model").read_bytes() == (BASE / "tokenizer.model").read_bytes()
    ids = [AutoTokenizer.from_pretrained(str(d))(PROMPTS)["input_ids"] for d in (merged, BASE)]
    assert ids[0] == ids[1] and len(AutoTokenizer.from_pretrained(str(merged))) == VOCAB
    assert (exports / "peft" / "tokenizer.model").read_bytes() == (BASE / "tokenizer.model").read_bytes()


def test_merged_gguf_tensors_are_the_merged_export(exports):
    merged = {k: _f32(v) for k, v in load_file(str(exports / "merged" / "model.safetensors")).items()}
    base = {k: _f32(v) for k, v in load_file(str(BASE / "model.safetensors")).items()}
    got = {t.name: t for t in gguf.GGUFReader(str(exports / "gguf" / "model-f32.gguf")).tensors}
    assert len(merged) == len(base) == 2 + 9 * LAYERS  # embed, final norm (no lm_head: tied), 9 per layer
    assert sorted(got) == sorted(_gguf_name(k) for k in merged)
    changed = 0
    for hf, w in merged.items():
        t = got[_gguf_name(hf)]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert tuple(int(n) for n in reversed(t.shape)) == w.shape, hf  # GGUF lists dims fastest first
        assert np.array_equal(np.asarray(t.data).reshape(w.shape), _permuted(hf, w)), hf
        changed += not np.array_equal(w, base[hf])
    assert changed == 3 * LAYERS  # exactly the LoRA-targeted q, k, v of every layer moved


def test_gguf_vocabulary_is_the_sentencepiece_model(exports):
    ours = gguf.GGUFReader(str(exports / "gguf" / "model-f32.gguf"))
    sp = spm.SentencePieceProcessor(model_file=str(BASE / "tokenizer.model"))
    tokens = [bytes(t).decode() for t in _field(ours, "tokenizer.ggml.tokens")]
    scores = [s[0] for s in _field(ours, "tokenizer.ggml.scores")]
    types = [t[0] for t in _field(ours, "tokenizer.ggml.token_type")]
    assert len(tokens) == len(scores) == len(types) == sp.get_piece_size() == VOCAB
    assert tokens == [sp.id_to_piece(i) for i in range(VOCAB)]
    assert np.allclose(scores, [sp.get_score(i) for i in range(VOCAB)], rtol=0, atol=1e-6)
    assert types[sp.unk_id()] == gguf.TokenType.UNKNOWN and max(scores) > -1000
    assert _field(ours, "tokenizer.ggml.model") == [list(b"llama")]
    base = gguf.GGUFReader(str(exports / "gguf-lora" / "base-f32.gguf"))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert _field(ours, key) == _field(base, key), key


def test_lora_gguf_holds_the_peft_pairs(exports):
    peft = {k: v.float().numpy() for k, v in
            load_file(str(exports / "peft" / "adapter_model.safetensors")).items()}
    config = json.loads((exports / "peft" / "adapter_config.json").read_text())
    reader = gguf.GGUFReader(str(exports / "gguf-lora" / "adapter-f32.gguf"))
    got = {t.name: t for t in reader.tensors}
    assert len(got) == len(peft) == 2 * 3 * LAYERS
    assert _field(reader, "adapter.lora.alpha") == [[config["lora_alpha"]]]
    for key, w in peft.items():
        hf = key.removeprefix("base_model.model.").replace(".lora_A", "").replace(".lora_B", "")
        a_or_b = "lora_a" if ".lora_A." in key else "lora_b"
        t = got[f"{_gguf_name(hf)}.{a_or_b}"]
        assert tuple(int(n) for n in reversed(t.shape)) == w.shape, key
        want = _permuted(hf, w) if a_or_b == "lora_b" else w
        assert np.array_equal(np.asarray(t.data).reshape(w.shape), want), key
        assert a_or_b == "lora_a" or np.abs(w).max() > 0, key  # 2 steps moved every B off zero
