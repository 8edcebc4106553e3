"""``rankwise bench forgetting``: the held-out loss it reports, its byte count, and its reuse of
per-run pieces, on the committed reference base (nothing trains)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch.nn import functional as F

from rankwise.testing import tiny_llama64
from rankwise_bench.common import RESULTS, reference_base
from rankwise_bench.forgetting import heldout_windows, pretraining_loss, run, target_bytes


def test_the_loss_is_the_mean_next_token_cross_entropy_and_per_byte_divides_the_same_sum():
    model = tiny_llama64(vocab_size=64)
    ids = torch.randint(0, 64, (5, 9), generator=torch.Generator().manual_seed(0))
    got = pretraining_loss(model, ids, n_bytes=123, batch=2)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    direct = F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1), reduction="sum").item()
    assert got["tokens"] == 40 and abs(got["loss_per_token"] - direct / 40) < 1e-6
    assert abs(got["loss_per_byte"] - direct / 123) < 1e-6


def test_target_bytes_count_every_utf8_byte_plus_the_dummy_prefix_space():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(reference_base()))
    for text in ("def f(x):\n    return x  # é ✓ 中", "import os\n\tpass"):
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        assert target_bytes(tok, ids) == len(text.encode()) + 1   # SentencePiece's leading "▁"


def test_held_out_windows_come_only_from_held_out_modules_and_are_fixed():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(reference_base()))
    a, b = heldout_windows(tok, seq=16, windows=6), heldout_windows(tok, seq=16, windows=6)
    assert a.shape == (6, 16) and torch.equal(a, b) and int(a[0, 0]) == tok.bos_token_id


def test_an_unchanged_model_forgets_nothing_and_pieces_are_reused(tmp_path):
    """A 'fine-tuned' model equal to the base rises by exactly 0; a second call reads the pieces
    without loading any model; a changed metrics.json is measured again."""
    from transformers import AutoModelForCausalLM
    compare = tmp_path / "cmp"
    for row, seed in (("lora", 0), ("lora", 1), ("full", 0)):
        run_dir = compare / row / f"seed{seed}"
        run_dir.mkdir(parents=True)
        shutil.copy(RESULTS / "compare-reference" / "lora" / "lr0.002" / "metrics.json", run_dir)
    loaded = []

    def load(run_dir: Path):
        loaded.append(run_dir.name)
        return AutoModelForCausalLM.from_pretrained(str(reference_base())).float()

    res = run(tmp_path / "out", compare, seq=32, windows=4, load=load)
    assert len(loaded) == 3 and res["summary"]["lora"]["seeds"] == 2
    for row in ("lora", "full"):
        assert abs(res["summary"][row]["rise_per_byte_mean"]) < 1e-6
    assert "| nanoadam | 0 | — | not yet run |" in (tmp_path / "out" / "results.md").read_text()
    run(tmp_path / "out", compare, seq=32, windows=4, load=load)
    assert len(loaded) == 3
    m = compare / "full" / "seed0" / "metrics.json"
    m.write_text(json.dumps({**json.loads(m.read_text()), "eval_loss": 9.0}))
    res = run(tmp_path / "out", compare, seq=32, windows=4, load=load)
    assert loaded[3:] == ["seed0"] and res["summary"]["full"]["task_eval_loss_mean"] == 9.0
