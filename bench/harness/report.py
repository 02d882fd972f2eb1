"""Turn benchmark results into the targets' verdicts, a Markdown report, one PNG per model, and files.

Targets (goals, reported with their numbers, never asserted):

1. Pareto: at each peer's measured peak, torchckpt's plan measures no higher and is no slower (median).
2. Speed: at "every block"'s measured peak, torchckpt's plan is >= 1.15x faster on the GPT models.
3. Budget: every torchckpt run measures within its budget.
4. Prediction: the median |predicted - measured| / measured peak of torchckpt runs is <= 5%.
5. Planning: profiling + solving takes <= 5 plain training steps.
6. Near the model's optimum: for each budget, the plan's predicted extra time is within 1.25x of the
   fractional-knapsack lower bound (``solve.recompute_lower_bound``; a bound of 0 with a plan that
   recomputes is reported as missed: the budget is bound by a term the relaxation drops).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from torchckpt._units import format_bytes

__all__ = ["BOUND_TARGET", "SPEEDUP_TARGET", "bound_rows", "evaluate_targets", "markdown", "plot_model",
           "write_reports"]

SPEEDUP_TARGET = 1.15
PREDICTION_TARGET = 0.05
PLANNING_TARGET_STEPS = 5.0
BOUND_TARGET = 1.25


def _brief(text: str, limit: int = 200) -> str:
    """An error message for a table cell: module path dropped, one line, at most ``limit`` characters."""
    text = " ".join(str(text).split()).replace("torchckpt.planner.solve._types.", "")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _ok(run: dict[str, Any]) -> bool:
    return run.get("status") == "ok" and run.get("step_time") is not None


def _plan_at(model: dict[str, Any], peer: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """torchckpt's run at ``peer``'s measured peak, and how it was chosen.

    The plan made with that peak as its budget, when it ran. When the planner refused that budget (it
    refuses a peak below its measured floor, and keeps a margin for plans it did not measure),
    the torchckpt run with the largest budget whose *measured* peak is at or below the peer's: chosen by
    budget, never by measured time, so that noise cannot pick the winner."""
    runs = [r for r in model.get("runs", []) if r["kind"] == "torchckpt"]
    targeted = next((r for r in runs if r.get("target") == peer["label"]), None)
    if targeted is not None and _ok(targeted):
        return targeted, "the plan for this peak"
    fitting = [r for r in runs if _ok(r) and r.get("peak_bytes") is not None and r["peak_bytes"] <= peer["peak_bytes"]]
    why = (targeted or {}).get("reason") or model.get("planning", {}).get("error") or "no plan was made"
    if not fitting:
        return None, why
    chosen = max(fitting, key=lambda r: r["budget_bytes"])
    return chosen, f"{chosen['label']} (the plan for this peak: {_brief(why, 90)})"


def _pareto(models: list[dict[str, Any]]) -> dict[str, Any]:
    rows, met = [], 0
    for model in models:
        for peer in model.get("runs", []):
            if peer["kind"] in ("torchckpt", "compile") or not _ok(peer) or peer.get("peak_bytes") is None:
                continue
            plan, how = _plan_at(model, peer)
            row = {"model": model["name"], "peer": peer["label"], "chosen": how}
            if plan is None:
                row.update(met=False, chosen="none", detail=how)
            else:
                speed = peer["step_time"]["median"] / plan["step_time"]["median"]
                lower = plan["peak_bytes"] <= peer["peak_bytes"]
                row.update(met=lower and speed >= 1.0, speedup=speed, plan=plan["label"],
                           detail=f"peak {format_bytes(plan['peak_bytes'])} vs {format_bytes(peer['peak_bytes'])}, "
                                  f"{speed:.2f}x")
            met += row["met"]
            rows.append(row)
    return {"met": bool(rows) and met == len(rows), "count_met": met, "count": len(rows), "rows": rows}


def _speed(models: list[dict[str, Any]]) -> dict[str, Any]:
    from .models import get_model

    rows = []
    for model in models:
        if get_model(model["name"]).family != "gpt" or "skipped" in model:
            continue
        peer = next((r for r in model.get("runs", []) if r["kind"] == "every_block"), None)
        plan, how = _plan_at(model, peer) if peer is not None and _ok(peer) else (None, "every block did not run")
        if peer is None or plan is None:
            rows.append({"model": model["name"], "met": False, "detail": f"not measured: {_brief(how, 120)}"})
            continue
        speed = peer["step_time"]["median"] / plan["step_time"]["median"]
        rows.append({"model": model["name"], "speedup": speed, "met": speed >= SPEEDUP_TARGET, "chosen": how,
                     "detail": f"{speed:.2f}x ({plan['label']})"})
    return {"met": bool(rows) and all(r["met"] for r in rows), "rows": rows}


def bound_rows(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Target 6, one row per plan made (measured or not): predicted extra time over the lower bound.

    Example:
        >>> run = {"kind": "torchckpt", "label": "torchckpt sweep 1/2", "budget_bytes": 10,
        ...        "predicted_extra_time_s": 1.2, "lower_bound_s": 1.0}
        >>> row = bound_rows([{"name": "m", "runs": [run]}])[0]
        >>> round(row["ratio"], 2), row["met"]
        (1.2, True)
    """
    rows = []
    for model in models:
        for run in model.get("runs", []):
            if run["kind"] != "torchckpt" or "predicted_extra_time_s" not in run:
                continue
            plan, bound = float(run["predicted_extra_time_s"]), run.get("lower_bound_s")
            row: dict[str, Any] = {"model": model["name"], "plan": run["label"], "budget_bytes": run["budget_bytes"],
                                   "predicted_extra_s": plan, "lower_bound_s": bound}
            if bound is None:
                row.update(ratio=None, met=False, detail="no bound recorded")
            elif plan <= 0.0:
                row.update(ratio=1.0, met=True, detail="recomputes nothing")
            elif bound <= 0.0:
                row.update(ratio=None, met=False, detail=f"bound 0, plan {plan:.3g} s: the budget is bound by a "
                                                         "peak the relaxation drops")
            else:
                row.update(ratio=plan / bound, met=plan / bound <= BOUND_TARGET,
                           detail=f"{plan:.3g} s vs bound {bound:.3g} s = {plan / bound:.2f}x")
            rows.append(row)
    return rows


def evaluate_targets(results: dict[str, Any]) -> dict[str, Any]:
    """The six targets of the module docstring, each with ``met`` and the numbers behind it.

    Example:
        >>> evaluate_targets({"models": []})["within_budget"]["met"]
        False
    """
    models = results["models"]
    # Every budget's plan must fit that budget (plans shared by two budgets count for each); prediction
    # errors count each measured plan once.
    plan_runs = [r for m in models for r in m.get("runs", []) if r["kind"] == "torchckpt"
                 and r.get("peak_bytes") is not None]
    within = [r for r in plan_runs if r["within_budget"]]
    errors = [abs(r["prediction_error"]) for r in plan_runs if "same_plan_as" not in r]
    planning = [(m["name"], m["planning"]["planning_in_steps"]) for m in models
                if "planning_in_steps" in m.get("planning", {})]
    median_error = statistics.median(errors) if errors else None
    bounds = bound_rows(models)
    return {
        "pareto": _pareto(models),
        "speedup_at_every_block_peak": _speed(models),
        "within_budget": {"met": bool(plan_runs) and len(within) == len(plan_runs), "count_within": len(within),
                          "count": len(plan_runs),
                          "over": [f"{m['name']}: {r['label']} measured {format_bytes(r['peak_bytes'])} > budget "
                                   f"{format_bytes(r['budget_bytes'])}" for m in models for r in m.get("runs", [])
                                   if r in plan_runs and not r["within_budget"]]},
        "prediction_error": {"met": median_error is not None and median_error <= PREDICTION_TARGET,
                             "median": median_error, "max": max(errors) if errors else None, "count": len(errors)},
        "planning_steps": {"met": bool(planning) and all(s <= PLANNING_TARGET_STEPS for _, s in planning),
                           "per_model": dict(planning),
                           "models_not_planned": [m["name"] for m in models if "planning_in_steps"
                                                  not in m.get("planning", {})]},
        "lower_bound": {"met": bool(bounds) and all(r["met"] for r in bounds),
                        "count_met": sum(r["met"] for r in bounds), "count": len(bounds),
                        "worst": max((r["ratio"] for r in bounds if r["ratio"] is not None), default=None),
                        "rows": bounds},
    }


# --------------------------------------------------------------------------------------------- Markdown
def _bytes(value: int | None) -> str:
    return "—" if value is None else format_bytes(value)


def _row(run: dict[str, Any], none_peak: int | None) -> str:
    if run.get("status") != "ok":
        note = _brief(run.get("reason", ""))
        if run.get("same_plan_as"):
            note = f"same plan as {run['same_plan_as']}; {note}"
        return f"| {run['label']} | **{run.get('status', '?')}** | | | | | | | | | {note} |"
    time_ = run["step_time"]
    peak = run.get("peak_bytes")
    share = f"{peak / none_peak:.0%}" if peak is not None and none_peak else "—"
    budget = _bytes(run.get("budget_bytes")) if run["kind"] == "torchckpt" else ""
    predicted = ""
    if run["kind"] == "torchckpt":
        predicted = f"{_bytes(run['predicted_peak_bytes'])} ({run['prediction_error']:+.1%})"
    within_budget = run.get("within_budget")
    within = "" if within_budget is None else "yes" if within_budget else "**NO**"
    grads = ("differ (max {:.2g})".format(run.get("max_abs_diff", float("nan"))) if not run.get("equal")
             else f"to rounding ({run.get('relative_diff', 0):.1g}; loss head in chunks)" if run.get("to_rounding")
             else "bitwise")
    note = f"same plan as {run['same_plan_as']}" if run.get("same_plan_as") else run.get("meter_note", "")[:60]
    return (f"| {run['label']} | ok | {_bytes(peak)} | {share} | {_bytes(run.get('peak_rss_bytes'))} | "
            f"{time_['median']:.3f} s ({time_['min']:.3f}–{time_['max']:.3f}) | {run['ratio_to_none']:.2f}x | "
            f"{budget} | {predicted} | {within} | {grads} | {note} |")


def _model_section(model: dict[str, Any]) -> list[str]:
    lines = [f"### {model['name']}: {model['description']}", ""]
    if "skipped" in model:
        return [*lines, f"Skipped: {model['skipped']}.", ""]
    if "error" in model:
        lines += [f"Error: {model['error']}", ""]
    planning = model.get("planning", {})
    if "error" in planning:
        lines += [f"Planning failed: `{planning['error']}`", ""]
    elif "planning_in_steps" in planning:
        summary = (f"Planning: profile {planning['profile_s']:.1f} s + solve {planning['solve_s_median'] * 1e3:.0f} ms"
                   f" = {planning['planning_in_steps']:.1f} plain steps (plain step {planning['plain_step_s']:.3f} s);"
                   f" floor {_bytes(planning['floor_bytes'])}, predicted plain peak"
                   f" {_bytes(planning['plain_predicted_peak_bytes'])}.")
        lines += [summary, ""]
    none_peak = next((r.get("peak_bytes") for r in model.get("runs", []) if r["kind"] == "none"), None)
    header = ("| method | status | peak (meter) | vs none | peak RSS | step time median (min–max) | vs none | "
              "budget | predicted (error) | within | gradients | note |")
    lines += [header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(run, none_peak) for run in model.get("runs", [])]
    return [*lines, "", f"![{model['name']}]({model['plot']})" if model.get("plot") else "", ""]


def _verdict(met: bool) -> str:
    return "**met**" if met else "**not met**"


def _targets_section(targets: dict[str, Any]) -> list[str]:
    pareto, speed = targets["pareto"], targets["speedup_at_every_block_peak"]
    within, error, planning = targets["within_budget"], targets["prediction_error"], targets["planning_steps"]
    over = f" Over: {'; '.join(within['over'])}." if within["over"] else ""
    errors = (f"median {error['median']:.2%}, worst {error['max']:.2%} over {error['count']} plans."
              if error["median"] is not None else "no plan measured.")
    unplanned = (f"; not planned: {', '.join(planning['models_not_planned'])}"
                 if planning["models_not_planned"] else "")
    steps = ", ".join(f"{name} {value:.1f}" for name, value in planning["per_model"].items())
    speeds = "; ".join(f"{r['model']} {r['detail']}" for r in speed["rows"])
    bound = targets.get("lower_bound")  # absent in results written before it existed
    missed = [f"{r['model']} {r['plan']}: {r['detail']}" for r in (bound or {}).get("rows", []) if not r["met"]]
    bound_line = ("6. Predicted extra time within 1.25x of the fractional-knapsack lower bound: not recorded."
                  if bound is None else
                  f"6. Predicted extra time within {BOUND_TARGET}x of the fractional-knapsack lower bound: "
                  f"{_verdict(bound['met'])}: {bound['count_met']} of {bound['count']} plans"
                  + (f", worst {bound['worst']:.2f}x" if bound["worst"] is not None else "")
                  + (f". Missed: {'; '.join(missed[:6])}" if missed else "") + ".")
    lines = [
        "## Targets", "",
        (f"1. torchckpt Pareto-dominates every peer (at each peer's measured peak: measured peak no higher, "
         f"median step no slower): {_verdict(pareto['met'])}: {pareto['count_met']} of {pareto['count']} "
         "comparisons (table below)."),
        f"2. At every block's peak, >= {SPEEDUP_TARGET}x faster on the GPT models: {_verdict(speed['met'])}: {speeds}.",
        (f"3. Measured peak <= budget in 100% of torchckpt runs: {_verdict(within['met'])}: "
         f"{within['count_within']} of {within['count']}.{over}"),
        f"4. Median prediction error <= {PREDICTION_TARGET:.0%}: {_verdict(error['met'])}: {errors}",
        f"5. Planning <= {PLANNING_TARGET_STEPS:g} plain steps: {_verdict(planning['met'])}: {steps}{unplanned}.",
        bound_line,
        "",
        "| model | peer | torchckpt run | peak and speed-up (peer median / torchckpt median) | met |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['model']} | {r['peer']} | {_brief(r.get('chosen', ''), 140)} | {_brief(r['detail'], 140)} | "
              f"{'yes' if r['met'] else '**no**'} |" for r in pareto["rows"]]
    return [*lines, ""]


def markdown(results: dict[str, Any]) -> str:
    """The whole report as Markdown: machine, targets, one table (and plot) per model.

    Example:
        >>> text = markdown({"name": "x", "machine": {}, "config": {}, "models": [],
        ...                  "targets": evaluate_targets({"models": []})})
        >>> text.splitlines()[0]
        '# torchckpt benchmark: x'
    """
    machine, config = results["machine"], results["config"]
    machine_line = (f"Machine: {machine.get('platform')}, {machine.get('cpu_count')} CPUs ({machine.get('threads')} "
                    f"torch threads per process), torch {machine.get('torch')}, transformers "
                    f"{machine.get('transformers')}, MALLOC_MMAP_THRESHOLD_={machine.get('malloc_mmap_threshold')}; "
                    f"load average {machine.get('load_average_at_start')} at start, "
                    f"{machine.get('load_average_at_end')} at end (the machine is shared: times are noisy). "
                    f"Started {results.get('started')}, {results.get('wall_s', 0) / 60:.1f} min in all, "
                    f"commit {results.get('commit', 'not recorded')}.")
    settings = (f"Settings: {config.get('repeats')} interleaved timed steps per method (median, min–max), "
                f"{config.get('warmup_steps')} warm-up step(s), {config.get('sweep_points')} sweep budgets from the "
                "planner's floor to the plain peak, AdamW, every method in its own process. Peak = forward+backward "
                "peak of exact live tensor bytes (MemoryMeter) with parameters, AdamW state and batch; RSS = peak "
                "process RSS over the timed steps (forward, backward, optimizer step). Gradients are compared "
                "bitwise with no checkpointing.")
    lines = [f"# torchckpt benchmark: {results['name']}", "", machine_line, "", settings, ""]
    lines += _targets_section(results["targets"])
    lines += ["## Results", ""]
    for model in results["models"]:
        lines += _model_section(model)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- plots
def plot_model(model: dict[str, Any], path: str | Path) -> Path | None:
    """One PNG: peak memory (x) against median step time (y, min–max bars); torchckpt's measured
    Pareto frontier as a line, every peer a labelled point. A second panel uses peak RSS, where the
    torch.compile runs (no meter figure) also appear. None when nothing ran.

    Example:
        >>> plot_model({"name": "m", "runs": []}, "/tmp/m.png") is None
        True
    """
    runs = [r for r in model.get("runs", []) if _ok(r) and "same_plan_as" not in r]
    if not runs:
        return None
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install torchckpt[train] (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(13, 5))
    for axes, key, xlabel in ((panels[0], "peak_bytes", "measured peak, live tensor bytes (MiB)"),
                              (panels[1], "peak_rss_bytes", "peak process RSS (MiB)")):
        plans = sorted((r for r in runs if r["kind"] == "torchckpt" and r.get(key) is not None), key=lambda r: r[key])
        frontier = [r for r in plans if not any(q[key] <= r[key] and q["step_time"]["median"]
                                                < r["step_time"]["median"] for q in plans if q is not r)]
        if plans:
            axes.plot([r[key] / 2**20 for r in plans], [r["step_time"]["median"] for r in plans], "o",
                      color="tab:blue", alpha=0.4)
        if frontier:
            axes.plot([r[key] / 2**20 for r in frontier], [r["step_time"]["median"] for r in frontier], "o-",
                      color="tab:blue", label="torchckpt plans (measured Pareto front)")
        for run in runs:
            if run["kind"] == "torchckpt" or run.get(key) is None:
                continue
            x, y = run[key] / 2**20, run["step_time"]["median"]
            spread = [[y - run["step_time"]["min"]], [run["step_time"]["max"] - y]]
            axes.errorbar(x, y, yerr=spread, fmt="s", capsize=3)
            axes.annotate(run["label"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=7)
        axes.set_xlabel(xlabel)
        axes.set_ylabel("median training step time (s)")
        axes.grid(True, alpha=0.3)
        if plans:
            axes.legend(fontsize=8, loc="best")
    figure.suptitle(f"{model['name']}: {model['description']}")
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def write_reports(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Add the targets, write ``<name>.json``, ``<name>.md`` and a PNG per model; return the paths.

    Example:
        >>> import tempfile
        >>> paths = write_reports({"name": "x", "machine": {}, "config": {}, "models": []}, tempfile.mkdtemp())
        >>> sorted(paths)
        ['json', 'markdown']
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results["targets"] = evaluate_targets(results)
    paths: dict[str, Path] = {}
    for model in results["models"]:
        png = plot_model(model, out / f"{results['name']}-{model['name']}.png")
        model["plot"] = png.name if png else None
        if png:
            paths[f"plot:{model['name']}"] = png
    paths["json"] = out / f"{results['name']}.json"
    paths["json"].write_text(json.dumps(results, indent=1, default=str))
    paths["markdown"] = out / f"{results['name']}.md"
    paths["markdown"].write_text(markdown(results))
    return paths
