"""SVDecode (arXiv 2509.15888): λ = 0 is plain decoding (same tokens, same logits as
transformers' ``generate``), the calibrated μ* is the Newton minimiser of the labels'
cross-entropy under the steered logits (finite differences), the steered logits equal the
closed form computed directly from uncached forwards with adapters on / off, the confidence mask
keeps exactly the tokens its rule names, nothing gets a gradient, and the CLI refuses bad
steering input in one line (exit 2)."""
from __future__ import annotations

import pytest
import torch
import yaml
from click.testing import CliRunner

import rankwise
from rankwise.cli import main
from rankwise.core.ops import disable_adapters
from rankwise.core.protocol import attach_input_hook, input_adapters
from rankwise.engine.svdecode import MuFit, SVDecode, SVDecodeConfig, steered_generate
from rankwise.errors import RankwiseError
from rankwise.testing import randomize_trainable, tiny_llama64

EOS, PROMPT = 95, [3, 4, 5, 6]
METHODS = {"lora": {"r": 4}, "prompt-tuning": {"num_virtual_tokens": 3}}


def warm(name: str):
    model = tiny_llama64(vocab_size=96, pad_token_id=0, bos_token_id=0, eos_token_id=EOS)
    rankwise.apply(model, name, **METHODS[name])
    randomize_trainable(model, std=0.5)  # a "warm start" that moved the distribution
    return model.eval()


def closed_form(z, z_w, z_0, tau, mu):
    """The docstring's update, written out in float64: z + μ (m ⊙ (p_w − p_0))."""
    z, z_w, z_0 = z.double(), z_w.double(), z_0.double()
    p_w, p_0 = torch.softmax(z_w, -1), torch.softmax(z_0, -1)
    m = (p_w >= tau * p_w.max()).double()
    return z + mu * m * (p_w - p_0)


def examples(model=None, n=6, length=7, seed=3):
    """Labelled warm-start examples: random ids, the first two positions masked (a prompt);
    with ``model``, each label is the warm model's own top token there (a "task" the warm start
    moved towards), else the random ids themselves."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, EOS, (length,), generator=g).tolist()
        if model is not None:
            with torch.no_grad():
                top = model(input_ids=torch.tensor([ids])).logits[0, -length:].argmax(-1).tolist()
            ids = ids[:1] + top[:-1]  # label t + 1 = the warm top-1 after position t
        out.append({"input_ids": ids, "labels": [-100, -100] + ids[2:]})
    return out


def label_loss(model, exs, sv, mu):
    """Σ_t CE(y_t, softmax(z_t + μ d_t)) over the labelled positions: the stated objective,
    from uncached forwards with adapters on (z = z_w) and off (z_0)."""
    total = 0.0
    with torch.no_grad():
        for ex in exs:
            x = torch.tensor([ex["input_ids"]])
            y = torch.tensor(ex["labels"][1:])
            keep = y != -100
            z_w = model(input_ids=x).logits[0, -x.shape[1]:][:-1][keep].double()
            with disable_adapters(model):
                z_0 = model(input_ids=x).logits[0][:-1][keep].double()
            d = closed_form(torch.zeros_like(z_w), z_w, z_0, sv.config.mask_ratio, 1.0)
            total += float(torch.nn.functional.cross_entropy(z_w + mu * d, y[keep], reduction="sum"))
    return total


@pytest.mark.parametrize("name", list(METHODS))
def test_calibrated_mu_is_the_newton_minimiser_of_the_label_loss(name):
    """μ* = −L'(0)/L''(0) of L(μ) = Σ CE(y, softmax(z_w + μ d)) (finite differences, 0.1 %);
    the former rule (the KL step from z_0 towards p_w) gives another number."""
    model = warm(name)
    exs = examples(model)
    sv = SVDecode(SVDecodeConfig(mask_ratio=0.05, max_mu=1e9))
    fit = sv.calibrate(model, exs)
    h = 1e-3
    l0, lp, lm = (label_loss(model, exs, sv, m) for m in (0.0, h, -h))
    newton = -((lp - lm) / (2 * h)) / ((lp - 2 * l0 + lm) / h ** 2)
    assert fit.tokens == 6 * 5
    assert abs(fit.mu_star - newton) < 1e-3 * abs(newton) + 1e-6
    assert fit.mu == fit.mu_star > 0 and fit.clipped == ""
    assert abs(fit.loss_plain - l0 / fit.tokens) < 1e-4
    assert abs(fit.loss_steered - label_loss(model, exs, sv, fit.mu) / fit.tokens) < 1e-4
    assert fit.loss_steered < fit.loss_plain  # the quadratic model's minimiser lowers the loss
    assert 0.0 <= fit.token_clip_fraction <= 1.0 and 0.0 <= fit.step_rule_clip_fraction <= 1.0


def test_mu_is_clipped_scaled_and_logged():
    model = warm("lora")
    exs = examples(model)
    free = SVDecode(SVDecodeConfig(mask_ratio=0.05, max_mu=1e9)).calibrate(model, exs)
    assert free.mu_star > 0.05  # this warm start helps its labels, so a positive step
    cap = free.mu_star / 2
    fit = SVDecode(SVDecodeConfig(mask_ratio=0.05, max_mu=cap, strength=0.5)).calibrate(model, exs)
    assert fit.clipped == "max" and abs(fit.mu - 0.5 * cap) < 1e-12
    assert abs(fit.mu_star - free.mu_star) < 1e-9
    assert "clipped at max_mu" in fit.line() and f"{fit.mu_star:.4g}" in fit.line()
    neg = SVDecode()._fit(-2.0, 5, 1.0, 1.0, 0.0, 0.0)
    assert isinstance(neg, MuFit) and neg.mu == 0.0 and neg.clipped == "zero"
    with pytest.raises(RankwiseError, match="--steer-mu"):
        SVDecode().steer(torch.zeros(4), torch.zeros(4), torch.ones(4))
    fixed = SVDecode(SVDecodeConfig(mu=1.5, strength=2.0, max_mu=4.0))
    assert fixed.mu == 3.0
    with pytest.raises(RankwiseError, match="no labelled token"):
        SVDecode().calibrate(model, [{"input_ids": [3, 4], "labels": [-100, -100]}])


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
    sv = SVDecode(SVDecodeConfig(mask_ratio=0.05, strength=0.7, max_mu=50.0))
    mu = sv.calibrate(model, examples(model)).mu
    assert mu != 0.0
    seen: list[torch.Tensor] = []
    toks = steered_generate(model, PROMPT, 4, EOS, sv, on_step=seen.append)
    with torch.no_grad():
        for k, got in enumerate(seen):
            ids = torch.tensor([PROMPT + toks[:k]])
            z_w = model(input_ids=ids).logits[0, -1]          # uncached, adapters (and prefix) on
            with disable_adapters(model):
                z_0 = model(input_ids=ids).logits[0, -1]      # the base: adapters off
            assert float((z_w - z_0).abs().max()) > 1e-2      # the warm start moved something
            want = closed_form(z_w, z_w, z_0, 0.05, mu)
            assert float((got.double() - want).abs().max()) < 1e-5
            assert float((got - z_w).abs().max()) > 1e-4      # and steering moved the logits


def test_closed_form_on_one_vector_to_1e6():
    g = torch.Generator().manual_seed(0)
    z_w, z_0 = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    sv = SVDecode(SVDecodeConfig(mask_ratio=0.2, mu=2.5, max_mu=1e9))
    got = sv.steer(z_w, z_w, z_0)
    assert float((got.double() - closed_form(z_w, z_w, z_0, 0.2, 2.5)).abs().max()) < 1e-6


def test_mask_keeps_exactly_the_confident_tokens():
    sv = SVDecode(SVDecodeConfig(mask_ratio=0.25, mu=1.0))
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
    sv = SVDecode(SVDecodeConfig(mask_ratio=0.05))
    sv.calibrate(model, examples(model))
    steered_generate(model, PROMPT, 3, EOS, sv, on_step=lambda z: modes.append(
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
    (["--steer", "other", "--steer-from", "B"], "decode.steer.name: got 'other'"),
])
def test_cli_bad_steering_input_is_one_line_exit_2(tmp_path, args, needle):
    a = _config(tmp_path / "A", "tiny-llama")
    paths = {"B": _config(tmp_path / "B", "tiny-llama"), "OTHER": _config(tmp_path / "O", "tiny-gpt2")}
    args = [paths.get(x, x) for x in args]
    res = CliRunner().invoke(main, ["generate", a, "--prompt", "x", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and len(res.output.strip().splitlines()) == 1


def old_steered_loop(model, prompt, n, steer, warm=None):
    """The loop SVDecode had before it became a hook (three incremental forwards with their own
    DynamicCache, the steered logits, argmax), kept here as the reference the hook must equal."""
    from transformers import DynamicCache
    warm_model = model if warm is None else warm
    specs = [(model, False)] + ([(warm, False)] if warm is not None else []) + [(warm_model, True)]
    caches = [DynamicCache(config=m.config) for m, _ in specs]
    seen = [0] * len(specs)
    ids, new, logits = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            got = []
            for k, (m, off) in enumerate(specs):
                x = torch.tensor([ids[seen[k]:]])
                ctx = disable_adapters(m) if off else torch.no_grad()
                with ctx:
                    out = m(input_ids=x, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            cache=caches[k], use_cache=True)
                seen[k] = len(ids)
                got.append(out.logits[0, -1])
            z = steer.steer(got[0], got[1] if len(got) == 3 else got[0], got[-1])
            logits.append(z)
            tok = int(z.argmax())
            if tok == EOS:
                break
            new.append(tok)
            ids.append(tok)
    return new, logits


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("separate_warm", [False, True])
def test_steer_hook_equals_the_old_loop(name, separate_warm):
    model = warm(name)
    other = warm(name) if separate_warm else None
    if other is not None:
        randomize_trainable(other, seed=11, std=0.5)
    sv = SVDecode(SVDecodeConfig(mask_ratio=0.05, strength=0.7, max_mu=50.0))
    sv.calibrate(model, examples(model), warm=other)
    want, want_logits = old_steered_loop(model, PROMPT, 6, sv, other)
    seen: list[torch.Tensor] = []
    assert steered_generate(model, PROMPT, 6, EOS, sv, warm=other, on_step=seen.append) == want
    assert len(seen) == len(want_logits) and len(want) == 6
    assert max(float((a - b).abs().max()) for a, b in zip(seen, want_logits)) < 1e-5
