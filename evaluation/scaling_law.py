"""ParScale's parallel scaling law and its fit (ParScale's equation (5) and its fitting procedure; the
official code is QwenLM/ParScale parametric_fit.py), used by `evaluate.py fit-law`.

    from evaluation.scaling_law import fit_law
    fit = fit_law(params, p, loss)   # {"E", "A" (raw), "alpha", "k", "r2" (None: equal losses), "huber", "pred"}

L(N, P) = E + (A / (N (k ln P + 1)))^alpha: N parameters, P parallel streams. As parametric_fit.py
does, the fit minimises sum_i Huber_delta(log L_i - log L_pred,i) with delta = 1e-3 over
(E, A, alpha, k) >= 1e-8 from each of its 300 initial values and keeps the best; R^2 is of L_pred
against L. parametric_fit.py runs scipy's L-BFGS-B once per start; here one batched L-BFGS in
torch (float64) runs all starts at once. On ParScale's published losses it lands within 1e-4 of
the reported parameters, as scipy does (tests/test_analysis.py).

Shapes: S starts, R rows of the table.
"""

from __future__ import annotations

import itertools
import math

import torch

# parametric_fit.py's starts: E = e^{-1, -0.5, 0}, A = e^{-4..4} (x 1e9), alpha in 0..2, k in 0.2..0.8
GRID = list(
    itertools.product([-1, -0.5, 0], [-4, -2, 0, 2, 4], [0, 0.5, 1, 1.5, 2], [0.2, 0.4, 0.6, 0.8])
)
A_UNIT = 1e9  # parametric_fit.py optimises A in units of 1e9 parameters; reported in raw parameters


def law(x: torch.Tensor, N: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """ParScale's law (its equation (5)): L = E + (A / (N (k ln P + 1)))^alpha; x [S,4] = (E, A / 1e9, alpha, k)
    -> [S,R]."""
    E, A, alpha, k = (t[:, None] for t in x.unbind(-1))
    return E + (A * A_UNIT / (N * (k * P.log() + 1))) ** alpha


def huber(err: torch.Tensor, delta: float = 1e-3) -> torch.Tensor:
    return torch.where(err.abs() <= delta, err * err / 2, delta * (err.abs() - delta / 2))


def lbfgs(
    f, x: torch.Tensor, iters: int = 2000, memory: int = 10, lower: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimise f: [S,n] -> [S] for every row of x at once: L-BFGS two-loop directions, Armijo
    backtracking, x kept >= lower by projection (parametric_fit.py runs scipy's L-BFGS-B with bounds
    (1e-8, None) once per start; here all starts of the grid run as one batch). A row whose line
    search fails is converged and stops moving."""

    def value_grad(x):
        x = x.detach().requires_grad_()
        v = f(x)
        v = torch.where(torch.isfinite(v), v, math.inf)
        (g,) = torch.autograd.grad(v.sum(), x)
        return v.detach(), torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)

    fx, g = value_grad(x)
    active, hist = torch.isfinite(fx), []
    for _ in range(iters):
        q, coef = g.clone(), []
        for s, y in reversed(hist):  # two-loop recursion, per row
            sy = (s * y).sum(-1)
            rho = torch.where(sy > 1e-30, 1 / sy, 0.0)
            a = rho * (s * q).sum(-1)
            q -= a[:, None] * y
            coef.append((a, rho))
        if hist:
            s, y = hist[-1]
            sy, yy = (s * y).sum(-1), (y * y).sum(-1)
            gamma = torch.where((sy > 1e-30) & (yy > 0), sy / yy, 1.0)
        else:  # first step: a small move along the gradient
            gamma = 1e-3 / g.abs().amax(-1).clamp(min=1e-30)
        r = gamma[:, None] * q
        for (s, y), (a, rho) in zip(hist, reversed(coef)):
            r += s * (a - rho * (y * r).sum(-1))[:, None]
        d = torch.where(((g * -r).sum(-1) < 0)[:, None], -r, -g)  # fall back to steepest descent
        t, accepted = torch.ones_like(fx), ~active
        x_new, f_new = x.clone(), fx.clone()
        for _ in range(30):
            cand = (x + t[:, None] * d).clamp(min=lower)
            fc = f(cand).detach()
            ok = ~accepted & torch.isfinite(fc) & (fc <= fx + 1e-4 * (g * (cand - x)).sum(-1))
            x_new[ok], f_new[ok] = cand[ok], fc[ok]
            accepted |= ok
            if bool(accepted.all()):
                break
            t = torch.where(accepted, t, t / 2)
        active &= accepted
        f_new, g_new = value_grad(x_new)
        hist = (hist + [(x_new - x, g_new - g)])[-memory:]
        change = float((fx - f_new)[active].abs().max()) if bool(active.any()) else 0.0
        x, fx, g = x_new, f_new, g_new
        if change < 1e-16:
            break
    return x, fx


def fit_law(N: list[float], P: list[float], L: list[float]) -> dict:
    """parametric_fit.py: minimise sum Huber_1e-3(log L - log L_pred) from each of the 300 grid starts
    (E = e^e0, A = e^a0 (x 1e9), alpha, k), keep the best; R^2 of L_pred against L."""
    N_, P_, L_ = (torch.tensor(v, dtype=torch.float64) for v in (N, P, L))
    x0 = torch.tensor(
        [[math.exp(e), math.exp(a), max(al, 1e-8), k] for e, a, al, k in GRID], dtype=torch.float64
    )
    threads = torch.get_num_threads()
    # [300, R] tensors: threads only add contention (docs/evaluation.md, "ParScale's law")
    torch.set_num_threads(1)
    try:
        x, fx = lbfgs(lambda x: huber(L_.log() - law(x, N_, P_).log()).sum(-1), x0)
    finally:
        torch.set_num_threads(threads)
    best = int(torch.argmin(fx))
    pred = law(x[best : best + 1], N_, P_)[0]
    spread = float(((L_ - L_.mean()) ** 2).sum())
    # equal losses: R^2 is undefined
    r2 = 1 - float(((L_ - pred) ** 2).sum()) / spread if spread > 0 else None
    E, A, alpha, k = x[best].tolist()
    return {
        "E": E,
        "A": A * A_UNIT,
        "alpha": alpha,
        "k": k,
        "r2": r2,
        "huber": float(fx[best]),
        "pred": pred.tolist(),
    }
