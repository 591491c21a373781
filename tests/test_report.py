"""The benchmark report (bench/report.py) renders: every file, and every figure with labelled axes and real data.

The figures are checked on the live matplotlib objects the report returns and on
the ``figures.json`` sidecar it writes, so an empty or unlabelled plot fails here
rather than in a reader's browser. One run on Fashion-MNIST in process; one on a
small labelled LIBSVM file through ``gmmlsh bench report --data FILE`` as users run it.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread  # in the test extra: this test must run, not skip

ROOT = Path(__file__).resolve().parents[1]
ALWAYS = ("recall_qps.png", "estimator_mse.png", "var_over_e2.png", "samples_to_recall.png")
LABELLED = ("knn_accuracy.png",)


@pytest.fixture(scope="module")
def report_mod():
    """bench/ is a source folder, not an installed package: import it from the checkout."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("bench.report")


def check_figure_description(name: str, desc: dict) -> None:
    """Every visible axes: both labels set, at least one named series with data, no named series empty."""
    assert desc["axes"], f"{name}: no axes"
    for i, ax in enumerate(desc["axes"]):
        where = f"{name} axes {i} ({ax['title']!r})"
        assert ax["xlabel"].strip() and ax["ylabel"].strip(), f"{where}: unlabelled axis"
        named = [s for s in ax["series"] if not s["label"].startswith("_")]
        assert named, f"{where}: no named series"
        assert all(s["points"] >= 1 for s in named), f"{where}: empty series {named}"
        assert max(s["points"] for s in named) >= 2, f"{where}: no series with two points"


def check_folder(out: Path, expected: tuple[str, ...]) -> tuple[dict, dict]:
    for f in ("report.md", "report.json", "figures.json", *expected):
        assert (out / f).is_file(), f"{f} missing"
    md = (out / "report.md").read_text()
    data = json.loads((out / "report.json").read_text())
    figs = json.loads((out / "figures.json").read_text())
    assert sorted(figs) == sorted(expected) == sorted(data["figures"])
    for name in expected:
        assert f"]({name})" in md, f"report.md does not embed {name}"
        img = imread(out / name)
        assert img.shape[0] >= 300 and img.shape[1] >= 500, (name, img.shape)
        assert float(img[..., :3].std()) > 0.02, f"{name} is blank"
        assert (out / name).stat().st_size > 10_000
        check_figure_description(name, figs[name])
    return data, figs


def test_quick_report_on_fashion_mnist_has_every_figure_labelled_and_filled(tmp_path, report_mod, fmnist):
    out = tmp_path / "rep"
    rep = report_mod.main(["--quick", "--no-peer", "--n", "1500", "--queries", "60", "--out", str(out)])
    try:
        data, figs = check_folder(out, ALWAYS + LABELLED)
        # the live Figure objects say the same as the sidecar
        assert sorted(rep.figures) == sorted(figs)
        for name, fig in rep.figures.items():
            assert report_mod.describe_figure(fig) == figs[name]
            for ax in fig.get_axes():
                if ax.axison:
                    assert ax.get_xlabel() and ax.get_ylabel()
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")
    # the numbers behind the pictures are sane, not just present
    pts = {(p["series"], p["setting"]): p for p in data["speed"]["points"]}
    assert pts[("exact", "in-memory numba scan")]["recall"] == pytest.approx(1.0)
    assert pts[("auto over C", "C=400")]["recall"] >= 0.95
    search = data["speed"]["search"]
    assert [p["setting"] for p in data["speed"]["points"] if p["series"] == "auto"] == \
        [report_mod.tuned_label(search)]
    assert search["tuned_at_rows"] == 1500  # tuned by the build's maintain()
    assert all(p["qps"] > 0 for p in pts.values())
    assert {b["method"].split(" (")[0] for b in data["speed"]["builds"]} >= {"exact"}
    acc = data["knn"]["accuracy"]
    assert set(acc) == {"GMM exact", "GMM auto", "RBF via nrff", "cosine", "L2"}
    assert all(0.5 < a["10"] <= 1.0 for a in acc.values())
    assert data["knn"]["nrff_check_agree"] >= 0.95  # the bulk nrff neighbours are the index's
    sr = data["samples"]["methods"]
    assert set(sr) >= {"GCWS b=8", "GCWS b=2", "NRFF γ=1"}
    for m in sr.values():
        vals = m[f"recall_in_top{data['samples']['C']}"]
        assert vals[-1] >= vals[0] and vals[-1] > 0.9
    # empirical MSE follows the theory (median ratio over pairs at the Var/E² k)
    est = data["estimators"]
    i = est["pairs"][0]["ks"].index(est["var_k"])
    for name in ("GCWS 0-bit", "GCWS b=8", "NRFF γ=1"):
        ratios = [p["mse"][name][i] / p["theory"][name][i] for p in est["pairs"]]
        assert 0.6 < float(np.median(ratios)) < 1.6, (name, ratios)
    assert "Quick run" in (out / "report.md").read_text()


def write_libsvm(path: Path, n: int = 500, dim: int = 40, classes: int = 3) -> None:
    """Sparse labelled rows with negative values: each class has its own mean, so k-NN can learn it."""
    rng = np.random.default_rng(5)
    centers = rng.normal(0, 2, (classes, dim))
    lines = []
    for i in range(n):
        c = i % classes
        x = centers[c] + rng.normal(0, 1.5, dim)
        x[rng.random(dim) < 0.5] = 0.0
        x[0] = x[0] or 1.0  # never an all-zero row
        nz = np.flatnonzero(x)
        lines.append(f"{c + 1} " + " ".join(f"{j + 1}:{x[j]:.4f}" for j in nz))
    path.write_text("\n".join(lines) + "\n")


def test_report_on_a_labelled_libsvm_file_through_gmmlsh_bench(tmp_path):
    data_file = tmp_path / "small.svm"
    write_libsvm(data_file)
    out = tmp_path / "rep"
    env = dict(os.environ)
    env.setdefault("NUMBA_NUM_THREADS", "2")
    r = subprocess.run([sys.executable, "-m", "gmmlsh.service.cli", "bench", "report", "--data", data_file.name,
                        "--out", "rep", "--quick", "--no-peer"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data, _ = check_folder(out, ALWAYS + LABELLED)
    d = data["data"]
    assert (d["storage"], d["classes"], d["dim"]) == ("sparse", 3, 40)
    assert d["queries"] + d["n"] == 500 and d["queries"] == 50  # 10 % held out
    assert data["knn"]["accuracy"]["GMM exact"]["1"] > 0.6  # well above chance (1/3)
    assert "small.svm" in (out / "report.md").read_text()


def test_bench_report_options_are_passed_through(tmp_path, monkeypatch, capsys):
    """``gmmlsh bench report ARGS`` runs ``python -P -m bench.report ARGS`` in the caller's directory (no run here)."""
    from gmmlsh.service.cli import bench, main

    calls = []
    monkeypatch.setattr(bench.subprocess, "call", lambda argv, **kw: calls.append((argv, kw)) or 0)
    monkeypatch.chdir(tmp_path)
    args = ["--data", "x.npy", "--out", "r", "--quick"]
    assert main(["bench", "report", *args]) == 0
    (argv, kw), = calls
    assert argv == [sys.executable, "-P", "-m", "bench.report", *args]
    assert Path(kw.get("cwd") or os.getcwd()).resolve() == tmp_path.resolve()  # relative paths mean the caller's
    env = kw.get("env") or os.environ
    assert str(ROOT) in env["PYTHONPATH"].split(os.pathsep)  # bench/'s parent: ``-P`` leaves the cwd off sys.path
    assert main(["bench", "report", "--", "--n", "5"]) == 0 and calls[1][0][4:] == ["--n", "5"]
    capsys.readouterr()
    assert main(["bench", "--list"]) == 0
    assert "report" in capsys.readouterr().out.split()
    assert main(["bench", "no_such_bench", "--quick"]) == 2
    assert len(calls) == 2
