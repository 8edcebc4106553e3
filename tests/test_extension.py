"""Adding a method touches only its own module plus one registration.

The method below (an IA3-style per-output scale, ``y = (1 + v) * (W x + b)``) is written the
way a new package under ``rankwise/adapters/`` would be - a config dataclass, a layer that
implements the ``AdapterModule`` protocol, a builder - and registered with one
``registry.register`` call. Nothing else in rankwise is edited, yet it passes the method
contract, trains through ``rankwise train``, saves, resumes and exports like the built-ins.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Union

import pytest
import torch
from torch import nn

from rankwise import registry
from rankwise.core.inject import default_heads, find_targets, inject
from rankwise.core.ops import mark_trainable, set_modules_to_save
from test_contract import DEFAULT, check_method

NAME = "test-ia3"


@dataclass
class ScaleConfig:
    """Settings of the test method (defaults live here only)."""

    name: str = NAME
    targets: Union[list[str], str] = "all-linear"
    modules_to_save: Union[list[str], None] = None
    exclude: list[str] = field(default_factory=list)


class ScaleLayer(nn.Module):
    """``(1 + v) * base(x)`` with one vector ``v`` per named adapter (zero at init)."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.v = nn.ParameterDict()
        self._active: list[str] = []
        self._merged: list[str] = []
        out = base_layer.weight.shape[1 if type(base_layer).__name__ == "Conv1D" else 0]
        self.out_features = out

    def add(self, name: str) -> None:
        self.v[name] = nn.Parameter(torch.zeros(self.out_features))
        self._active.append(name)

    def adapter_names(self):
        return list(self.v.keys())

    def adapter_params(self, name):
        return {"v": self.v[name]}

    def set_active(self, names):
        self._active = [n for n in names if n in self.v]

    def active_names(self):
        return list(self._active)

    def _scale_weight(self, factor: torch.Tensor) -> None:
        w, b = self.base_layer.weight, self.base_layer.bias
        conv1d = type(self.base_layer).__name__ == "Conv1D"
        w.mul_(factor[None, :] if conv1d else factor[:, None])
        if b is not None:
            b.mul_(factor)

    def merge(self, name):
        if name not in self._merged:
            with torch.no_grad():
                self._scale_weight(1 + self.v[name])
            self._merged.append(name)

    def unmerge(self):
        with torch.no_grad():
            while self._merged:
                self._scale_weight(1 / (1 + self.v[self._merged.pop()]))

    def delete(self, name):
        del self.v[name]
        self._active = [n for n in self._active if n != name]

    def describe(self, name):
        return {"out_features": self.out_features}

    def forward(self, x):
        out = self.base_layer(x)
        for name in self._active:
            if name not in self._merged:
                out = out * (1 + self.v[name])
        return out


def apply_scale(model: nn.Module, config: ScaleConfig, adapter_name: str = "default") -> None:
    """The builder: wrap the targets, train only the scales (and the task head)."""
    paths = find_targets(model, config.targets, config.exclude, "method.targets")

    def wrap(path, module):
        layer = module if isinstance(module, ScaleLayer) else ScaleLayer(module)
        layer.add(adapter_name)
        return layer

    inject(model, paths, wrap)
    set_modules_to_save(model, default_heads(model) if config.modules_to_save is None else config.modules_to_save)
    mark_trainable(model, adapter_name)


@pytest.fixture
def registered(monkeypatch):
    """Register the method for one test only (the one line a new package would add)."""
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    registry.names("method")  # built-ins first
    registry.register("method", NAME, ScaleConfig, apply_scale, summary="test: IA3-style scales")
    yield NAME


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_a_new_method_passes_the_contract(registered, kind, tmp_path):
    check_method(registered, kind, tmp_path, spec={**DEFAULT, "lr": 0.1})


@pytest.mark.slow
def test_a_new_method_trains_resumes_and_exports(registered, tmp_path, docstrings_jsonl):
    from click.testing import CliRunner

    import yaml

    from rankwise.cli import main
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": "tiny-bert"}, "data": {"source": str(docstrings_jsonl), "max_length": 24},
        "method": {"name": NAME, "targets": ["query", "value"]}, "optim": {"name": "adamw", "lr": 0.05},
        "train": {"steps": 6, "batch_size": 8, "save_every": 3, "progress": False}}))
    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", str(cfg), "--out", str(run)])
    assert res.exit_code == 0, res.output
    metrics = json.loads((run / "metrics.json").read_text())
    # 2 layers x (query, value) x 32 outputs, plus the 32 x 5 + 5 head (5 stdlib modules)
    assert metrics["trainable_params"] == 4 * 32 + 32 * 5 + 5
    saved = json.loads((run / "adapter" / "rankwise_adapter.json").read_text())
    assert saved["structure"] and all(v == {"out_features": 32} for v in saved["structure"].values())
    for fmt in ("rankwise", "merged"):
        out = CliRunner().invoke(main, ["export", str(run), "--format", fmt, "--out", str(tmp_path / fmt)])
        assert out.exit_code == 0, out.output
    peft = CliRunner().invoke(main, ["export", str(run), "--format", "peft", "--out", str(tmp_path / "p")])
    assert peft.exit_code == 2 and "--format rankwise" in peft.output

    from transformers import AutoModelForSequenceClassification

    from rankwise.recipes.export import load_run
    _, ours, tok = load_run(run)
    merged = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "merged")).eval()
    batch = tok(["Return the difference of two sequences."], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, ours(**batch).logits, atol=1e-5, rtol=0)
