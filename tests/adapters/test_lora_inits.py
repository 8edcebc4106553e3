"""LoRA initialisations (``method.init``, docs/lora-inits.md): each init's defining property,
rankwise's factors equal to PEFT's on the same weights (PiSSA, randomised PiSSA, OLoRA, CorDA),
the rank-2r PEFT export of a residual init on the untouched base, checkpoints keeping A0/B0, and
the one-line errors."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rankwise.adapters.lora import LoraConfig, apply_lora, export_peft
from rankwise.adapters.lora import inits
from rankwise.adapters.lora.calibrate import input_statistics
from rankwise.errors import RankwiseError
from rankwise.testing import error_lines, randomize_trainable, tiny_batch, tiny_llama_lm

peft = pytest.importorskip("peft")

R, ALPHA = 3, 6.0  # s = 2: the factors must carry the 1/s


class Two(nn.Module):
    """Two linear layers, the input of the second one the output of the first."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 12)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _ours(init: str, batches=None):
    model = Two()
    layers = apply_lora(model, LoraConfig(r=R, alpha=ALPHA, targets=["up", "down"], init=init),
                        batches=batches)
    return model, layers


def _peft(init):
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["up", "down"], init_lora_weights=init)
    return peft.get_peft_model(Two(), cfg)


def _ab(layer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.lora_A["default"].weight, layer.lora_B["default"].weight


def _residual(layer) -> torch.Tensor:
    a0, b0 = layer.adapter_buffers("default").values()
    return layer.base_layer.weight - layer.scaling["default"] * b0 @ a0


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_factors_and_residual_base_equal_peft(init):
    _, ours = _ours(init)
    theirs = _peft(init)
    for name in ("up", "down"):
        mine, ref = ours[name], theirs.base_model.model.get_submodule(name)
        for x, y in zip(_ab(mine), _ab(ref)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
        torch.testing.assert_close(_residual(mine), ref.base_layer.weight, atol=1e-5, rtol=0)


def test_randomised_pissa_equals_peft_from_the_same_seed():
    ref = _peft(True).base_model.model.up
    w = ref.base_layer.weight.detach().clone()
    torch.manual_seed(9)
    ref.pissa_init("default", "pissa_niter_2")
    torch.manual_seed(9)
    a, b = inits.pissa(w, R, ALPHA / R, niter=2)
    torch.testing.assert_close(a, ref.lora_A["default"].weight, atol=1e-5, rtol=0)
    torch.testing.assert_close(b, ref.lora_B["default"].weight, atol=1e-5, rtol=0)


def test_pissa_is_the_top_r_svd_part_and_the_base_stays():
    original = Two().up.weight.detach().clone()
    _, layers = _ours("pissa")
    layer = layers["up"]
    s = layer.scaling["default"]
    u, sv, vh = torch.linalg.svd(original, full_matrices=False)
    top = u[:, :R] @ torch.diag(sv[:R]) @ vh[:R]
    ba = s * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(ba, top, atol=1e-5, rtol=0)
    torch.testing.assert_close(_residual(layer) + ba, original, atol=1e-5, rtol=0)
    assert torch.equal(layer.base_layer.weight, original)  # rankwise leaves the loaded base as is


def test_olora_reconstructs_and_b_is_orthonormal():
    original = Two().down.weight.detach().clone()
    _, layers = _ours("olora")
    layer = layers["down"]
    a, b = _ab(layer)
    rebuilt = _residual(layer) + layer.scaling["default"] * b @ a
    torch.testing.assert_close(rebuilt, original, atol=1e-5, rtol=0)
    torch.testing.assert_close(b.T @ b, torch.eye(R), atol=1e-5, rtol=0)


def _x_batches(n=3):
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(4, 5, 16, generator=g)} for _ in range(n)]


def test_corda_equals_peft_given_the_same_covariance(tmp_path):
    model = Two()
    stats = input_statistics(model, ["up", "down"], {"up": 16, "down": 24}, _x_batches(), "corda")
    cov_file = tmp_path / "cov.pt"
    torch.save({k: v.covariance() for k, v in stats.items()}, cov_file)
    _, ours = _ours("corda", batches=_x_batches())
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["up", "down"], init_lora_weights="corda",
                          corda_config=peft.tuners.lora.config.CordaConfig(
                              covariance_file=str(cov_file), corda_method="ipm"))
    theirs = Two()
    from peft.tuners.lora.corda import preprocess_corda
    preprocess_corda(theirs, cfg)
    theirs = peft.get_peft_model(theirs, cfg)
    for name in ("up", "down"):
        mine, ref = ours[name], theirs.base_model.model.get_submodule(name)
        for x, y in zip(_ab(mine), _ab(ref)):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(_residual(mine), ref.base_layer.weight, atol=1e-5, rtol=0)
        # reconstruction identity: residual + s B A is the weight as loaded
        ba = mine.scaling["default"] * mine.lora_B["default"].weight @ mine.lora_A["default"].weight
        torch.testing.assert_close(_residual(mine) + ba, Two().get_submodule(name).weight, atol=1e-5, rtol=0)


def test_loftq_error_below_plain_nf4():
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    w = torch.randn(64, 128) @ torch.diag(torch.linspace(2, 0.1, 128))
    plain = (w - inits.nf4_roundtrip(w)).norm().item()
    errs = []
    for t in (1, 3):
        a, b, q, _, _ = inits.loftq(w, 8, 2.0, t)
        errs.append((w - (q + 2.0 * b @ a)).norm().item())
        # A, B are PEFT's SVD split of the residual W - Q (scale 1 here: PEFT ignores alpha)
        ref = peft.utils.loftq_utils._low_rank_decomposition(w - q, reduced_rank=8)
        a1, b1, _, _, _ = inits.loftq(w, 8, 1.0, t)
        torch.testing.assert_close(a1, ref["R"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b1, ref["L"], atol=1e-4, rtol=1e-4)
    # measured (64x128, r = 8): plain NF4 10.06, one alternation 8.23, three 7.42
    assert plain == pytest.approx(10.06, abs=0.02)
    assert errs[0] == pytest.approx(8.23, abs=0.02) and errs[1] == pytest.approx(7.42, abs=0.02)


def test_eva_rows_are_top_right_singular_vectors_and_ranks_sum_to_budget():
    model = tiny_llama_lm()
    batches = [tiny_batch("llama", seed=20 + i) for i in range(3)]
    seen: dict[str, list] = {}
    targets = ["q_proj", "v_proj", "down_proj"]

    def keep(path):
        return lambda mod, args: seen.setdefault(path, []).append(args[0].reshape(-1, args[0].shape[-1]))

    hooks = [m.register_forward_pre_hook(keep(p)) for p, m in model.named_modules()
             if p.rsplit(".", 1)[-1] in targets]
    with torch.no_grad():
        for b in batches:
            model(**b)
    for h in hooks:
        h.remove()
    layers = apply_lora(model, LoraConfig(r=2, targets=targets, init="eva", eva_rho=2.0), batches=batches)
    ranks = {p: layer.ranks["default"] for p, layer in layers.items()}
    assert sum(ranks.values()) == 2 * len(seen)                      # the budget, redistributed
    assert max(ranks.values()) <= 4 and len(set(ranks.values())) > 1
    for p, layer in layers.items():
        x = torch.cat(seen[p])
        _, _, vh = torch.linalg.svd(x - x.mean(0), full_matrices=False)
        a = layer.lora_A["default"].weight
        cos = (a * vh[: a.shape[0]]).sum(1).abs()                     # up to the sign
        torch.testing.assert_close(cos, torch.ones_like(cos), atol=1e-3, rtol=0)
        assert layer.lora_B["default"].weight.abs().max() == 0
        assert layer.scaling["default"] == pytest.approx(LoraConfig().alpha / 2)  # alpha moved with r


@pytest.mark.parametrize("init", ["pissa", "olora", "corda"])
def test_residual_export_applies_to_the_untouched_base(init, tmp_path):
    base = tiny_llama_lm()
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(r=2, alpha=4, init=init, use_rslora=init == "olora"),
               batches=[tiny_batch("llama", seed=20)])
    randomize_trainable(model)
    batch = {k: v for k, v in tiny_batch("llama", seed=11).items() if k != "labels"}
    with torch.no_grad():
        trained = model(**batch).logits
    export_peft(model, tmp_path / "peft")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "peft")
    assert loaded.peft_config["default"].r == 4                    # [B, -B0] [A; A0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, trained, atol=1e-5, rtol=0)


def test_checkpoint_keeps_the_initial_factors(tmp_path):
    from rankwise.core.io import rebuild, structure
    from rankwise.recipes.checkpoint import load_checkpoint, save_checkpoint

    model = tiny_llama_lm()
    cfg = LoraConfig(r=2, init="pissa")
    apply_lora(model, cfg)
    randomize_trainable(model)
    batch = {k: v for k, v in tiny_batch("llama", seed=11).items() if k != "labels"}
    with torch.no_grad():
        trained = model(**batch).logits
    folder = save_checkpoint(tmp_path, 1, model, {})
    fresh = tiny_llama_lm()
    rebuild(fresh, cfg, "default", structure(model))
    load_checkpoint(folder, fresh, type("E", (), {"load_state_dict": lambda self, s: None})())
    with torch.no_grad():
        torch.testing.assert_close(fresh(**batch).logits, trained, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kw, match", [
    ({"init": "svd"}, r"method\.init: got 'svd'; expected one of kaiming, gaussian, pissa, pissa_niter_N"),
    ({"init": "pissa_niter_0"}, r"method\.init: got 'pissa_niter_0'"),
    ({"init": "eva"}, r"method\.init: eva needs calibration batches: set train\.calibration_batches"),
    ({"init": "corda"}, r"method\.init: corda needs calibration batches"),
    ({"init": "loftq"}, r"method\.init: loftq needs a 4-bit base, but '.*' is not quantized; "
                        r"set model\.quantize: nf4"),
    ({"init": "pissa", "use_dora": True}, r"method\.init: pissa with use_dora is not supported"),
])
def test_bad_init_is_one_line(kw, match):
    with pytest.raises(RankwiseError, match=match) as err:
        apply_lora(tiny_llama_lm(), LoraConfig(r=2, **kw))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("sets, needle", [
    (["method.init=svd"], "method.init: got 'svd'; expected one of kaiming, gaussian, pissa, "
                          "pissa_niter_N, olora, loftq, eva, corda"),
    (["method.init=eva", "train.calibration_batches=0"],
     "method.init: eva needs calibration batches, but train.calibration_batches is 0; set it >= 1"),
    (["method.init=corda", "train.calibration_batches=0"], "method.init: corda needs calibration batches"),
    (["method.init=loftq"], "method.init: loftq needs a 4-bit base (got model.quantize: None); "
                            "set model.quantize: nf4"),
], ids=["unknown", "eva-no-data", "corda-no-data", "loftq-no-4bit"])
def test_cli_refuses_bad_inits_with_one_line_and_exit_2(tmp_path, sets, needle):
    import yaml
    from click.testing import CliRunner

    from rankwise.cli import main
    raw = {"model": {"path": "tiny-bert", "task": "classification"}, "data": {"source": "demo"},
           "method": {"name": "lora", "r": 2}, "train": {"steps": 1, "progress": False}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    args = ["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "out")]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(main, args)
    lines = error_lines(result.stderr)
    assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], result.output


@pytest.mark.slow  # two short runs through the recipe (data, eval, plots): ~3 s warm, 11 s cold
def test_train_recipe_calibrates_resumes_and_exports_corda(tmp_path, monkeypatch):
    """``rankwise train`` hands its calibration batches to CorDA; a run resumed from its step-2
    checkpoint ends where the uninterrupted one does, without calibrating again; PEFT loads the
    export onto the untouched base with the run's logits."""
    import shutil

    import rankwise.adapters.lora.apply as lora_apply
    from rankwise.engine import get_task
    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.export import export_run, load_run
    from rankwise.recipes.model import load_model
    from rankwise.recipes.train import train

    raw = {"model": {"path": "tiny-bert", "task": "classification"},
           "data": {"source": "demo", "max_length": 16, "limit": 48},
           "method": {"name": "lora", "r": 2, "targets": ["query", "value"], "init": "corda"},
           "optim": {"name": "adamw", "lr": 0.01},
           "train": {"steps": 4, "batch_size": 4, "save_every": 2, "calibration_batches": 2,
                     "progress": False}}
    full = train(load_run_config(None, base=copy.deepcopy(raw)), tmp_path / "full")
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step-0000004")
    (part / "metrics.json").unlink()
    shutil.rmtree(part / "adapter")

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibration ran again on resume")

    monkeypatch.setattr(lora_apply, "input_statistics", no_calibration)
    resumed = train(load_run_config(None, base=copy.deepcopy(raw)), part, resume=True)
    assert resumed["eval_loss"] == full["eval_loss"]
    cfg, model, _ = load_run(tmp_path / "full")
    batch = {k: v for k, v in tiny_batch("bert", seed=11).items() if k != "labels"}
    export_run(tmp_path / "full", "peft", tmp_path / "peft")
    base, _ = load_model("tiny-bert", get_task("classification"), cfg.model.num_labels, seed=cfg.train.seed)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(**batch).logits, model(**batch).logits, atol=1e-5, rtol=0)


def test_rankwise_merge_takes_the_whole_delta_of_a_residual_init(tmp_path):
    """``rankwise merge`` of one PiSSA adapter (linear, weight 1) gives the trained model on the
    untouched base: the merge reads [B, -B0][A; A0], not the trainable pair alone."""
    from rankwise.core.io import save_adapter
    from rankwise.engine import get_task
    from rankwise.commands.merge.config import MergeConfig
    from rankwise.commands.merge.rules import rule_config
    from rankwise.commands.merge.run import merge_sources
    from rankwise.recipes.model import load_model

    def base():
        return load_model("tiny-llama", get_task("causal-lm"))[0].eval()

    model = base()
    cfg = LoraConfig(r=2, alpha=4, targets=["q_proj", "v_proj"], init="pissa")
    apply_lora(model, cfg)
    randomize_trainable(model)
    batch = {k: v for k, v in tiny_batch("llama", seed=11).items() if k != "labels"}
    with torch.no_grad():
        trained = model(**batch).logits
    save_adapter(model, tmp_path / "adapter", cfg)
    merge_sources([tmp_path / "adapter"], MergeConfig(rule=rule_config("linear"), weights=[1.0]), tmp_path / "m")
    theirs = peft.PeftModel.from_pretrained(base(), tmp_path / "m").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(**batch).logits, trained, atol=1e-5, rtol=0)


def test_calibration_leaves_padding_out():
    """Padded positions (attention_mask 0) add nothing to the input statistics."""
    model = tiny_llama_lm()
    full = tiny_batch("llama", seed=20)
    cut = {k: v[:, :5] for k, v in full.items()}                  # the real tokens only
    padded = {k: v.clone() for k, v in full.items()}
    padded["attention_mask"][:, 5:] = 0
    path = "model.layers.0.mlp.down_proj"
    width = model.get_submodule(path).in_features
    # causal attention: the first 5 positions see the same context either way
    a = input_statistics(model, [path], {path: width}, [cut], "eva")[path]
    b = input_statistics(model, [path], {path: width}, [padded], "eva")[path]
    assert a.count == b.count == 2 * 5
    torch.testing.assert_close(b.gram, a.gram, atol=1e-4, rtol=1e-5)
