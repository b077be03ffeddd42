"""`xlaopt calibrate`'s report as text: the per-row table (`calibrate.calibrate`'s result) and
the refit (`calibrate.refit`'s)."""
from __future__ import annotations


def format_refit(result: dict) -> str:
    """`refit`'s result as text."""
    lines = [f"fitted on {len(result['rows'])} rows ({result.get('method', 'analytic')} method): "
             f"{', '.join(result['rows'])}"]
    for k, v in result["fitted"].items():
        same = "" if result["rounded"][k] == result["frozen"][k] else f"  (frozen: {result['frozen'][k]:.3g})"
        lines.append(f"  {k:<18} {v:.6g} -> {result['rounded'][k]:.3g}{same}")
    lines.append(f"mean |log(predicted / measured)|: fitted {result['objective_fitted']:.6f}, "
                 f"frozen {result['objective_frozen']:.6f}")
    lines.append(result["literal"])
    return "\n".join(lines)


def format_table(result: dict) -> str:
    """The report as a plain-text table."""
    compiled = result.get("method") == "compiled"
    extra = f" {'analytic':>10}" if compiled else ""
    lines = [f"{'id':<5} {'metric':<21} {'measured':>10} {'predicted':>10}{extra} {'error':>7} {'LOO':>7}  method"]
    for r in result["rows"]:
        if r["method"] == "unmodelled":
            lines.append(f"{r['id']:<5} {r['metric']:<21} {r['measured']:>10.4g} {'-':>10}{' ' * len(extra)} "
                         f"{'-':>7} {'-':>7}  unmodelled: {r['reason']}")
            continue
        loo = r.get("loo_rel_error")
        analytic = f" {r.get('analytic_predicted', r['predicted']):>10.4g}" if compiled else ""
        method = r["method"] + (f" (not compiled: {r['reason']})" if r.get("reason") else "")
        if r["method"] == "compiled":
            method += f" on {r['mesh']}, {r['compile_s']['lower'] + r['compile_s']['compile']:.0f} s to compile"
        method += f", recompute {r['recompute']}"
        defaulted = {**r.get("schedule_defaults", {}), **({"act_ckpt": r["act_ckpt_default"]}
                                                           if "act_ckpt_default" in r else {})}
        if defaulted:
            method += "; not stated, defaulted: " + ", ".join(f"{k}={v}" for k, v in defaulted.items())
        method += "".join(f"; {note}" for note in r.get("approximations", ()))
        lines.append(f"{r['id']:<5} {r['metric']:<21} {r['measured']:>10.4g} {r['predicted']:>10.4g}{analytic} "
                     f"{r['rel_error']:>+7.1%} {(f'{loo:+.1%}' if loo is not None else '-'):>7}  {method}")
    if result["median_abs_rel_error"] is not None:
        lines.append(f"median |error| {result['median_abs_rel_error']:.1%}, worst {result['max_abs_rel_error']:.1%} "
                     f"({result['modelled']} rows modelled, {result['unmodelled']} unmodelled"
                     + (f", {result['compiled']} compiled)" if compiled else ")"))
    if "compiled_median_abs_rel_error" in result:
        lines.append(f"compiled rows: median |error| {result['compiled_median_abs_rel_error']:.1%}, "
                     f"worst {result['compiled_max_abs_rel_error']:.1%}")
    if "loo_median_abs_rel_error" in result:
        lines.append(f"leave-one-out: median |error| {result['loo_median_abs_rel_error']:.1%}, "
                     f"worst {result['loo_max_abs_rel_error']:.1%}")
    if "compiled_fit" in result:
        f = result["compiled_fit"]
        lines.append(f"fitted on the compiled method's prices (mean |log| {f['objective']:.4f}, frozen "
                     f"{f['objective_frozen']:.4f}; the leave-one-out refits start here): "
                     + ", ".join(f"{k}={v:.3g}" for k, v in f["efficiency"].items()))
    e = result["efficiency"]
    lines.append("efficiency: " + ", ".join(f"{k}={v:.3g}" for k, v in e.items()))
    return "\n".join(lines)
