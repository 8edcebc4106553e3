"""GLVQ: each weight group quantized on its own learned lattice, decoded by one small matmul."""
from __future__ import annotations

import torch

from rankwise.compress.base import Compressed, Compressor
from rankwise.compress.formats import pack_bits, unpack_bits

# Step of the optimal uniform quantizer of N(0, 1) in units of σ, by bits (Max, 1960).
GAUSS_STEP = {1: 1.596, 2: 0.996, 3: 0.586, 4: 0.335}
# Range of the companding parameter μ. The notes clamp it to [10, 255]; the lower end here is
# 0.01 (F is then the identity to 0.5%) so a group whose weights are close to Gaussian can
# turn companding off: measured on Gaussian weights, μ >= 10 raised the error at 2-4 bits.
MU_RANGE = (0.01, 255.0)


def compand(x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """μ-law ``F(x) = sgn(x) · ln(1 + μ|x|) / ln(1 + μ)`` (``mu`` broadcasts)."""
    return torch.sign(x) * torch.log1p(mu * x.abs()) / torch.log1p(mu)


def expand(y: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Inverse μ-law ``F⁻¹(y) = sgn(y) · ((1 + μ)^{|y|} − 1) / μ``."""
    return torch.sign(y) * torch.expm1(y.abs() * torch.log1p(mu)) / mu


class GLVQ(Compressor):
    """GLVQ, grouped lattice vector quantization (arXiv 2510.20984; the official repository
    ``xzhang9308/GLVQ`` holds only a README): the weights are cut into groups (``group_rows × group_size``); each
    group has its own generator ``G_g`` (``d × d``), and every run of ``d`` consecutive weights
    of a row is a lattice point ``G_g z`` with ``z`` a vector of ``bits``-bit integers. Encoding
    is Babai rounding ``z = ⌊G_g⁻¹ w⌉``; decoding is one ``d × d`` matmul per vector, then the
    inverse companding. Per group, alternately: Babai-round all vectors; take Adam steps on
    ``G_g`` (and the companding ``μ_g``) against the group's output error
    ``tr(E_g H_gg E_gᵀ)``, ``E_g = W_g − Ŵ_g`` under the Gram block of its input columns. The
    best iterate by that error is kept.

    Choices where the sources leave room (the official code is unreleased; see the notes):

    * codes are offset by ½ (``ŵ = G (z + ½)``, ``z ∈ [−2^{b−1}, 2^{b−1} − 1]``) so every bit
      width, 1 included, gives a grid symmetric about 0;
    * the group is scaled by its largest magnitude before μ-law companding (μ-law needs
      values in [−1, 1]); the error is measured on the decoded (expanded) weights;
    * each group starts from the best (by the error) of four: ``μ_g`` at
      ``100 · tanh(κ_g / 10)`` (κ: kurtosis, the notes' rule) or at 0.01 (no companding),
      times ``G_g`` at ``δ_b · chol(cov_g)`` (``δ_b``: the optimal uniform step for a
      Gaussian at ``b`` bits) or the scalar grid ``(2 / 2^b) I``; ``μ_g`` is then learned
      in [0.01, 255] (see :data:`MU_RANGE`);
      no ``λ‖G − G⁽⁰⁾‖²`` term and no salience-based bit allocation (every group gets ``bits``);
    * the cross-group terms of ``H`` are ignored (no GPTQ-style error feedback).

    Storage: codes bit-packed at ``bits``; per group ``G_g`` (float16, ``d × d``), the scale and
    ``μ_g`` (float16). The stored float16 parameters are the ones used to encode, so
    ``decode`` followed by Babai rounding returns the stored codes exactly.
    """

    # ----- layout --------------------------------------------------------------------------
    def _grid(self, shape: tuple[int, int]) -> tuple[int, int, int, int]:
        out_f, in_f = shape
        gr = self.config.group_rows or out_f
        return out_f // gr, in_f // self.config.group_size, gr, self.config.group_size

    def _group(self, w: torch.Tensor) -> torch.Tensor:
        nr, nc, gr, gs = self._grid(tuple(w.shape))
        return w.reshape(nr, gr, nc, gs).permute(0, 2, 1, 3).reshape(nr * nc, gr, gs)

    def _ungroup(self, g: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        nr, nc, gr, gs = self._grid(shape)
        return g.reshape(nr, nc, gr, gs).permute(0, 2, 1, 3).reshape(shape)

    # ----- the quantizer ---------------------------------------------------------------------
    def _box(self) -> tuple[int, int]:
        b = self.config.bits
        return -(2 ** (b - 1)), 2 ** (b - 1) - 1

    def babai(self, gen: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Babai rounding of vectors ``v`` ``(G, N, d)`` on generators ``gen`` ``(G, d, d)``:
        ``clamp(round(G⁻¹ v − ½))``, as float codes ``(G, N, d)``."""
        lo, hi = self._box()
        coords = torch.linalg.solve(gen, v.transpose(1, 2)).transpose(1, 2)
        return torch.clamp(torch.round(coords - 0.5), lo, hi)

    def _weights(self, gen, mu, scale, z, gr, gs) -> torch.Tensor:
        points = (z + 0.5) @ gen.transpose(1, 2)                               # (G, N, d)
        if self.config.companding:
            points = expand(points, mu[:, None, None])
        return scale[:, None, None] * points.reshape(-1, gr, gs)

    def _vectors(self, wg, mu, scale) -> torch.Tensor:
        u = wg / scale[:, None, None]
        if self.config.companding:
            u = compand(u, mu[:, None, None])
        return u.reshape(u.shape[0], -1, self.config.dim)

    @staticmethod
    def _error(wg, what, hg) -> torch.Tensor:
        e = wg - what
        return ((e @ hg) * e).sum((1, 2))                                      # (G,)

    def compress(self, weight, hessian):
        """Alternate Babai rounding and generator updates per group; store the best."""
        c = self.config
        shape = tuple(weight.shape)
        nr, nc, gr, gs = self._grid(shape)
        wg = self._group(weight.float())                                       # (G, gr, gs)
        hc = torch.stack([hessian[i * gs:(i + 1) * gs, i * gs:(i + 1) * gs] for i in range(nc)]).float()
        hg = hc.repeat(nr, 1, 1)                                               # (G, gs, gs)
        scale = wg.abs().amax((1, 2)).clamp(min=6.2e-5).half().float()
        mus = [torch.ones(len(wg))]
        if c.companding:
            cen = wg - wg.mean((1, 2), keepdim=True)
            kurt = (cen ** 4).mean((1, 2)) / (cen ** 2).mean((1, 2)).clamp(min=1e-30) ** 2
            mus = [(100 * torch.tanh(kurt / 10)).clamp(*MU_RANGE), torch.full((len(wg),), MU_RANGE[0])]
        eye = torch.eye(c.dim).expand(len(wg), c.dim, c.dim)
        best = None
        for mu in mus:                       # starts: (kurtosis μ, ~linear μ) x (chol, scalar)
            v = self._vectors(wg, mu, scale)
            cov = v.transpose(1, 2) @ v / v.shape[1] + 1e-6 * eye
            for g in (GAUSS_STEP[c.bits] * torch.linalg.cholesky(cov), (2.0 / 2 ** c.bits) * eye):
                err = self._error(wg, self._weights(g, mu, scale, self.babai(g, v), gr, gs), hg)
                if best is None:
                    best = [err, g.clone(), mu.clone()]
                    continue
                better = err < best[0]
                best[0] = torch.where(better, err, best[0])
                best[1][better], best[2][better] = g[better], mu[better]
        _, gen, mu = best
        rms = gen.pow(2).mean((1, 2), keepdim=True).sqrt()
        a = (gen / rms).clone().requires_grad_(True)
        log_mu = torch.log(mu).clone().requires_grad_(c.companding)
        opt = torch.optim.Adam([a, log_mu] if c.companding else [a], lr=c.lr)
        best_err = torch.full((len(wg),), float("inf"))
        best_gen, best_mu = gen.clone(), mu.clone()
        history = []
        for r in range(c.rounds + 1):
            with torch.no_grad():
                gen, mu = a * rms, log_mu.exp().clamp(*MU_RANGE) if c.companding else mu
                z = self.babai(gen, self._vectors(wg, mu, scale))
                err = self._error(wg, self._weights(gen, mu, scale, z, gr, gs), hg)
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_gen[better], best_mu[better] = gen[better], mu[better]
                history.append(float(best_err.sum()))
            if r == c.rounds:
                break
            with torch.enable_grad():        # the pipeline runs under no_grad
                for _ in range(c.steps):
                    opt.zero_grad(set_to_none=True)
                    m = log_mu.exp().clamp(*MU_RANGE) if c.companding else mu
                    self._error(wg, self._weights(a * rms, m, scale, z, gr, gs), hg).sum().backward()
                    opt.step()
        tensors = self._encode(wg, best_gen.half(), best_mu.half(), scale.half())
        what = self.decode(tensors, shape)
        total = float(((weight.double() @ hessian.double()) * weight.double()).sum())
        return Compressed(tensors, what, shape[0] * shape[1],
                          {"bits_per_weight": 8 * sum(t.numel() * t.element_size() for t in tensors.values())
                           / (shape[0] * shape[1]),
                           "group_error": [h / max(total, 1e-30) for h in history]})

    def _encode(self, wg, gen16, mu16, scale16) -> dict[str, torch.Tensor]:
        lo, _ = self._box()
        z = self.babai(gen16.float(), self._vectors(wg, mu16.float(), scale16.float()))
        tensors = {"codes": pack_bits((z - lo).long(), self.config.bits), "generators": gen16, "scales": scale16}
        if self.config.companding:
            tensors["mu"] = mu16
        return tensors

    def codes(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """The stored integer codes ``z``, shape ``(groups, vectors, d)``."""
        lo, _ = self._box()
        flat = unpack_bits(tensors["codes"], self.config.bits, shape[0] * shape[1])
        return flat.reshape(tensors["generators"].shape[0], -1, self.config.dim).float() + lo

    def encode_weight(self, tensors: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
        """Babai-round ``weight`` with the stored parameters (the round-trip check)."""
        mu = tensors["mu"].float() if "mu" in tensors else torch.ones(len(tensors["scales"]))
        return self.babai(tensors["generators"].float(),
                          self._vectors(self._group(weight.float()), mu, tensors["scales"].float()))

    def decode(self, tensors, shape):
        """``scale · F⁻¹(G (z + ½))`` per vector, regrouped to ``(out, in)``."""
        _, _, gr, gs = self._grid(shape)
        mu = tensors["mu"].float() if "mu" in tensors else torch.ones(len(tensors["scales"]))
        wg = self._weights(tensors["generators"].float(), mu, tensors["scales"].float(),
                           self.codes(tensors, shape), gr, gs)
        return self._ungroup(wg, shape)
