"""The benchmark report's figures, and what each shows (:func:`describe_figure`: what a test checks)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from bench.report_data import K_NN, KNN_KS  # noqa: E402
from gmmlsh.core import nrff  # noqa: E402

DPI = 100

#: One colour per method, the same in every figure.
COLORS = {
    "auto over C": "tab:blue", "auto": "navy", "exact": "black", "nrff": "tab:orange",
    "pynndescent": "tab:brown", "GMM exact": "black", "GMM auto": "tab:blue", "RBF via nrff": "tab:orange",
    "cosine": "tab:gray", "L2": "tab:purple", "GCWS 0-bit": "tab:blue", "GCWS b=2": "tab:green",
    "GCWS b=4": "tab:olive", "GCWS b=8": "tab:cyan", "NRFF": "tab:red",
}


# ==================================================================================
# figures
# ==================================================================================


def _draw_recall_qps(ax, speed: dict, annotate: bool) -> None:
    series: dict[str, list[dict]] = {}
    for p in speed["points"]:
        series.setdefault(p["series"], []).append(p)
    markers = {"auto over C": "o", "nrff": "^", "pynndescent": "D"}
    single = {"exact": lambda p: "s" if "index" in p["setting"] else "P", "auto": lambda p: "*"}
    for key, pts in series.items():
        color = COLORS.get(key, "tab:cyan")
        if key in single:  # one point per setting, not a curve
            for p in pts:
                ax.scatter([p["recall"]], [p["qps"]], color=color, marker=single[key](p), s=90, zorder=3,
                           label=f"{key} ({p['setting']})")
            continue
        # in the order of the knob (C, ε): the curve is what turning it buys
        ax.plot([p["recall"] for p in pts], [p["qps"] for p in pts], marker=markers.get(key, "v"), color=color,
                label=key)
        if annotate and key in ("auto over C", "pynndescent"):
            for p in pts:
                ax.annotate(p["setting"].replace("epsilon", "ε"), (p["recall"], p["qps"]), fontsize=7,
                            xytext=(3, 4), textcoords="offset points", color=color)
    ax.set_yscale("log")
    ax.set_xlabel("recall@10 (against exact GMM neighbours)")
    ax.set_ylabel("queries per second (one thread, log scale)")
    ax.grid(True, which="both", alpha=0.3)


def fig_recall_qps(speed: dict, title: str) -> Figure:
    """Left: every method (nrff's RBF neighbours are far from GMM's); right: the high-recall region."""
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [1, 1.5]})
    _draw_recall_qps(full, speed, annotate=False)
    full.axvline(speed["rbf_ceiling"], color=COLORS["cosine"], linestyle=":", linewidth=1)
    full.annotate(f"exact RBF/cosine neighbours: {speed['rbf_ceiling']:.2f} of GMM's", (speed["rbf_ceiling"], 0.02),
                  xycoords=("data", "axes fraction"), rotation=90, fontsize=7, color="dimgray", xytext=(3, 0),
                  textcoords="offset points")
    full.set_title("all methods", fontsize=10)
    _draw_recall_qps(zoom, speed, annotate=True)
    near = [p["recall"] for p in speed["points"] if p["series"] in ("auto over C", "auto", "pynndescent")]
    lo = max(0.0, min(near) - 0.02) if near else 0.0
    zoom.set_xlim(lo, 1.005)
    zoom.set_title(f"zoom: recall ≥ {lo:.2f}", fontsize=10)
    zoom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def fig_estimator_mse(est: dict, n_panels: int = 5) -> Figure:
    pairs = est["pairs"]
    # spread the panels over the similarity range
    pick = sorted({int(round(i)) for i in np.linspace(0, len(pairs) - 1, min(n_panels, len(pairs)))}, reverse=True)
    fig, axes = plt.subplots(2, 3, figsize=(14, 8.5))
    flat = axes.ravel()
    g = f"NRFF γ={est['nrff_gamma']:g}"
    names = ["GCWS 0-bit"] + [f"GCWS b={b}" for b in est["bits"]] + [g]
    for ax, i in zip(flat, pick, strict=False):
        r = pairs[i]
        ks = r["ks"]
        for name in names:
            color = COLORS["NRFF"] if name.startswith("NRFF") else COLORS[name]
            ax.plot(ks, r["mse"][name], marker="o", markersize=3, color=color, label=f"{name} (empirical)")
            ax.plot(ks, r["theory"][name], linestyle="--", color=color, linewidth=1, label=f"{name} (theory)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("samples k")
        ax.set_ylabel("MSE")
        gkey = f"{est['nrff_gamma']:g}"
        ax.set_title(f"GMM = {r['gmm']:.3f}  |  ρ = {r['rho']:.3f}, RBF(γ={gkey}) = {r['rbf'][gkey]:.3f}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    for ax in flat[len(pick) :]:
        ax.axis("off")
    handles, labels = flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", fontsize=8, ncol=1, bbox_to_anchor=(0.98, 0.06))
    fig.suptitle(f"Empirical MSE (solid) vs theoretical variance (dashed): GCWS estimates GMM (b-bit: corrected), "
                 f"NRFF estimates RBF — {est['seeds']} seeds × {est['samples_per_seed']} samples per pair",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return fig


def fig_var_over_e2(est: dict) -> Figure:
    E = np.linspace(0.01, 0.999, 400)
    rho = 1.0 + np.log(E)  # with γ = 1, E = exp(−(1 − ρ)); V and V_n depend on E alone
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot(E, (1 - E) / E, color=COLORS["GCWS 0-bit"], label="GCWS: (1−E)/E")
    ax.plot(E, nrff.rff_variance(rho, 1.0) / E**2, color="tab:pink", label="RFF: [½ + ½(1−E²)²]/E²")
    ax.plot(E, nrff.nrff_variance(rho, 1.0) / E**2, color=COLORS["NRFF"], label="NRFF: V_n/E² (any γ)")
    kv = est["var_k"]
    pts = est["var_points"]["GCWS 0-bit"]
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=COLORS["GCWS 0-bit"], marker="o", zorder=3,
               label=f"GCWS 0-bit, real pairs (k·MSE/E², k={kv})")
    for m, g in zip(("^", "v", "D", "s"), est["var_gammas"], strict=False):
        pts = est["var_points"][f"NRFF γ={g:g}"]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], edgecolors=COLORS["NRFF"], marker=m, zorder=3,
                   facecolors="none", label=f"NRFF γ={g:g}, real pairs")
    ax.set_yscale("log")
    ax.set_ylim(1e-3, 1e3)
    ax.set_xlabel("E (GMM for GCWS, RBF exp(−γ(1−ρ)) for RFF/NRFF)")
    ax.set_ylabel("Var / E² (per sample)")
    ax.set_title("Relative variance, the papers' Figure 3 (lower is better)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_knn(knn: dict, title: str) -> Figure:
    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {"GMM exact": ("-", "o"), "GMM auto": ("--", "x"), "RBF via nrff": ("-", "^"),
              "cosine": ("--", "s"), "L2": (":", "D")}
    for name, acc in knn["accuracy"].items():
        ks = sorted(int(k) for k in acc)
        ls, mk = styles.get(name, ("-", "o"))
        ax.plot(ks, [acc[str(k)] for k in ks], linestyle=ls, marker=mk,
                color=COLORS.get(name, None), label=knn["labels"][name])
    ax.set_xscale("log")
    ax.set_xticks(list(KNN_KS))
    ax.set_xticklabels([str(k) for k in KNN_KS])
    ax.set_xlabel("neighbours voting (k of k-NN)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_samples(sr: dict, knn: dict | None) -> Figure:
    C = sr["C"]
    has_acc = any(m["knn_accuracy"] for m in sr["methods"].values())
    fig, axes = plt.subplots(1, 3 if has_acc else 2, figsize=(16 if has_acc else 11, 5))
    style = {"GCWS b=8": ("tab:blue", "o", "-"), "GCWS b=2": ("tab:green", "o", "--")}
    for name, m in sr["methods"].items():
        color, mk, ls = style.get(name, (COLORS["NRFF"], "^", "-" if "γ=1" in name else "--"))
        label = f"{name} (vs exact {m['kernel']})"
        axes[0].plot(m["ks"], m[f"recall_in_top{C}"], color=color, marker=mk, linestyle=ls, label=label)
        bytes_ = [k * m["bytes_per_sample"] for k in m["ks"]]
        axes[1].plot(bytes_, m[f"recall_in_top{C}"], color=color, marker=mk, linestyle=ls, label=label)
        if has_acc:
            axes[2].plot(m["ks"], m["knn_accuracy"], color=color, marker=mk, linestyle=ls, label=name)
    for ax in axes[:2]:
        ax.axhline(0.9, color="gray", linestyle=":", linewidth=1)
        ax.set_ylabel(f"recall@10 within the sketch's top {C}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("samples k per vector")
    axes[0].set_title("Samples needed (ranked by the sketch alone, no rerank)", fontsize=10)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("sketch bytes per vector (GCWS b bits, NRFF float32)")
    axes[1].set_title("The same, per byte stored", fontsize=10)
    axes[0].legend(fontsize=8)
    if has_acc:
        ax = axes[2]
        if knn:
            ax.axhline(knn["accuracy"]["GMM exact"][str(K_NN)], color="black", linestyle=":", linewidth=1,
                       label="GMM exact")
            ax.axhline(knn["accuracy"]["cosine"][str(K_NN)], color=COLORS["cosine"], linestyle=":", linewidth=1,
                       label="RBF exact (= cosine)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("samples k per vector")
        ax.set_ylabel(f"{K_NN}-NN accuracy, sketch-ranked neighbours")
        ax.set_title("k-NN classification with the sketch alone", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def describe_figure(fig: Figure) -> dict:
    """What a figure shows, for tests and readers: each visible axes' labels and its series' point counts."""
    axes = []
    for ax in fig.get_axes():
        if not ax.axison:
            continue
        series = []
        for line in ax.get_lines():
            xy = np.asarray(line.get_xydata(), dtype=float)
            series.append({"kind": "line", "label": str(line.get_label()),
                           "points": int(np.isfinite(xy).all(axis=1).sum()) if xy.size else 0})
        for coll in ax.collections:
            off = np.asarray(coll.get_offsets(), dtype=float)
            series.append({"kind": "scatter", "label": str(coll.get_label()),
                           "points": int(np.isfinite(off).all(axis=1).sum()) if off.size else 0})
        bars = [p for p in ax.patches if p.get_height() > 0]
        if bars:
            series.append({"kind": "bars", "label": "bars", "points": len(bars)})
        axes.append({"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
                     "xscale": ax.get_xscale(), "yscale": ax.get_yscale(), "series": series})
    return {"size_px": [int(v) for v in fig.get_size_inches() * DPI], "axes": axes}
