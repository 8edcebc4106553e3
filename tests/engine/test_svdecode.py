"""SVDecode (arXiv 2509.15888): λ = 0 is plain decoding (same tokens, same logits as
transformers' ``generate``), the steered logits equal the closed form computed directly from
uncached forwards with adapters on / off, the confidence mask keeps exactly the tokens its rule
names, nothing gets a gradient, and the CLI refuses bad steering input in one line (exit 2)."""
from __future__ import annotations

import pytest
import torch
import yaml
from click.testing import CliRunner

import rankwise
from rankwise.cli import main
from rankwise.core.ops import disable_adapters
from rankwise.core.protocol import attach_input_hook, input_adapters
from rankwise.engine.svdecode import SVDecode, SVDecodeConfig, steered_generate
from rankwise.errors import RankwiseError
from rankwise.testing import randomize_trainable, tiny_llama64

EOS, PROMPT = 95, [3, 4, 5, 6]
METHODS = {"lora": {"r": 4}, "prompt-tuning": {"num_virtual_tokens": 3}}


def warm(name: str):
    model = tiny_llama64(vocab_size=96, pad_token_id=0, bos_token_id=0, eos_token_id=EOS)
    rankwise.apply(model, name, **METHODS[name])
    randomize_trainable(model, std=0.5)  # a "warm start" that moved the distribution
    return model.eval()


def closed_form(z, z_w, z_0, tau, lam, max_mu, eps=1e-8):
    """The docstring's formula, written out in float64 with explicit sums."""
    z, z_w, z_0 = z.double(), z_w.double(), z_0.double()
    p_w, p_0 = torch.softmax(z_w, -1), torch.softmax(z_0, -1)
    delta = p_w - p_0
    m = (p_w >= tau * p_w.max()).double()
    d = m * delta
    fisher = torch.diag(p_0) - torch.outer(p_0, p_0)  # the softmax Hessian at z_0
    mu = float(d @ delta) / (float(d @ fisher @ d) + eps)
    return z + lam * min(max(mu, 0.0), max_mu) * d


@pytest.mark.parametrize("name", list(METHODS))
def test_strength_zero_is_plain_decoding(name):
    model = warm(name)
    seen: list[torch.Tensor] = []
    toks = steered_generate(model, PROMPT, 8, EOS, SVDecode(SVDecodeConfig(strength=0.0)),
                            on_step=seen.append)
    if input_adapters(model):
        attach_input_hook(model)
    ids = torch.tensor([PROMPT])
    ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                         do_sample=False, temperature=None, top_p=None, top_k=None,
                         eos_token_id=EOS, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    want = ref.sequences[0, len(PROMPT):].tolist()
    want = want[: want.index(EOS)] if EOS in want else want
    assert toks == want and len(toks) == 8
    assert max(float((a - b[0]).abs().max()) for a, b in zip(seen, ref.logits)) < 1e-5


@pytest.mark.parametrize("name", list(METHODS))
def test_steered_logits_equal_the_closed_form(name):
    model = warm(name)
    cfg = SVDecodeConfig(mask_ratio=0.05, strength=0.7, max_mu=50.0)
    seen: list[torch.Tensor] = []
    toks = steered_generate(model, PROMPT, 4, EOS, SVDecode(cfg), on_step=seen.append)
    with torch.no_grad():
        for k, got in enumerate(seen):
            ids = torch.tensor([PROMPT + toks[:k]])
            z_w = model(input_ids=ids).logits[0, -1]          # uncached, adapters (and prefix) on
            with disable_adapters(model):
                z_0 = model(input_ids=ids).logits[0, -1]      # the base: adapters off
            assert float((z_w - z_0).abs().max()) > 1e-2      # the warm start moved something
            want = closed_form(z_w, z_w, z_0, 0.05, 0.7, 50.0)
            assert float((got.double() - want).abs().max()) < 1e-5
            assert float((got - z_w).abs().max()) > 1e-4      # and steering moved the logits


def test_closed_form_on_one_vector_to_1e6_and_mu_is_the_gauss_newton_minimiser():
    g = torch.Generator().manual_seed(0)
    z_w, z_0 = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    sv = SVDecode(SVDecodeConfig(mask_ratio=0.2, strength=1.0, max_mu=1e9))
    got = sv.steer(z_w, z_w, z_0)
    assert float((got.double() - closed_form(z_w, z_w, z_0, 0.2, 1.0, 1e9)).abs().max()) < 1e-6
    # μ* minimises the quadratic model q(μ) = KL'(0) μ + ½ KL''(0) μ² of KL(p_w ‖ softmax(z_0 + μ d)).
    p_w, p_0 = torch.softmax(z_w, -1), torch.softmax(z_0, -1)
    d = (p_w >= 0.2 * p_w.max()) * (p_w - p_0)

    def kl(mu):
        return float((p_w * (p_w.log() - torch.log_softmax(z_0 + mu * d, -1))).sum())
    h = 1e-4
    grad, curv = (kl(h) - kl(-h)) / (2 * h), (kl(h) - 2 * kl(0.0) + kl(-h)) / h ** 2
    mu = float((got.double() - z_w)[d != 0][0] / d[d != 0][0])
    assert abs(mu - (-grad / curv)) < 1e-3 * abs(mu)


def test_mask_keeps_exactly_the_confident_tokens():
    sv = SVDecode(SVDecodeConfig(mask_ratio=0.25))
    p_w = torch.tensor([0.40, 0.30, 0.10, 0.101, 0.099, 0.0])   # threshold 0.25 * 0.40 = 0.10
    assert sv.mask(p_w).tolist() == [True, True, True, True, False, False]
    assert SVDecode(SVDecodeConfig(mask_ratio=1.0)).mask(p_w).tolist() == [True] + [False] * 5
    assert SVDecode(SVDecodeConfig(mask_ratio=0.0)).mask(p_w).all()
    # masked-out tokens keep their logits exactly; kept ones move along p_w - p_0
    z_w, z_0 = p_w.clamp_min(1e-6).log(), torch.zeros(6)
    out = sv.steer(z_w, z_w, z_0)
    assert torch.equal(out[4:], z_w[4:])
    assert ((out[:4] - z_w[:4]).sign() == (p_w[:4] - 1 / 6).sign()).all()


def test_no_gradient_and_no_parameter():
    model = warm("lora")
    n_params = sum(p.numel() for p in model.parameters())
    modes: list[bool] = []
    steered_generate(model, PROMPT, 3, EOS, SVDecode(), on_step=lambda z: modes.append(
        torch.is_grad_enabled() or z.requires_grad))
    assert modes == [False] * 3
    assert all(p.grad is None for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == n_params


def test_bad_config_values_are_refused():
    with pytest.raises(RankwiseError, match="--steer-mask"):
        SVDecode(SVDecodeConfig(mask_ratio=1.5))


def _config(folder, base: str, method: str = "lora"):
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({
        "model": {"path": base, "task": "causal-lm"}, "method": {"name": method},
        "data": {"source": "stdlib-functions", "format": "prompt-completion"}}))
    return str(folder)


@pytest.mark.parametrize("args,needle", [
    (["--steer", "svdecode"], "needs --steer-from"),
    (["--steer-from", "B"], "needs --steer svdecode"),
    (["--steer", "svdecode", "--steer-from", "OTHER"], "same base model"),
    (["--steer", "other", "--steer-from", "B"], "unknown --steer"),
])
def test_cli_bad_steering_input_is_one_line_exit_2(tmp_path, args, needle):
    a = _config(tmp_path / "A", "tiny-llama")
    paths = {"B": _config(tmp_path / "B", "tiny-llama"), "OTHER": _config(tmp_path / "O", "tiny-gpt2")}
    args = [paths.get(x, x) for x in args]
    res = CliRunner().invoke(main, ["generate", a, "--prompt", "x", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and len(res.output.strip().splitlines()) == 1
