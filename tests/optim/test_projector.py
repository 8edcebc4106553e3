"""The shared projector: orientation, shapes, subspaces, transport, state_dict round trip."""
import io

import pytest
import torch

from rankwise.optim import projector as pj


@pytest.mark.parametrize("shape,rank,side", [
    ((8, 4), 2, pj.RIGHT),     # tall: compress the columns
    ((4, 8), 2, pj.LEFT),      # wide: compress the rows
    ((6, 6), 3, pj.RIGHT),     # square: GaLore's m >= n rule
    ((8, 4), 4, pj.IDENTITY),  # rank == min(m, n)
    ((4, 8), 9, pj.IDENTITY),  # rank > min(m, n)
])
def test_choose_side(shape, rank, side):
    assert pj.choose_side(shape, rank) == side


@pytest.mark.parametrize("shape", [(8, 4), (4, 8), (6, 6)])
def test_project_shapes_and_best_rank_r(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    state = {}
    assert pj.refresh(state, g, 2) is None
    q = state["proj_basis"]
    assert q.shape == (min(shape), 2)
    assert torch.allclose(q.T @ q, torch.eye(2), atol=1e-5)
    low = pj.project(state, g)
    assert low.shape == ((max(shape), 2) if shape[0] >= shape[1] else (2, max(shape)))
    # Projecting the gradient onto its own top-2 subspace and back is the best rank-2 approximation.
    u, s, vh = torch.linalg.svd(g)
    best = u[:, :2] @ torch.diag(s[:2]) @ vh[:2]
    assert torch.allclose(pj.project_back(state, low), best, atol=1e-5)


def test_identity_mode_is_a_no_op():
    g = torch.randn(3, 5)
    state = {}
    pj.refresh(state, g, 3)
    assert int(state["proj_side"]) == pj.IDENTITY and "proj_basis" not in state
    assert pj.project(state, g) is g and pj.project_back(state, g) is g


def test_orientation_is_read_from_state_not_shape():
    # A projected tensor that happens to be square is mapped back by the recorded side.
    state = {"proj_side": torch.tensor(pj.LEFT), "proj_basis": torch.linalg.qr(torch.randn(4, 2))[0]}
    low = torch.randn(2, 2)
    assert torch.allclose(pj.project_back(state, low), state["proj_basis"] @ low)
    state["proj_side"] = torch.tensor(pj.RIGHT)
    assert torch.allclose(pj.project_back(state, low), low @ state["proj_basis"].T)


def test_eigh_gives_the_svd_subspace():
    g = torch.randn(6, 20, generator=torch.Generator().manual_seed(1))
    a, b = {}, {}
    pj.refresh(a, g, 3, method="svd")
    pj.refresh(b, g, 3, method="eigh")
    pa, pb = a["proj_basis"] @ a["proj_basis"].T, b["proj_basis"] @ b["proj_basis"].T
    assert torch.allclose(pa, pb, atol=1e-4)


def test_sampling_probabilities_follow_singular_values():
    s = torch.tensor([6.0, 3.0, 1.0])
    counts = torch.zeros(3)
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        counts[pj.select_columns(s, 1, "sampled", g)] += 1
    assert torch.allclose(counts / 3000, s / s.sum(), atol=0.03)
    assert pj.select_columns(s, 2, "top").tolist() == [0, 1]


@pytest.mark.parametrize("shape", [(8, 4), (4, 8)])
def test_transport_formula(shape):
    gen = torch.Generator().manual_seed(2)
    state = {}
    pj.refresh(state, torch.randn(*shape, generator=gen), 2)
    old = state["proj_basis"]
    full = torch.randn(*shape, generator=gen)          # a full-size moment
    moment = pj.project(state, full)                   # its old coordinates
    pj.refresh(state, torch.randn(*shape, generator=gen), 2)
    new = state["proj_basis"]
    moved = pj.transport(state, old, moment)
    # Transport = project the old subspace's part of the moment onto the new basis.
    kept = pj.project_back({"proj_side": state["proj_side"], "proj_basis": old}, moment)
    assert torch.allclose(moved, pj.project(state, kept), atol=1e-5)
    assert torch.allclose(pj.transport(state, new, moved), moved)


def test_state_round_trips_with_weights_only_load():
    g = torch.randn(5, 9)
    state = {}
    pj.refresh(state, g, 2)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert torch.equal(pj.project_back(back, pj.project(back, g)), pj.project_back(state, pj.project(state, g)))
