"""Fitting a collective's alpha and beta to its own measured times, robustly.

Every cost formula of ``collectives/cost.py`` is linear in alpha, beta and gamma, so a time
measured at size n is ``t(n) = A(n) alpha + B(n) beta + G(n)``, where ``A(n)`` is the formula
evaluated with alpha = 1 and beta = gamma = 0 (the number of message start-ups), ``B(n)`` with
beta = 1 (the bytes on the critical path) and ``G(n)`` with the measured gamma only. Given times
at several sizes (each the median of repetitions), alpha and beta follow by least squares
(Hockney 1994's fit, generalised to any formula):

1. each row is divided by its measured time, so the fit minimises *relative* error (the target
   is a relative error; plain least squares would let the largest size decide everything);
2. iteratively reweighted least squares with Huber weights (Huber 1964): rows whose relative
   residual exceeds ``_HUBER_K`` times the median absolute residual are down-weighted, so one
   sample spoiled by another job on a shared machine does not swing alpha, as an exact solve
   through two sizes does;
3. alpha >= 0 and beta > 0: a negative alpha (noise at large sizes) is clamped and beta refitted;
4. optionally the rate is capped at the link's (``max_gbit_per_s``: netlab's tbf shapes every
   host link to a known rate, no algorithm can beat it): above the cap beta is set to it and
   alpha refitted alone. Without it, latency-bound small sizes, whose times swing several-fold
   with the load, tilt the line and fit a rate above the link's, which then under-predicts
   the large sizes.

What the fit cannot do is separate alpha from per-message CPU waits: with 4 ranks on 2 cores a
message can wait milliseconds for a core, and the fitted alpha prices that in (it is the
*effective* latency of this machine, not the wire's).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence

import numpy as np

from commfuse.collectives import cost as C

#: Huber's threshold, in units of the median absolute relative residual (1.345 sigma for
#: Gaussian noise, and the median absolute deviation is about 0.67 sigma).
_HUBER_K = 2.0
_IRLS_ROUNDS = 10

#: A formula of one world size: seconds for n bytes on a link.
Model = Callable[[int, C.LinkCost], float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkFit:
    """alpha and beta of one model, and how well they explain the measurements."""

    alpha_s: float
    """Fitted start-up latency per message, seconds."""
    beta_s_per_byte: float
    """Fitted seconds per byte."""
    sizes_bytes: tuple[int, ...]
    """The sizes measured."""
    measured_s: tuple[float, ...]
    """The median time at each size, seconds."""
    relative_residuals: tuple[float, ...]
    """model / measured - 1 at each size, after the fit."""

    @property
    def gbit_per_s(self) -> float:
        return 8.0 / self.beta_s_per_byte / 1e9

    @property
    def max_residual(self) -> float:
        return max((abs(r) for r in self.relative_residuals), default=0.0)


def point_to_point(n: int, link: C.LinkCost) -> float:
    """One message (a ping-pong's one-way time): alpha + n beta."""
    return link.alpha_s + n * link.beta_s_per_byte


def coefficients(model: Model, n: int, gamma_s_per_byte: float) -> tuple[float, float, float]:
    """(A, B, G) with model(n) = A alpha + B beta + G, by linearity of the formula."""
    a = model(n, C.LinkCost(alpha_s=1.0, beta_s_per_byte=0.0, gamma_s_per_byte=0.0))
    b = model(n, C.LinkCost(alpha_s=0.0, beta_s_per_byte=1.0, gamma_s_per_byte=0.0))
    g = model(n, C.LinkCost(alpha_s=0.0, beta_s_per_byte=0.0, gamma_s_per_byte=gamma_s_per_byte))
    return a, b, g


def fit_link(
    model: Model,
    sizes_bytes: Sequence[int],
    measured_s: Sequence[float],
    *,
    gamma_s_per_byte: float = 0.0,
    max_gbit_per_s: float | None = None,
) -> LinkFit:
    """alpha and beta of ``model`` from median times at several sizes (module docstring).

    ValueError with fewer than two distinct sizes (two unknowns), a non-positive time, or a
    model with no bandwidth term, or a non-positive cap."""
    if max_gbit_per_s is not None and not max_gbit_per_s > 0:
        raise ValueError(f"fit_link: max_gbit_per_s must be > 0, got {max_gbit_per_s}")
    if len(sizes_bytes) != len(measured_s):
        raise ValueError(f"fit_link: {len(sizes_bytes)} sizes but {len(measured_s)} measured times")
    if len(set(sizes_bytes)) < 2:
        raise ValueError(
            f"fit_link needs at least two distinct sizes to fit alpha and beta, got {sizes_bytes}"
        )
    if min(measured_s) <= 0:
        raise ValueError(f"fit_link: measured times must be > 0 seconds, got {measured_s}")
    rows = np.array([coefficients(model, n, gamma_s_per_byte) for n in sizes_bytes])
    t = np.asarray(measured_s, dtype=np.float64)
    if not np.any(rows[:, 1] > 0):
        raise ValueError("fit_link: the model has no bandwidth term (B(n) = 0 at every size)")
    # Relative least squares: row i says (A alpha + B beta) / t = 1 - G / t.
    design = rows[:, :2] / t[:, None]
    target = 1.0 - rows[:, 2] / t
    # Scale the two columns to comparable magnitudes (alpha ~1e-4, beta ~1e-8) for lstsq.
    scale = np.maximum(np.abs(design).max(axis=0), 1e-300)
    weights = np.ones_like(t)
    alpha = beta = 0.0
    min_beta = 8.0 / (max_gbit_per_s * 1e9) if max_gbit_per_s else 0.0
    for _ in range(_IRLS_ROUNDS):
        alpha, beta = _solve(design / scale, target, weights)
        alpha, beta = alpha / scale[0], beta / scale[1]
        if beta < min_beta:  # faster than the link can carry: the small sizes' noise tilted it
            beta = min_beta
            w = weights * design[:, 0] ** 2
            rest = target - design[:, 1] * beta
            alpha = max(0.0, float(np.sum(weights * design[:, 0] * rest) / max(w.sum(), 1e-300)))
        residual = design @ np.array([alpha, beta]) - target
        spread = statistics.median(np.abs(residual).tolist()) or 1e-12
        cut = _HUBER_K * spread
        new = np.where(np.abs(residual) <= cut, 1.0, cut / np.maximum(np.abs(residual), 1e-300))
        if np.allclose(new, weights):
            break
        weights = new
    predicted = rows[:, 0] * alpha + rows[:, 1] * beta + rows[:, 2]
    return LinkFit(
        alpha_s=float(alpha),
        beta_s_per_byte=float(beta),
        sizes_bytes=tuple(int(n) for n in sizes_bytes),
        measured_s=tuple(float(x) for x in t),
        relative_residuals=tuple(float(x) for x in predicted / t - 1.0),
    )


def overlapped(
    fit: LinkFit,
    model: Model,
    *,
    gamma_s_per_byte: float = 0.0,
    max_gbit_per_s: float | None = None,
) -> LinkFit:
    """Refit ``fit`` for the overlapped form of ``model``: start-ups run under the transfer,
    ``t(n) = sqrt((A alpha + G)**2 + (B beta)**2)`` (``CollectiveLink.
    latency_overlaps_transfer``; the reduction's G goes with the start-ups, as the simulator's
    ``Demand`` counts it in the part that is not shared). Not linear in alpha and beta: bounded non-linear least squares
    on the relative residuals (scipy's trust-region reflective, a Huber loss as in
    ``fit_link``), started from the linear fit, alpha >= 0, beta no faster than the cap."""
    from scipy.optimize import least_squares

    rows = np.array([coefficients(model, n, gamma_s_per_byte) for n in fit.sizes_bytes])
    t = np.asarray(fit.measured_s, dtype=np.float64)
    # Unknowns scaled to order 1: alpha in ms, beta in ns per byte.
    scale = np.array([1e-3, 1e-9])

    def predict(x: np.ndarray) -> np.ndarray:
        alpha, beta = x * scale
        return np.asarray(np.hypot(rows[:, 0] * alpha + rows[:, 2], rows[:, 1] * beta))

    min_beta = 8.0 / (max_gbit_per_s * 1e9) if max_gbit_per_s else 0.0
    lower = np.array([0.0, max(min_beta, 1e-15) / scale[1]])
    start = np.maximum([fit.alpha_s / scale[0], fit.beta_s_per_byte / scale[1]], lower)
    solved = least_squares(
        lambda x: predict(x) / t - 1.0,
        start,
        bounds=(lower, np.full(2, np.inf)),
        loss="huber",
        f_scale=0.1,
    )
    alpha, beta = (solved.x * scale).tolist()
    return dataclasses.replace(
        fit,
        alpha_s=float(alpha),
        beta_s_per_byte=float(beta),
        relative_residuals=tuple(float(x) for x in predict(solved.x) / t - 1.0),
    )


def _solve(design: np.ndarray, target: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """Weighted least squares for (alpha, beta) with alpha >= 0 and beta > 0."""
    w = np.sqrt(weights)[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design * w, target * w[:, 0], rcond=None)
    if alpha < 0:  # noise at large sizes: the line through them would start below zero
        b_col = design[:, 1] * w[:, 0]
        alpha, beta = 0.0, float(b_col @ (target * w[:, 0]) / (b_col @ b_col))
    if beta <= 0:  # every size took the same time: all latency, bandwidth unmeasurable
        a_col = design[:, 0] * w[:, 0]
        beta = 1e-15
        alpha = max(0.0, float(a_col @ (target * w[:, 0]) / max(a_col @ a_col, 1e-300)))
    return float(alpha), float(beta)


def with_burst(model: Model, burst_bytes: float) -> Model:
    """``model`` on a host link with a token bucket of ``burst_bytes`` (netlab's tbf): the first
    ``burst_bytes`` on the critical path cost no transfer time. Still linear in alpha and beta.
    Without it, sizes near the bucket look faster than the link, and a line through them has a
    negative intercept (alpha clamped to 0) and too high a rate (ping-pongs of 32 KB - 2 MB at
    1 Gbit/s fitted 2.5 Gbit/s)."""
    if burst_bytes <= 0:
        return model
    bandwidth_only = C.LinkCost(alpha_s=0.0, beta_s_per_byte=1.0, gamma_s_per_byte=0.0)

    def burst_model(n: int, link: C.LinkCost) -> float:
        on_path = model(n, bandwidth_only)
        return model(n, link) - min(burst_bytes, on_path) * link.beta_s_per_byte

    return burst_model


def native_with_burst(collective: str, world_size: int, burst_bytes: float) -> Model:
    """``native_model`` on host links with token buckets: ``with_burst``, except for gloo's
    broadcast, whose deepest chain crosses one full bucket per hop
    (``cost.gloo_broadcast_burst_bytes``; one bucket's credit left 1 MB 25% slow)."""
    model = native_model(collective, world_size)
    if collective != "broadcast" or burst_bytes <= 0:
        return with_burst(model, burst_bytes)

    def chain_model(n: int, link: C.LinkCost) -> float:
        credit = C.gloo_broadcast_burst_bytes(n, world_size, burst_bytes)
        return model(n, link) - credit * link.beta_s_per_byte

    return chain_model


def native_model(collective: str, world_size: int) -> Model:
    """gloo's own algorithm for ``collective`` (``docs/design.md``): a ring allreduce and allgather,
    a binomial-tree broadcast whose sends share the sender's link (``cost.gloo_broadcast``), a
    pairwise all-to-all, each as a formula of cost.py."""
    formulas: dict[str, Callable[[int, int, C.LinkCost], float]] = {
        "all_reduce": C.ring_all_reduce,
        "all_gather": C.ring_all_gather,
        "broadcast": C.gloo_broadcast,
        "all_to_all": C.pairwise_all_to_all,
    }
    if collective not in formulas:
        raise ValueError(f"no native model to fit for {collective!r}; known: {', '.join(formulas)}")
    formula = formulas[collective]
    return lambda n, link: formula(n, world_size, link)
