"""The comparison of layouts for ``ppo_grad_accum.py --compare``: the layout type, the table and the plot."""

from __future__ import annotations

from dataclasses import astuple, dataclass
from pathlib import Path

from metricbus import Agg

NAIVE = {  # name -> (spec, the factor it is off by as a function of (R, M, K), that factor's name)
    "naive_mean/pg_loss": ("mean", lambda r, m, k: 1 / m, "1/M"),
    "naive_sum/pg_loss": (Agg(micro="sum", update="mean", rank="sum", step="mean"), lambda r, m, k: r, "R"),
    "naive_step_sum/pg_loss": (Agg(micro="sum", update="sum", rank="mean"), lambda r, m, k: k, "K"),
}
COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
            "response_length/mean", "response_length/max", "response_length/min", "batch/tokens")
AGREE_REL = 1e-9
Rows = list[tuple[int, dict[str, float]]]


@dataclass(frozen=True)
class Layout:
    """R ranks x M micro-batches per rank x K optimizer updates per step."""

    ranks: int
    micro: int
    updates: int

    @classmethod
    def parse(cls, text: str, *, updates: int) -> Layout:
        """``RxMxK``, or ``RxM`` with K = ``updates``."""
        parts = text.lower().split("x")
        if len(parts) == 2:
            parts.append(str(updates))
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"layout {text!r}: use RxMxK (ranks x micro-batches x updates per step), e.g. 2x4x2")
        return cls(*(int(p) for p in parts))

    def __str__(self) -> str:
        return f"{self.ranks}x{self.micro}x{self.updates}"


def series(rows: Rows, name: str) -> list[float]:
    return [metrics[name] for _, metrics in rows]


def _max_rel(a: list[float], b: list[float]) -> float:
    scale = max([abs(x) for x in b] + [1e-300])
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) / scale


def _ratio(a: list[float], b: list[float]) -> float:
    """The median of a / b over rows (the naive rules are off by an exact factor)."""
    ratios = sorted(x / y for x, y in zip(a, b, strict=True) if abs(y) > 1e-12)
    return ratios[len(ratios) // 2] if ratios else float("nan")


def compare_table(results: dict[Layout, Rows]) -> tuple[str, bool]:
    """The comparison table against the first layout, and whether metricbus agreed everywhere."""
    ref = next(iter(results.values()))
    naive = "".join(f" | {name.split('/')[0]:>14} {label:>4}" for name, (_, _, label) in NAIVE.items())
    head = f"{'layout':>6} | {'pg_loss (last)':>14} {'max rel dev':>11} | {'9 metrics':>9}{naive} | naive clipfrac"
    lines = [head, "-" * len(head)]
    ok = True
    for layout, rows in results.items():
        if len(rows) != len(ref):
            raise AssertionError(f"layout {layout} emitted {len(rows)} rows, the first layout {len(ref)}")
        devs = {name: _max_rel(series(rows, name), series(ref, name)) for name in COMPARED}
        ok = ok and max(devs.values()) <= AGREE_REL
        loss = series(rows, "actor/pg_loss")
        cells = "".join(f" | {_ratio(series(rows, name), loss):>14.4f} {factor(*astuple(layout)):>4.3g}"
                        for name, (_, factor, _) in NAIVE.items())
        clip_dev = _max_rel(series(rows, "naive/pg_clipfrac"), series(ref, "actor/pg_clipfrac"))
        lines.append(f"{layout!s:>6} | {loss[-1]:>14.9f} {devs['actor/pg_loss']:>11.1e} | "
                     f"{max(devs.values()):>9.1e}{cells} | {clip_dev:>14.1e}")
    return "\n".join(lines), ok


def plot(results: dict[Layout, Rows], path: Path, *, updates_per_row: int) -> None:
    """Small multiples (PNG), one column per layout: pg_loss, naive / metricbus, clip fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(3, n, figsize=(3.6 * n + 1, 9), sharex=True, sharey="row", squeeze=False)
    styles = {"naive_mean/pg_loss": ("tab:blue", "-", 3.6), "naive_sum/pg_loss": ("tab:orange", "--", 2.2),
              "naive_step_sum/pg_loss": ("tab:green", ":", 1.2)}  # equal factors: each line on a wider one
    for col, (layout, rows) in enumerate(results.items()):
        x = [(i + 1) * updates_per_row for i in range(len(rows))]
        loss = series(rows, "actor/pg_loss")
        top, mid, bottom = axes[:, col]
        top.plot(x, loss, color="black", lw=2, label="metricbus actor/pg_loss")
        for name, (color, style, width) in styles.items():
            factor = NAIVE[name][1](*astuple(layout))
            label = f"{name if col == 0 else name.split('/')[0]} (x{factor:.3g})"
            values = series(rows, name)
            top.plot(x, values, color=color, ls=style, lw=width / 2, label=label)
            mid.plot(x, [a / b for a, b in zip(values, loss, strict=True)], color=color, ls=style, lw=width,
                     label=label)
        bottom.plot(x, series(rows, "actor/pg_clipfrac"), color="black", lw=2,
                    label="metricbus actor/pg_clipfrac (token-weighted)")
        bottom.plot(x, series(rows, "naive/pg_clipfrac"), color="tab:red", ls="--", lw=1,
                    label="naive/pg_clipfrac (mean of micro-batch means)")
        top.set_title(f"{layout}: R={layout.ranks} ranks, M={layout.micro} micro, K={layout.updates} updates",
                      fontsize=9)
        bottom.set_xlabel("optimizer updates")
        for ax in (top, mid, bottom):
            ax.grid(alpha=0.3)
        top.legend(fontsize=7, loc="upper left")
    axes[1, 0].set_yscale("log", base=2)
    axes[0, 0].set_ylabel("pg_loss (per token, mean over updates)")
    axes[1, 0].set_ylabel("naive / metricbus pg_loss")
    axes[2, 0].set_ylabel("clip fraction")
    axes[2, 0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"The same {updates_per_row * len(next(iter(results.values())))} optimizer updates under every "
                 f"layout RxMxK, one point per {updates_per_row} updates. Black: metricbus, identical in every "
                 "column; colours: naive rules", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
