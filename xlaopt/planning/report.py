"""A plan as JSON-ready data and as the table `xlaopt plan` prints."""
from __future__ import annotations

import collections

from xlaopt.planning.planner import Plan, Priced


def priced_json(plan: Plan, p: Priced, full_layout: bool = True) -> dict:
    layout = plan.layout_for(p.candidate).to_json()
    if not full_layout:  # the base rules, batch, model and topology are every candidate's: said once
        kept = ("mesh", "order", "execution") + (("rules",) if p.candidate.sequence_parallel else ())
        layout = {k: v for k, v in layout.items() if k in kept}
    out = {"candidate": str(p.candidate), "kind": p.candidate.kind, "layout": layout, "method": p.method,
           "step_time_s": p.step_time_s, "mfu": plan.mfu(p), "memory_per_device_bytes": p.memory_bytes,
           "analytic_step_time_s": p.analytic.step_time_s, "analytic_memory_per_device_bytes": p.analytic.memory_bytes,
           "reason": p.reason}
    if p.compiled is not None:
        out["compiler_notes"] = [n for n in p.compiled["notes"] if n.startswith("XLA, compiling")]
        out["compiled_memory_per_device_bytes"] = p.compiled["memory_per_device_bytes"]["peak_estimate"]
        out["exposed_comm_s"] = p.compiled["exposed_comm_s"]
    return out


def plan_json(plan: Plan) -> dict:
    b = plan.program.settings.batch
    rejected = collections.Counter(r.reason for r in plan.rejected)
    return {
        "model": plan.program.model.name, "topology": plan.topology.name, "devices": plan.topology.num_devices,
        "target": plan.program.target, "method": plan.method,
        "batch": {"global_batch": b.batch_size, "text_len": b.text_len, "gen_len": b.gen_len,
                  "row_tokens": b.text_len + b.gen_len},
        "attention": plan.program.execution.attention,
        "best": priced_json(plan, plan.best),
        "baseline": priced_json(plan, plan.baseline) if plan.baseline is not None else None,
        "best_speedup_over_baseline": (plan.baseline.step_time_s / plan.best.step_time_s
                                       if plan.baseline is not None else None),
        "candidates": [dict(priced_json(plan, p, full_layout=False), rank=i) for i, p in enumerate(plan.ranked, 1)],
        "unfit": [priced_json(plan, p, full_layout=False) for p in plan.unfit],
        "rejected": [{"reason": reason, "candidates": n} for reason, n in rejected.most_common()],
        "counts": {"space": len(plan.ranked) + len(plan.unfit) + len(plan.rejected), "fit": len(plan.ranked),
                   "unfit": len(plan.unfit), "rejected": len(plan.rejected),
                   "compiled": sum(p.compiled is not None for p in plan.ranked + plan.unfit)},
        "memory_model": plan.memory_model,
        "seconds": plan.seconds,
    }


def format_plan(result: dict, rows: int = 12) -> str:
    gib = lambda x: f"{x / 2**30:,.1f}"
    b = result["batch"]
    lines = [f"plan {result['model']} on {result['topology']} ({result['devices']} devices), global batch "
             f"{b['global_batch']} rows of {b['row_tokens']:,} tokens, attention {result['attention']}; "
             f"best few priced {result['method']}",
             f"{'#':>3}  {'layout':<50}{'kind':<14}{'step s':>9}{'MFU':>7}{'GiB/dev':>9}  method    reason"]
    for c in result["candidates"][:rows]:
        lines.append(f"{c['rank']:>3}  {c['candidate']:<50}{c['kind']:<14}{c['step_time_s']:>9.3f}"
                     f"{c['mfu'] * 100:>6.1f}%{gib(c['memory_per_device_bytes']):>9}  {c['method']:<9} {c['reason']}")
    base, best = result["baseline"], result["best"]
    if base is None:
        lines.append(f"baseline (pure FSDP over {result['devices']} devices): cannot split the batch")
    else:
        lines.append(f"baseline (pure FSDP): {base['candidate']}: {base['step_time_s']:.3f} s ({base['method']}); "
                     f"best is {result['best_speedup_over_baseline']:.3f}x faster")
    n = result["counts"]
    lines.append(f"{n['space']} candidates: {n['fit']} fit, {n['unfit']} over memory, {n['rejected']} cannot be "
                 f"built, {n['compiled']} compiled; {result['seconds']:.1f} s")
    for c in result["candidates"] + result["unfit"]:
        lines += [f"  {c['candidate']}: {note}" for note in c.get("compiler_notes", ())]
    for r in result["rejected"][:4]:
        lines.append(f"  cannot build {r['candidates']}: {r['reason']}")
    if result["unfit"]:
        u = min(result["unfit"], key=lambda c: c["memory_per_device_bytes"])
        lines.append(f"  over memory {n['unfit']}, e.g. {u['candidate']}: {u['reason']}")
    lines.append(f"best: {best['candidate']} ({best['kind']}), {best['step_time_s']:.3f} s, MFU "
                 f"{best['mfu'] * 100:.1f}%, {gib(best['memory_per_device_bytes'])} GiB per device "
                 f"(analytic {gib(best['analytic_memory_per_device_bytes'])})")
    return "\n".join(lines)
