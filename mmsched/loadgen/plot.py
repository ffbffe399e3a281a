"""``write_plot``: each result's latency against its send time, as a PNG (needs matplotlib)."""

from __future__ import annotations

import math

import numpy as np

from .report import Report
from .spec import LOST

PLOT_NEEDS = "--plot needs matplotlib: pip install 'mmsched[plot]' (or .venv/bin/pip install matplotlib)"


def can_plot() -> bool:
    """Checked before a run, so a missing matplotlib does not cost the whole run."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_plot(report: Report, path: str) -> None:
    """A PNG: each result's latency against its send time, by status, with p50/p99 per time bin."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(PLOT_NEEDS) from exc
    rec = report.records
    status = np.asarray(rec.status)
    t = np.asarray(rec.t_send)
    lat = (np.asarray(rec.t_recv) - t) * 1e3
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    _points(ax, status, t, lat)
    _log_axis(ax)
    ax.set_xlabel("send time (s since start)")
    ax.set_ylabel("latency (ms)")
    s = report.summary
    ax.set_title(f"mmsched loadtest: {s['completed']}/{s['sent']} results, {s['achieved_rate']:.0f} req/s, "
                 f"p50 {s['latency_ms']['p50']:.2f} ms, p99 {s['latency_ms']['p99']:.2f} ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, markerscale=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _points(ax, status: np.ndarray, t: np.ndarray, lat: np.ndarray) -> None:
    """One colour per status, the p50 and p99 lines per time bin, the lost ones as red crosses on top."""
    for st in sorted(set(status.tolist()) - {LOST}):
        m = status == st
        ax.scatter(t[m], lat[m], s=3, alpha=0.35, label=f"{st} ({int(m.sum())})", rasterized=True)
    done = status != LOST
    if done.sum() > 1:
        mids, p50, p99 = _binned(t[done], lat[done])
        ax.plot(mids, p50, color="black", lw=1.5, label="p50")
        ax.plot(mids, p99, color="red", lw=1.5, label="p99")
    if (~done).any():
        ax.scatter(t[~done], np.full(int((~done).sum()), np.nanmax(lat) if done.any() else 1.0),
                   marker="x", color="red", s=12, label=f"lost ({int((~done).sum())})")


def _binned(t: np.ndarray, lat: np.ndarray) -> tuple[list, list, list]:
    """Up to 60 send-time bins of ~20 results: each non-empty bin's middle, p50 and p99."""
    bins = np.linspace(t.min(), t.max() + 1e-9, min(60, max(2, int(t.size // 20))) + 1)
    idx = np.digitize(t, bins) - 1
    mids, p50, p99 = [], [], []
    for b in range(len(bins) - 1):
        v = lat[idx == b]
        if v.size:
            mids.append((bins[b] + bins[b + 1]) / 2)
            p50.append(np.percentile(v, 50))
            p99.append(np.percentile(v, 99))
    return mids, p50, p99


def _log_axis(ax) -> None:
    """A log latency axis labelled in plain milliseconds (6, not 6×10^0)."""
    from matplotlib.ticker import FuncFormatter

    def minor(v: float, _pos) -> str:  # within one decade every tick, else the 2s and 5s
        lo, hi = ax.get_ylim()
        few = hi < 10 * max(lo, 1e-12)
        return f"{v:g}" if v > 0 and (few or round(v / 10 ** math.floor(math.log10(v))) in (2, 5)) else ""

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))
