"""PNG plots (matplotlib, headless Agg backend): a run's drift (``llmtailor drift --plot``), and
writing a figure (``save_png``; the demo draws its own comparison of policies with it)."""

from __future__ import annotations

import math
from pathlib import Path

from llmtailor.drift import DriftHistory
from llmtailor.errors import TailorError

ZERO_COLOR = "#c8c8c8"  # units whose drift is exactly zero: a grey no colour of the scale takes


def plot_drift(history: DriftHistory, kind: str, out: Path) -> None:
    """Write ``drift_figure`` to ``out`` (PNG)."""
    save_png(drift_figure(history, kind), out)


def save_png(fig, out: Path) -> None:
    """Write the matplotlib figure ``fig`` to ``out`` (PNG), that very path, and close it
    (matplotlib, left to choose, would add ``.png`` to a name without a suffix, and write a PDF
    to ``x.pdf``: the file said written would not be the one written, nor a PNG)."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(out, dpi=120, format="png")
    except OSError as err:
        raise TailorError(f"{out}: cannot write the plot ({err.strerror})") from None
    finally:
        plt.close(fig)


def drift_figure(history: DriftHistory, kind: str):
    """A heatmap of drift (units in layout order, top to bottom; saves left to right; a dot
    where the save wrote the unit; exactly zero in grey, unlike a blank: not measured) over a
    line chart of bytes per save vs a Full save."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.patches import Patch

    steps, units = history.steps, history.units
    grid = [[_value(history, s, u, kind) for s in steps] for u in units]
    finite = [v for row in grid for v in row if v is not None and v > 0]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(6.0, 0.45 * len(steps) + 2.5), max(4.5, 0.28 * len(units) + 3.0)),
        gridspec_kw={"height_ratios": [3, 1]}, constrained_layout=True,
    )
    masked = [[math.nan if v is None or v <= 0 else v for v in row] for row in grid]
    norm = LogNorm(vmin=min(finite), vmax=max(finite)) if finite else None
    image = top.imshow(masked, aspect="auto", cmap="viridis", norm=norm, interpolation="nearest")
    # Exactly zero (nothing changed: frozen) is a measurement, unlike a blank (not measured).
    zeros = [[1.0 if v == 0 else math.nan for v in row] for row in grid]
    top.imshow(zeros, aspect="auto", cmap=ListedColormap([ZERO_COLOR]), vmin=0, vmax=1, interpolation="nearest")
    for x, s in enumerate(steps):
        for y, unit in enumerate(units):
            if unit in history.saved[s]:
                top.plot(x, y, marker="o", markerfacecolor="white", markeredgecolor="black", markersize=3.5, linestyle="")
    top.set_yticks(range(len(units)), units, fontsize=7)
    top.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7, rotation=90)
    top.set_xlabel("step of the save")
    top.set_ylabel("unit (layout order)")
    top.set_title(f"{kind} drift since each unit's last saved version\n(relative L2; dot: saved at this step)", fontsize=10)
    fig.legend(
        handles=[Patch(facecolor=ZERO_COLOR, edgecolor="black", label="0: unchanged (frozen)"),
                 Patch(facecolor="white", edgecolor="black", label="blank: not measured")],
        loc="outside upper right", ncol=2, fontsize=7, frameon=False,
    )
    fig.colorbar(image, ax=top, label=f"{kind} drift")
    bottom.plot(range(len(steps)), [history.bytes[s] / 1e6 for s in steps], marker="o", label="this save")
    bottom.plot(range(len(steps)), [history.full_bytes[s] / 1e6 for s in steps], linestyle="--", label="a Full save")
    bottom.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7, rotation=90)
    bottom.set_xlabel("step of the save")
    bottom.set_ylabel("MB written")
    bottom.set_ylim(bottom=0)
    bottom.legend(fontsize=8)
    return fig


def _value(history: DriftHistory, step: int, unit: str, kind: str) -> float | None:
    return history.drift.get(step, {}).get(unit, {}).get(kind)
