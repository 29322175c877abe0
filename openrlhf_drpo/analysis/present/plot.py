"""drpo-analyze --plot: heatmaps of w over (μ, π), by the numeric arbiter's float rules."""
from __future__ import annotations


PLOT_DPI, PANEL_W, PANEL_H = 100, 5.0, 4.0


def plot(results: list, path, fmt: str | None = None, points: int = 300, dpi: int = PLOT_DPI,
         interpolation: str = "antialiased") -> list[tuple[float, float]]:
    """Heatmaps of w over (μ, π) for A = +1 and A = −1, one row per objective, evaluated by the
    numeric arbiter (the IR's float rules). One colour scale for all the panels, since they are
    compared (the 1st to 99th percentile of w over them, diverging around 1, the plain surrogate,
    when it spans 1); the black contour is where w changes sign or becomes 0 (the boundary, as
    found numerically), and hatching marks where ℓ or w is undefined. Size: 1000 × 400·rows pixels at
    the default dpi; `points` per axis of the grid; `fmt` the format where `path` (a file object) has
    no extension to say it; interpolation="none" keeps the grid's own pixels in a vector file (the
    notebook's small SVG). Returns each panel's colour limits."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import Normalize, TwoSlopeNorm
    n = len(results)
    fig, axes = plt.subplots(n, 2, figsize=(2 * PANEL_W, PANEL_H * n), dpi=dpi, squeeze=False)
    grid = np.linspace(0.002, 1.0, points)
    mu, pi = np.meshgrid(grid, grid)
    panels = [[np.asarray(res.w_numeric(pi / mu, mu, A), dtype=float) for A in (1.0, -1.0)] for res in results]
    finite = np.concatenate([w[np.isfinite(w)] for ws in panels for w in ws])
    lo, hi = (np.percentile(finite, [1, 99]) if finite.size else (0.0, 2.0))
    # to 9 digits: a w of 1 ± rounding (exp(log π − log μ) is r to 1 ulp) is one colour, not two
    lo, hi = (float(f"{x:.9g}") for x in (lo, hi))
    lo, hi = (lo - 0.5, hi + 0.5) if hi - lo < 1e-9 else (lo, hi)
    norm = TwoSlopeNorm(1.0, lo, hi) if lo < 1 < hi else Normalize(lo, hi)
    limits = []
    for row, res, ws in zip(axes, results, panels):
        for ax, A, w in zip(row, (1.0, -1.0), ws):
            im = ax.imshow(np.ma.masked_invalid(w), origin="lower", extent=(0, 1, 0, 1), cmap="RdBu_r",
                           norm=norm, aspect="auto", interpolation=interpolation)
            sign = np.where(np.isfinite(w), np.sign(w), np.nan)
            if np.nanmin(sign, initial=1) < 1 and np.nanmax(sign, initial=-1) > -1 + (np.nanmin(sign, initial=1) < 0):
                ax.contour(mu, pi, np.ma.masked_invalid(sign), levels=[-0.5, 0.5], colors="k", linewidths=1.5)
                ax.plot([], [], color="k", lw=1.5, label="w = 0 or changes sign (the boundary)")
            if np.isnan(w).any():
                ax.contourf(mu, pi, np.isnan(w).astype(float), levels=[0.5, 1.5], colors="none",
                            hatches=["///"])
            ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls=":", label="π = μ (r = 1)")
            ax.legend(loc="upper left", fontsize=7, framealpha=0.8)
            ax.set_title(f"{res.name}: w for A {'> 0' if A > 0 else '< 0'}{_view_title(res.scope)}"
                         + ("  (hatched: undefined)" if np.isnan(w).any() else ""), fontsize=10)
            ax.set_xlabel("μ (behaviour prob.)")
            ax.set_ylabel("π (current prob.)")
            fig.colorbar(im, ax=ax, fraction=0.046).set_label(
                "w = (∂ℓ/∂r)/A" + ("  (white: 1, the surrogate's)" if isinstance(norm, TwoSlopeNorm) else ""))
            limits.append((im.norm.vmin, im.norm.vmax))
    fig.tight_layout()
    # no date in an SVG's metadata: the same analysis draws the same file
    fig.savefig(path, dpi=dpi, format=fmt or ("png" if not isinstance(path, str) else None),
                metadata={"Date": None} if (fmt or str(path)).endswith("svg") else None)
    plt.close(fig)
    return limits


def _view_title(scope) -> str:
    parts = [f"one response, |y| = {scope['seq_len']:g}"] if scope["sequence"] else []
    parts += [f"ρ = {scope['rho']:g}"] if scope["rho_name"] else []
    return f" ({', '.join(parts)})" if parts else ""
