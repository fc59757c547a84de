"""Pictures: a training run's telemetry, and ``stoker bench`` results (PNG files, drawn with matplotlib).

>>> from stoker.cli.plots import plot_telemetry, plot_bench
>>> plot_telemetry("runs/a", "runs/a/telemetry.png")   # loss, samples/s and data wait over steps
>>> plot_bench("bench.json", "bench.png")               # samples/s per peer and scenario, stage breakdown

matplotlib is optional (``pip install 'stoker[plot]'``); without it these raise
:class:`~stoker.errors.MissingDependency`. Figures are drawn on the Agg canvas directly: no display, and
no change to the pyplot backend of the calling program.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import InvalidArgument, MissingDependency, NotFound

__all__ = ["available", "plot_bench", "plot_telemetry", "read_telemetry"]

TELEMETRY = "telemetry.jsonl"
STAGES = ("decode", "read", "cast", "plan", "other")


def available() -> bool:
    """True when matplotlib can be imported."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def figure(width: float, height: float) -> Any:
    """A matplotlib Figure on an Agg canvas; MissingDependency without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingDependency("drawing pictures needs matplotlib, which is not installed: "
                                "pip install 'stoker[plot]' (or matplotlib)", package="matplotlib",
                                extra="plot") from None
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, out: str | os.PathLike) -> Path:
    from .args import unwritable

    path = Path(out)
    why = unwritable(path)
    if why is not None:
        raise InvalidArgument(f"cannot write {path}: {why}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    return path


# -- telemetry ---------------------------------------------------------------------------------------


def read_telemetry(run: str | os.PathLike) -> dict[str, dict[int, float]]:
    """Each metric of a run's ``telemetry.jsonl`` (``run`` is the file or its folder) as ``{step: value}``.

    A step logged twice (a killed run, then its resumption) keeps its last value; null (a NaN loss) is left
    out; a line that does not parse (cut short by a full disk, or bytes that are not text) is skipped."""
    path = Path(run)
    if path.is_dir():
        path = path / TELEMETRY
    if not path.is_file():
        raise NotFound(f"no telemetry at {path}: give a run folder holding {TELEMETRY} (the Trainer's "
                       "telemetry_dir) or the file itself", uri=str(path))
    series: dict[str, dict[int, float]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:  # a line not UTF-8 then fails json.loads: skipped
        for line in f:
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                continue
            for name, value in record.items():
                if name not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    series.setdefault(name, {})[step] = float(value)
    if not series:
        raise InvalidArgument(f"{path} holds no telemetry records")
    return series


def _line(ax: Any, points: Mapping[int, float], **style: Any) -> None:
    steps = sorted(points)
    ax.plot(steps, [points[s] for s in steps], **style)


def plot_telemetry(run: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Loss (and evaluation loss), samples/s and data wait over steps, one panel each, from a run's
    telemetry; written to ``out`` (default: ``telemetry.png`` beside the telemetry file). Returns its path."""
    series = read_telemetry(run)
    source = Path(run) if Path(run).is_file() else Path(run) / TELEMETRY
    fig = figure(8, 8)
    loss_ax, rate_ax, wait_ax = fig.subplots(3, 1, sharex=True)
    fig.suptitle(f"training run {source.parent}")
    if "loss" in series:
        _line(loss_ax, series["loss"], label="loss (mean over ranks)")
    if "eval_loss" in series:
        _line(loss_ax, series["eval_loss"], marker="o", label="eval loss")
    losses = [v for name in ("loss", "eval_loss") for v in series.get(name, {}).values() if math.isfinite(v)]
    if losses and min(losses) > 0 and max(losses) / min(losses) > 50:
        loss_ax.set_yscale("log")
    loss_ax.set_ylabel("loss")
    if "loss" in series or "eval_loss" in series:
        loss_ax.legend(loc="upper right")
    else:  # a legend of no lines is a matplotlib warning on the user's terminal
        loss_ax.text(0.5, 0.5, "no loss in this log", ha="center", va="center", transform=loss_ax.transAxes)
    if "samples_per_s" in series:
        _line(rate_ax, series["samples_per_s"])
    else:
        rate_ax.text(0.5, 0.5, "no samples/s in this log", ha="center", va="center", transform=rate_ax.transAxes)
    rate_ax.set_ylabel("samples/s (all ranks)")
    waits, steps = series.get("data_wait_s", {}), series.get("step_s", {})
    share = {s: 100 * waits[s] / steps[s] for s in waits if steps.get(s)}
    _line(wait_ax, share, color="tab:red")
    wait_ax.set_ylabel("data wait, % of step")
    wait_ax.set_ylim(bottom=0)
    wait_ax.set_xlabel("optimizer step")
    return _save(fig, out if out is not None else source.with_name("telemetry.png"))


# -- bench ---------------------------------------------------------------------------------------------


def _bench_doc(bench: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    if isinstance(bench, Mapping):
        return bench
    path = Path(bench)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NotFound(f"no bench results at {path} (write them with stoker bench --json FILE)",
                       uri=str(path)) from None
    except ValueError as exc:
        raise InvalidArgument(f"{path} is not the JSON stoker bench --json writes: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("scenarios"), list):
        raise InvalidArgument(f"{path} is not the JSON stoker bench --json writes (no 'scenarios' list)")
    for sc in doc["scenarios"]:
        _check_scenario(sc, path)
    return doc


def _check_scenario(sc: Any, path: Path) -> None:
    """InvalidArgument naming the first thing :func:`plot_bench` draws that scenario ``sc`` lacks: each peer's
    name and samples/s (a number), its rounds (numbers) where given."""
    def wrong(what: str) -> InvalidArgument:
        where = f"scenario {sc.get('number', '?')}" if isinstance(sc, dict) else "a scenario"
        return InvalidArgument(f"{path} is not the JSON stoker bench --json writes: {where} {what}")

    if not isinstance(sc, dict) or not isinstance(sc.get("peers", []), list):
        raise wrong("is not an object with a 'peers' list")
    for peer in sc.get("peers", []):
        if not isinstance(peer, dict) or not isinstance(peer.get("peer"), str):
            raise wrong("has a peer without its name ('peer')")
        if not _real(peer.get("samples_per_s")):
            raise wrong(f"peer {peer['peer']!r} has no number 'samples_per_s'")
        rounds = peer.get("rounds")
        if rounds is not None and not (isinstance(rounds, list) and all(_real(r) for r in rounds)):
            raise wrong(f"peer {peer['peer']!r} has 'rounds' that are not a list of numbers")


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_bench(bench: Mapping[str, Any] | str | os.PathLike, out: str | os.PathLike) -> Path:
    """One row per scenario: samples/s per peer (the median round, with the range over rounds as error
    bars), and stoker's CPU time per batch split by stage (decode, read, cast, plan, other) for each stoker
    peer. ``bench``: what ``stoker bench --json`` wrote (its path, or the document). Returns ``out``."""
    doc = _bench_doc(bench)
    rows = [sc for sc in doc["scenarios"] if sc.get("peers")]
    if not rows:
        raise InvalidArgument("the bench results hold no scenario with peers to draw")
    fig = figure(12, 2.8 * len(rows) + 0.6)
    axes = fig.subplots(len(rows), 2, squeeze=False, width_ratios=(3, 2))
    fig.suptitle(doc.get("title", "stoker bench"))
    for (rate_ax, stage_ax), sc in zip(axes, rows):
        peers = sc["peers"]
        names = [p["peer"] for p in peers]
        rates = [p["samples_per_s"] for p in peers]
        low = [r - min(p.get("rounds") or [r]) for p, r in zip(peers, rates)]
        high = [max(p.get("rounds") or [r]) - r for p, r in zip(peers, rates)]
        colors = ["tab:orange" if n.startswith("stoker") else "tab:gray" for n in names]
        rate_ax.barh(names, rates, xerr=[low, high], color=colors, capsize=3)
        rate_ax.invert_yaxis()
        rate_ax.set_xlabel("samples/s (median round; bars: range over rounds)")
        rate_ax.set_title(f"scenario {sc.get('number', '?')}: {sc.get('title', '')}"[:90], fontsize=9, loc="left")
        split = [(p["peer"], p["breakdown"]["stages_ms_per_batch"]) for p in peers if p.get("breakdown")]
        if split:
            left = [0.0] * len(split)
            for stage in STAGES:
                widths = [max(0.0, s.get(stage, 0.0)) for _, s in split]
                stage_ax.barh([n for n, _ in split], widths, left=left, label=stage)
                left = [a + b for a, b in zip(left, widths)]
            stage_ax.invert_yaxis()
            stage_ax.set_xlabel("stoker CPU ms per batch, by stage")
            stage_ax.legend(fontsize=7, ncol=len(STAGES), loc="upper center", bbox_to_anchor=(0.5, -0.3))
        else:
            stage_ax.text(0.5, 0.5, "no stoker stage breakdown", ha="center", va="center",
                          transform=stage_ax.transAxes)
            stage_ax.set_axis_off()
    return _save(fig, out)
