"""Streaming block-Oja tracking (``projector: oja``): convergence to the top-r subspace on
stationary streams (float and quantized trackers), unbiased rounding, GaLore/SUMO wiring, and
the configuration errors."""
import pytest
import torch

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.errors import RankwiseError
from rankwise.optim import oja, projector
from rankwise.optim.galore import GaLoreAdamW
from rankwise.optim.sumo import SumoOptimizer

D, K, R = 32, 64, 4
SPECTRUM = torch.cat([torch.tensor([4.0, 3.5, 3.0, 2.5]), torch.linspace(1.0, 0.2, D - R)])


def _stream_matrix(seed=0):
    """``A = U0 diag(SPECTRUM) Q^T``: its left top-R subspace is ``U0[:, :R]``."""
    g = torch.Generator().manual_seed(seed)
    u0 = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
    q = torch.linalg.qr(torch.randn(K, D, generator=g))[0]
    return u0 @ torch.diag(SPECTRUM) @ q.T, u0[:, :R]


def _random_start(seed=5):
    g = torch.Generator().manual_seed(seed)
    return {"proj_side": torch.tensor(projector.LEFT),
            "proj_basis": torch.linalg.qr(torch.randn(D, R, generator=g))[0]}


def _track_rotations(bits, steps=300):
    """Stationary stream G_t = A R_t (R_t random orthogonal): G_t G_t^T = A A^T at every step,
    while no two gradients are equal. Starts from a random basis; returns angles over time."""
    a, top = _stream_matrix()
    state, g = _random_start(), torch.Generator().manual_seed(1)
    angles = []
    for _ in range(steps):
        rot = torch.linalg.qr(torch.randn(K, K, generator=g))[0]
        oja.track(state, a @ rot, R, 1.0, bits, g)
        angles.append(float(oja.principal_angles(projector.basis(state), top).max()))
    return angles, state


def test_float_tracker_converges_to_the_top_subspace():
    angles, state = _track_rotations(None)
    assert angles[0] > 0.3                     # from a random start...
    assert angles[50] < 1e-5 and angles[-1] < 1e-5   # ...to the top-R subspace (float32 floor)
    q = state["proj_basis"]
    assert torch.allclose(q.T @ q, torch.eye(R), atol=1e-5)


@pytest.mark.parametrize("bits,floor", [(8, 0.03), (4, 0.3)])
def test_quantized_tracker_converges_to_its_rounding_floor(bits, floor):
    angles, state = _track_rotations(bits)
    assert state["proj_basis"].dtype == torch.int8 and state["proj_scale"].shape == (R,)
    assert int(state["proj_basis"].abs().max()) <= 2 ** (bits - 1) - 1
    assert max(angles[-50:]) < floor < angles[0]   # measured: ~0.01 (8 bits), ~0.16 (4 bits)


def test_noisy_stationary_stream():
    """Gaussian gradients G = U diag(SPECTRUM)^(1/2) Z (256 columns): the tracker settles within a
    small angle of U's top subspace (a constant Oja step leaves a noise floor; measured 0.11)."""
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
    root = u @ torch.diag(SPECTRUM.sqrt())
    state = _random_start()
    for _ in range(400):
        oja.track(state, root @ torch.randn(D, 256, generator=g), R, 1.0, None, g)
    assert float(oja.principal_angles(state["proj_basis"], u[:, :R]).max()) < 0.15


def test_stochastic_rounding_is_unbiased():
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    mean = torch.zeros_like(x)
    for _ in range(4000):
        codes, scale = oja.stochastic_round(x, 3, g)
        mean += codes.float() * scale / 4000
    step = x.abs().amax(0) / 3
    assert (mean - x).abs().max() < 0.05 * step.max()    # one grid step is x_max / 3


def test_first_oja_step_is_galore_and_state_is_its_formula():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(12, 20, generator=g)
    grads = [torch.randn(12, 20, generator=g) for _ in range(3)]
    svd_w, oja_w = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    svd_opt = GaLoreAdamW([{"params": [svd_w], "rank": 4, "update_every": 100}], lr=0.1)
    oja_opt = GaLoreAdamW([{"params": [oja_w], "rank": 4, "projector": "oja", "oja_bits": 8}], lr=0.1)
    svd_w.grad, oja_w.grad = grads[0], grads[0].clone()
    svd_opt.step()
    oja_opt.step()
    torch.testing.assert_close(oja_w.detach(), svd_w.detach(), atol=2e-2, rtol=0)  # 8-bit basis
    first = projector.basis(oja_opt.state[oja_w]).clone()
    for gr in grads[1:]:
        oja_w.grad = gr
        oja_opt.step()
    assert not torch.equal(projector.basis(oja_opt.state[oja_w]), first)   # moved every step
    st = oja_opt.state[oja_w]
    nbytes = sum(t.numel() * t.element_size() for t in st.values() if t.ndim > 0)
    assert nbytes == 4 * (2 * 20 * 4 + projector.basis_numel((12, 20), 4, 8))   # 2nr + mr/4 + r


def test_sumo_with_oja_transports_its_moment_every_step():
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(10, 16, generator=g))
    opt = SumoOptimizer([{"params": [w], "rank": 3, "projector": "oja"}], lr=0.01)
    for _ in range(3):
        w.grad = torch.randn(10, 16, generator=g)
        before = projector.basis(opt.state[w]).clone() if opt.state[w] else None
        moment = opt.state[w]["momentum"].clone() if opt.state[w] else None
        grad = w.grad.clone()
        opt.step()
        if before is not None:
            st = opt.state[w]
            q = projector.basis(st)
            expect = 0.9 * ((q.T @ before) @ moment) + q.T @ grad
            torch.testing.assert_close(st["momentum"], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,over,message", [
    ("galore", {"oja_bits": 8}, "oja_bits: got 8 with projector 'svd'"),
    ("galore", {"projector": "oja", "oja_bits": 16},
     "oja_bits: got 16; expected an integer in 2..8 or null (int8 codes)"),
    ("galore-is", {"projector": "oja"}, "select: sampled draws directions from an SVD"),
    ("sumo", {"projector": "oja", "oja_lr": 0}, "oja_lr: got 0.0; expected a value > 0 such as 1.0"),
    ("adamw", {"projector": "oja"}, "optim.projector: unknown key"),
    ("q3r", {"oja_bits": 8}, "optim.oja_bits: unknown key"),
])
def test_oja_options_are_checked(name, over, message):
    with pytest.raises(RankwiseError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_dict(registry.get("optimizer", name).config_cls, {"name": name, **over}, "optim")
