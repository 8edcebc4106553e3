"""``task: {name: memory-decoder}`` through ``rankwise train`` and ``rankwise generate
--memory-decoder``: the run logs the objective's KL and CE parts, resumes exactly, and the CLI's completion is the
two-cache mixture of the base and the trained decoder; another tokenizer, and a datastore too
large for a flat index, are refused in one line (exit 2)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("faiss")

from rankwise.data.formats import end_id  # noqa: E402
from rankwise.tasks.memory_decoder.generation import generate_with_memory  # noqa: E402
from rankwise.recipes.config import load_run_config  # noqa: E402
from rankwise.commands.generate.run import load_for_generation  # noqa: E402
from rankwise.recipes.train import train  # noqa: E402
from test_cli_errors import assert_user_error, invoke, write_yaml  # noqa: E402

TEXT = ["def add(a, b):\n    return a + b", "class Box:\n    def __init__(self):\n        self.items = []",
        "for key, value in sorted(table.items()):\n    print(key, value)", "import os\nos.path.join(a, b)",
        "with open(path) as f:\n    data = f.read()", "if x is None:\n    raise ValueError('x')",
        "try:\n    import json\nexcept ImportError:\n    json = None", "return [x * 2 for x in values]"] * 2


def raw_config(source: Path, base: Path) -> dict:
    return {"model": {"path": "tiny-llama", "task": "memory-decoder"},
            "data": {"source": str(source), "max_length": 24, "eval_fraction": 0.25},
            "method": {"name": "full"}, "optim": {"name": "adamw", "lr": 0.01},
            "memory_decoder": {"base": str(base), "k": 8, "temperature": 5.0},
            "train": {"steps": 2, "batch_size": 4, "eval_batch_size": 16, "save_every": 1,
                      "log_every": 1, "progress": False}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("memdec")
    (root / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT))
    base = {"model": {"path": "tiny-llama", "task": "causal-lm"}, "method": {"name": "full"},
            "data": {"source": str(root / "text.jsonl"), "max_length": 24},
            "optim": {"name": "adamw", "lr": 0.01},
            "train": {"steps": 2, "batch_size": 4, "progress": False, "save_every": 0}}
    train(load_run_config(None, base=base), root / "base")
    train(load_run_config(None, base=raw_config(root / "text.jsonl", root / "base" / "model")), root / "mem")
    return root


@pytest.mark.slow
def test_memory_decoder_run_logs_resumes_and_generates_the_mixture(runs, tmp_path):
    metrics = json.loads((runs / "mem" / "metrics.json").read_text())
    assert {"eval_kl", "eval_ce", "eval_perplexity"} <= set(metrics)
    assert metrics["eval_loss"] == pytest.approx(0.5 * metrics["eval_kl"] + 0.5 * metrics["eval_ce"], rel=1e-6)

    part = tmp_path / "part"  # resume from the step-1 checkpoint = uninterrupted
    shutil.copytree(runs / "mem", part)
    shutil.rmtree(part / "checkpoints" / "step-0000002")
    (part / "metrics.json").unlink()
    resumed = train(load_run_config(None, base=raw_config(runs / "text.jsonl", runs / "base" / "model")),
                    part, resume=True)
    assert resumed["eval_loss"] == metrics["eval_loss"]

    _, base, tok, enc = load_for_generation(runs / "base")
    _, mem, _, _ = load_for_generation(runs / "mem")
    prompt = "def add(a, b):"
    want = tok.decode(generate_with_memory(base, mem, enc.prompt_ids(prompt), 6, end_id(tok), 0.25,
                                           use_cache=False), skip_special_tokens=True)
    res = invoke("generate", runs / "base", "--prompt", prompt, "--max-new-tokens", "6",
                 "--memory-decoder", runs / "mem", "--memory-lambda", "0.25")
    assert res.exit_code == 0, res.output
    assert res.output == want + "\n"

    other = tmp_path / "other"  # the decoder saved with one more token in its tokenizer
    shutil.copytree(runs / "mem" / "model", other)
    tok.add_tokens(["<extra_memdec_token>"])
    tok.save_pretrained(other)
    assert_user_error(invoke("generate", runs / "base", "--prompt", prompt, "--memory-decoder", other),
                      "another tokenizer than the base", "<extra_memdec_token>")

    # a datastore above the memory a flat index may take: one line naming the IVF option
    raw = raw_config(runs / "text.jsonl", runs / "base" / "model")
    raw["memory_decoder"].update(index="flat", flat_max_mb=0.001)
    assert_user_error(invoke("train", write_yaml(tmp_path / "c.yaml", raw), "--out", tmp_path / "flat"),
                      "flat index", "task.index: ivf")
