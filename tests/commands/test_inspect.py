"""``rankwise inspect`` and ``full`` with ``select``: the gradient spectrum of a 2-layer model
against a direct computation, the neuron masks, the report files and the bad-input line."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from rankwise import registry
from rankwise.adapters.full import FullConfig
from rankwise.cli import main
from rankwise.core.diagnostics import effective_ranks, neuron_scores
from rankwise.commands.inspect.run import gradient_section
from rankwise.testing import error_lines


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.down(torch.tanh(self.up(x))), y)


def _batches(n: int = 3, size: int = 4) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(size, 6, generator=gen), "y": torch.randint(0, 3, (size,), generator=gen)}
            for _ in range(n)]


def _loss(model, batch):
    return model(**batch)


def test_gradient_spectrum_of_a_two_layer_model_matches_a_direct_computation():
    model, batches = TwoLayer(), _batches()
    section = gradient_section([("base", model)], ["up", "down"], batches, _loss)
    model.zero_grad()
    (sum(_loss(model, b) for b in batches) / len(batches)).backward()
    for path, layer in (("up", model.up), ("down", model.down)):
        row = section["states"]["base"][path]
        direct = torch.linalg.svdvals(layer.weight.grad.double())
        # float32 gradients: agreement to 1e-5 of the top singular value (the down layer's third
        # is zero up to rounding: cross-entropy gradients' rows sum to zero)
        assert row["singular_values"] == pytest.approx(direct.tolist(), abs=1e-5 * float(direct[0]))
        assert row["entropy"] == pytest.approx(effective_ranks(direct)["entropy"], rel=1e-4)
        # GoRA's default importance (union_mean), through the registry, from the same gradient: mean |W ⊙ G|.
        assert row["layer_scores"]["gora"] == pytest.approx(float((layer.weight.detach() * layer.weight.grad).abs().mean()), rel=1e-5)
    assert not any(p.requires_grad is False for p in model.parameters())  # flags restored


def test_full_select_trains_only_the_top_neurons():
    model, batches = TwoLayer(), _batches()
    entry = registry.get("method", "full")
    cfg = FullConfig(select="shapley", fraction=0.25, select_targets=["up", "down"])
    sel = entry.apply(model, cfg, "default", iter(batches), loss_fn=_loss)
    weights = {"up": model.up.weight, "down": model.down.weight}
    scores = neuron_scores("shapley", weights, batches, lambda b: _loss(model, b))
    flat = torch.cat([scores["up"], scores["down"]])
    top = set(flat.topk(2).indices.tolist())  # 25 % of 5 + 3 neurons
    assert {i for i in top if i < 5} == set(sel.neurons["up"])
    assert {i - 5 for i in top if i >= 5} == set(sel.neurons["down"])
    model.zero_grad()
    _loss(model, batches[0]).backward()
    for name, layer in (("up", model.up), ("down", model.down)):
        if layer.weight.grad is None:
            assert sel.neurons[name] == []
            continue
        moving = (layer.weight.grad.abs().sum(1) > 0).nonzero().flatten().tolist()
        assert moving == sorted(sel.neurons[name])
        assert (layer.bias.grad != 0).nonzero().flatten().tolist() == sorted(sel.neurons[name])
    plain = TwoLayer()
    assert entry.apply(plain, FullConfig(), "default", None) is None
    assert all(p.requires_grad for p in plain.parameters())
    assert FullConfig(fraction=0.0).problems() and not FullConfig().problems()


def test_inspect_refuses_a_folder_that_is_neither_a_run_nor_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = CliRunner().invoke(main, ["inspect", str(tmp_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    lines = error_lines(result.output)
    assert len(lines) == 1 and "neither a run nor a model" in lines[0]


@pytest.mark.slow
def test_inspect_writes_report_json_and_plots_for_a_run(tiny_bert_run, tmp_path):
    from rankwise.commands.inspect.run import run_inspect
    rep = run_inspect(tiny_bert_run, None, tmp_path / "out", n_batches=1, plots=False)  # plots: the CLI check in docs/inspect.md
    saved = json.loads((tmp_path / "out" / "inspect.json").read_text())
    assert saved["gradients"]["states"].keys() == {"base", "final"}  # a LoRA run: no weight checkpoints
    assert set(saved["gradients"]["states"]["final"]) == {p for p in saved["gradients"]["states"]["base"]}
    assert rep["inverse"]["bound_held_everywhere"] and rep["inverse"]["applicable_cases"] > 0
    assert (tmp_path / "out" / "report.md").read_text().startswith("# rankwise inspect")
    assert json.loads((tmp_path / "out" / "rankwise.json").read_text()) == {"kind": "inspect"}
