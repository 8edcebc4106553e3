"""GLVQ: each weight group quantized on its own learned lattice, decoded by one small matmul."""
from __future__ import annotations

import torch

from rankwise.compress.base import Compressed, Compressor
from rankwise.compress.formats import pack_bits, unpack_bits

# Step of the optimal uniform quantizer of N(0, 1) in units of σ, by bits (Max, 1960).
GAUSS_STEP = {1: 1.596, 2: 0.996, 3: 0.586, 4: 0.335}
# Range of the companding parameter μ (the notes' clamp, issue 27). Before issue 27 the lower
# end was 0.01, which let a near-Gaussian group switch companding off; `companding: false`
# turns it off for the whole layer instead.
MU_RANGE = (10.0, 255.0)
# Widths the salience allocation may give a group (GLVQ supports 1-4 bits).
MIN_BITS, MAX_BITS = 1, 4


def compand(x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """μ-law ``F(x) = sgn(x) · ln(1 + μ|x|) / ln(1 + μ)`` (``mu`` broadcasts)."""
    return torch.sign(x) * torch.log1p(mu * x.abs()) / torch.log1p(mu)


def expand(y: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Inverse μ-law ``F⁻¹(y) = sgn(y) · ((1 + μ)^{|y|} − 1) / μ``."""
    return torch.sign(y) * torch.expm1(y.abs() * torch.log1p(mu)) / mu


def generator_penalty(gen: torch.Tensor, gen0: torch.Tensor, weight: torch.Tensor,
                      lam: float) -> torch.Tensor:
    """GLVQ's regulariser towards the initial generator, ``λ‖G_g − G_g⁽⁰⁾‖²_F``, per group,
    made scale-free: ``λ · w_g · ‖G_g − G_g⁽⁰⁾‖²_F / ‖G_g⁽⁰⁾‖²_F`` with ``w_g`` the group's
    error at ``G_g⁽⁰⁾`` (so ``λ`` is the fraction of that error a drift of ``‖G⁽⁰⁾‖`` costs).
    Its gradient is ``2λ w_g (G_g − G_g⁽⁰⁾) / ‖G_g⁽⁰⁾‖²_F``: it pulls ``G_g`` back to ``G_g⁽⁰⁾``.

    Args:
        gen: Generators ``(G, d, d)``.
        gen0: Initial generators ``(G, d, d)`` (held constant).
        weight: ``w_g`` ``(G,)`` (held constant).
        lam: ``λ``.

    Returns:
        ``(G,)`` penalties.
    """
    return lam * weight * (gen - gen0).pow(2).sum((1, 2)) / gen0.pow(2).sum((1, 2)).clamp(min=1e-30)


def salience(weight: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """SliM-LLM's Hessian salience of every weight, ``δ_ij = W_ij² / [H⁻¹]_jj²`` (the notes:
    GLVQ borrows its bit allocation from SliM-LLM), with ``H`` damped by ``damp · mean diag H``
    as in GPTQ.

    Returns:
        ``(out, in)`` salience.
    """
    h = hessian.double()
    h = h + damp * h.diagonal().mean().clamp(min=1e-12) * torch.eye(len(h), dtype=h.dtype)
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h)).diagonal()
    return (weight.double() ** 2 / hinv ** 2).float()


def allocate(group_salience: torch.Tensor, errors: dict[int, torch.Tensor], bits: int) -> torch.Tensor:
    """Salience-determined bit allocation at an average of exactly ``bits``: the ``k`` most
    salient groups get ``bits + 1``, the ``k`` least salient ``bits − 1``, the rest ``bits``;
    ``k`` (0 to ``⌊G/2⌋``) minimises the layer's output error, the sum of the groups' errors
    ``errors[b]`` at each width (exact here: cross-group terms of ``H`` are ignored). The
    notes' KL objective on the layer's softmax outputs is replaced by this output error.

    Args:
        group_salience: ``(G,)`` salience per group.
        errors: ``{width: (G,) error of each group quantized at that width}`` for
            ``bits − 1``, ``bits`` and ``bits + 1``.
        bits: The target average.

    Returns:
        ``(G,)`` int64 widths, mean exactly ``bits``, non-increasing in salience order.
    """
    n = len(group_salience)
    order = torch.argsort(group_salience, descending=True, stable=True)
    base = errors[bits][order].double()
    gain_hi = (errors[bits + 1][order].double() - base).cumsum(0)                 # top k
    gain_lo = (errors[bits - 1][order].double() - base).flip(0).cumsum(0)         # bottom k
    totals = [0.0] + [float(gain_hi[k - 1] + gain_lo[k - 1]) for k in range(1, n // 2 + 1)]
    k = min(range(len(totals)), key=totals.__getitem__)
    ranked = torch.full((n,), bits, dtype=torch.int64)
    ranked[:k], ranked[n - k:] = bits + 1, bits - 1
    out = torch.empty_like(ranked)
    out[order] = ranked
    return out


class GLVQ(Compressor):
    """GLVQ, grouped lattice vector quantization (arXiv 2510.20984; the official repository
    ``xzhang9308/GLVQ`` holds only a README): the weights are cut into groups (``group_rows ×
    group_size``); each group has its own generator ``G_g`` (``d × d``) and bit width ``b_g``,
    and every run of ``d`` consecutive weights of a row is a lattice point ``G_g z`` with ``z``
    a vector of ``b_g``-bit integers. Encoding is Babai rounding ``z = ⌊G_g⁻¹ w⌉``; decoding is
    one ``d × d`` matmul per vector, then the inverse companding. Per group, alternately:
    Babai-round all vectors; take Adam steps on ``G_g`` (and the companding ``μ_g``) against
    ``L_g = tr(E_g H_gg E_gᵀ) + λ‖G_g − G_g⁽⁰⁾‖²`` (:func:`generator_penalty`),
    ``E_g = W_g − Ŵ_g`` under the Gram block of its input columns. The best iterate by the
    error is kept.

    Bit allocation (``allocation: salience``, the paper's low-bit setting): groups are ranked
    by SliM-LLM's salience (:func:`salience` summed over the group) and split into ``bits + 1``,
    ``bits`` and ``bits − 1`` at an average of exactly ``bits`` (:func:`allocate`); at 2 bits
    this is the paper's mix of 1- and 3-bit groups. It needs ``bits ± 1`` within 1-4, so 1- and
    4-bit layers stay uniform.

    Choices where the sources leave room (the official code is unreleased; see the notes):

    * codes are offset by ½ (``ŵ = G (z + ½)``, ``z ∈ [−2^{b−1}, 2^{b−1} − 1]``) so every bit
      width, 1 included, gives a grid symmetric about 0;
    * the group is scaled by its largest magnitude before μ-law companding (μ-law needs
      values in [−1, 1]); the error is measured on the decoded (expanded) weights;
    * each group starts from the best (by the error) of four: ``μ_g`` at
      ``100 · tanh(κ_g / 10)`` (κ: kurtosis, the notes' rule) or at 10 (the least companding
      in range), times ``G_g`` at ``δ_b · chol(cov_g)`` (``δ_b``: the optimal uniform step for
      a Gaussian at ``b`` bits) or the scalar grid ``(2 / 2^b) I``; that start is ``G_g⁽⁰⁾``;
      ``μ_g`` is learned in [10, 255] (:data:`MU_RANGE`);
    * the cross-group terms of ``H`` are ignored (no GPTQ-style error feedback).

    Storage: codes bit-packed at each group's width (``codes``; with mixed widths ``codes{b}``
    per width and ``group_bits`` uint8 per group); per group ``G_g`` (float16, ``d × d``), the
    scale and ``μ_g`` (float16). The stored float16 parameters are the ones used to encode, so
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
    @staticmethod
    def _box(bits) -> tuple:
        """Code range ``[−2^{b−1}, 2^{b−1} − 1]``; ``bits`` an int or a ``(G,)`` tensor."""
        if isinstance(bits, torch.Tensor):
            half = (2.0 ** (bits.float() - 1))[:, None, None]
            return -half, half - 1
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

    def babai(self, gen: torch.Tensor, v: torch.Tensor, bits=None) -> torch.Tensor:
        """Babai rounding of vectors ``v`` ``(G, N, d)`` on generators ``gen`` ``(G, d, d)``:
        ``clamp(round(G⁻¹ v − ½))`` to each group's ``bits`` (int or ``(G,)``; default the
        config's), as float codes ``(G, N, d)``."""
        lo, hi = self._box(self.config.bits if bits is None else bits)
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

    def _start(self, wg, hg, scale, bits: int, gr: int, gs: int):
        """The best of the four starts per group: ``(G⁽⁰⁾, μ⁽⁰⁾)``."""
        c = self.config
        mus = [torch.full((len(wg),), MU_RANGE[0])]
        if c.companding:
            cen = wg - wg.mean((1, 2), keepdim=True)
            kurt = (cen ** 4).mean((1, 2)) / (cen ** 2).mean((1, 2)).clamp(min=1e-30) ** 2
            mus = [(100 * torch.tanh(kurt / 10)).clamp(*MU_RANGE), torch.full((len(wg),), MU_RANGE[0])]
        eye = torch.eye(c.dim).expand(len(wg), c.dim, c.dim)
        best = None
        for mu in mus:                       # starts: (kurtosis μ, least μ) x (chol, scalar)
            v = self._vectors(wg, mu, scale)
            cov = v.transpose(1, 2) @ v / v.shape[1] + 1e-6 * eye
            for g in (GAUSS_STEP[bits] * torch.linalg.cholesky(cov), (2.0 / 2 ** bits) * eye):
                err = self._error(wg, self._weights(g, mu, scale, self.babai(g, v, bits), gr, gs), hg)
                if best is None:
                    best = [err, g.clone(), mu.clone()]
                    continue
                better = err < best[0]
                best[0] = torch.where(better, err, best[0])
                best[1][better], best[2][better] = g[better], mu[better]
        return best

    def _fit(self, wg, hg, scale, bits: int, gr: int, gs: int):
        """Alternate Babai rounding and Adam steps on ``L_g`` for every group at ``bits``;
        return ``(best error (G,), generators, μ, best error per round (rounds + 1, G))``."""
        c = self.config
        err0, gen0, mu = self._start(wg, hg, scale, bits, gr, gs)
        rms = gen0.pow(2).mean((1, 2), keepdim=True).sqrt()
        a = (gen0 / rms).clone().requires_grad_(True)
        log_mu = torch.log(mu).clone().requires_grad_(c.companding)
        opt = torch.optim.Adam([a, log_mu] if c.companding else [a], lr=c.lr)
        best_err = torch.full((len(wg),), float("inf"))
        best_gen, best_mu = gen0.clone(), mu.clone()
        history = []
        for r in range(c.rounds + 1):
            with torch.no_grad():
                gen, mu = a * rms, log_mu.exp().clamp(*MU_RANGE) if c.companding else mu
                z = self.babai(gen, self._vectors(wg, mu, scale), bits)
                err = self._error(wg, self._weights(gen, mu, scale, z, gr, gs), hg)
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_gen[better], best_mu[better] = gen[better], mu[better]
                history.append(best_err.clone())
            if r == c.rounds:
                break
            with torch.enable_grad():        # the pipeline runs under no_grad
                for _ in range(c.steps):
                    opt.zero_grad(set_to_none=True)
                    m = log_mu.exp().clamp(*MU_RANGE) if c.companding else mu
                    loss = self._error(wg, self._weights(a * rms, m, scale, z, gr, gs), hg)
                    if c.regularization:
                        loss = loss + generator_penalty(a * rms, gen0, err0, c.regularization)
                    loss.sum().backward()
                    opt.step()
        return best_err, best_gen, best_mu, torch.stack(history)

    def widths(self, weight: torch.Tensor, hessian: torch.Tensor, errors: dict[int, torch.Tensor]) -> torch.Tensor:
        """Each group's bit width: :func:`allocate` on the groups' summed :func:`salience`."""
        sal = self._group(salience(weight, hessian)).sum((1, 2))
        return allocate(sal, errors, self.config.bits)

    def mixes(self) -> bool:
        """Whether this config mixes widths (salience allocation with ``bits ± 1`` in 1-4)."""
        b = self.config.bits
        return self.config.allocation == "salience" and MIN_BITS <= b - 1 and b + 1 <= MAX_BITS

    def compress(self, weight, hessian):
        """Fit every group at each candidate width, allocate widths by salience, store."""
        shape = tuple(weight.shape)
        nr, nc, gr, gs = self._grid(shape)
        wg = self._group(weight.float())                                       # (G, gr, gs)
        hc = torch.stack([hessian[i * gs:(i + 1) * gs, i * gs:(i + 1) * gs] for i in range(nc)]).float()
        hg = hc.repeat(nr, 1, 1)                                               # (G, gs, gs)
        scale = wg.abs().amax((1, 2)).clamp(min=6.2e-5).half().float()
        b = self.config.bits
        candidates = (b - 1, b, b + 1) if self.mixes() else (b,)
        fits = {w: self._fit(wg, hg, scale, w, gr, gs) for w in candidates}
        if self.mixes():
            bits = self.widths(weight, hessian, {w: f[0] for w, f in fits.items()})
        else:
            bits = torch.full((len(wg),), b, dtype=torch.int64)
        gen, mu = fits[b][1].clone(), fits[b][2].clone()
        history = fits[b][3].clone()                                           # (rounds + 1, G)
        for w, (_, g_w, mu_w, hist_w) in fits.items():
            sel = bits == w
            gen[sel], mu[sel], history[:, sel] = g_w[sel], mu_w[sel], hist_w[:, sel]
        tensors = self._encode(wg, gen.half(), mu.half(), scale.half(), bits)
        what = self.decode(tensors, shape)
        total = float(((weight.double() @ hessian.double()) * weight.double()).sum())
        return Compressed(tensors, what, shape[0] * shape[1],
                          {"bits_per_weight": 8 * sum(t.numel() * t.element_size() for t in tensors.values())
                           / (shape[0] * shape[1]),
                           "group_bits": [int(x) for x in bits],
                           "group_error": [float(h) / max(total, 1e-30) for h in history.sum(1)]})

    def _encode(self, wg, gen16, mu16, scale16, bits: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.babai(gen16.float(), self._vectors(wg, mu16.float(), scale16.float()), bits)
        lo, _ = self._box(bits)
        u = (z - lo).long()
        tensors = {"generators": gen16, "scales": scale16}
        if bool((bits == self.config.bits).all()):
            tensors["codes"] = pack_bits(u, self.config.bits)
        else:
            tensors["group_bits"] = bits.to(torch.uint8)
            for w in sorted(set(bits.tolist())):
                tensors[f"codes{w}"] = pack_bits(u[bits == w], w)
        if self.config.companding:
            tensors["mu"] = mu16
        return tensors

    def group_bits(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each group's stored width ``(G,)`` int64."""
        if "group_bits" in tensors:
            return tensors["group_bits"].long()
        return torch.full((len(tensors["scales"]),), self.config.bits, dtype=torch.int64)

    def codes(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """The stored integer codes ``z``, shape ``(groups, vectors, d)``."""
        bits = self.group_bits(tensors)
        n, d = len(bits), self.config.dim
        per = shape[0] * shape[1] // n
        z = torch.empty(n, per // d, d)
        for w in sorted(set(bits.tolist())):
            sel = bits == w
            key = "codes" if "codes" in tensors else f"codes{w}"
            flat = unpack_bits(tensors[key], w, int(sel.sum()) * per)
            z[sel] = flat.reshape(-1, per // d, d).float() - 2 ** (w - 1)
        return z

    def encode_weight(self, tensors: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
        """Babai-round ``weight`` with the stored parameters (the round-trip check)."""
        mu = tensors["mu"].float() if "mu" in tensors else torch.ones(len(tensors["scales"]))
        return self.babai(tensors["generators"].float(),
                          self._vectors(self._group(weight.float()), mu, tensors["scales"].float()),
                          self.group_bits(tensors))

    def decode(self, tensors, shape):
        """``scale · F⁻¹(G (z + ½))`` per vector, regrouped to ``(out, in)``."""
        _, _, gr, gs = self._grid(shape)
        mu = tensors["mu"].float() if "mu" in tensors else torch.ones(len(tensors["scales"]))
        wg = self._weights(tensors["generators"].float(), mu, tensors["scales"].float(),
                           self.codes(tensors, shape), gr, gs)
        return self._ungroup(wg, shape)
