"""A structured view of a compiled training step: collectives (by kind, mesh axes and link
level, with bytes per step), memory per device, and model FLOPs; as JSON and as a table."""
from __future__ import annotations

from xlaopt.analysis.hlo import bytes_by, collectives
from xlaopt.compile import compile_program
from xlaopt.families import family_of
from xlaopt.program import TrainProgram


def inspect_program(program: TrainProgram, topology=None) -> dict:
    """Compile `program` on its mesh and read its scheduled HLO; nothing is executed."""
    executable = compile_program(program).train_step
    mesh = program.mesh.as_dict()
    placed = topology.placed(program.mesh.placement()) if topology is not None else None
    colls = collectives(executable.as_text(), mesh, placed)
    groups: dict[tuple, dict] = {}
    for c in colls:
        key = (c.kind, ",".join(c.mesh_axes) or "-", c.link_level or "-")
        g = groups.setdefault(key, {"kind": key[0], "mesh_axes": key[1], "link_level": key[2],
                                    "instructions": 0, "executions_per_step": 0, "bytes_per_step": 0})
        g["instructions"] += 1
        g["executions_per_step"] += c.executions
        g["bytes_per_step"] += c.total_bytes
    memory = executable.memory_analysis()
    family = family_of(program.model)
    batch = family.synthetic(program.model, program.settings.batch, program.settings.seed).batch(0)
    return {
        "model": program.model.name, "mesh": mesh, "topology": getattr(topology, "name", None),
        "memory_per_device_bytes": {"arguments": memory.argument_size_in_bytes,
                                    "outputs": memory.output_size_in_bytes,
                                    "aliased": memory.alias_size_in_bytes,
                                    "temp": memory.temp_size_in_bytes},
        "model_flops_per_step": family.step_flops(program, batch),
        "comm_by_axis": bytes_by(colls, lambda c: ",".join(c.mesh_axes) or "-"),
        "collective_groups": sorted(groups.values(), key=lambda g: -g["bytes_per_step"]),
        "collectives": [{"name": c.name, "kind": c.kind, "computation": c.computation, "position": c.position,
                         "bytes": c.bytes, "executions": c.executions, "mesh_axes": list(c.mesh_axes),
                         "link_level": c.link_level, "group_size": len(c.replica_groups[0]) if c.replica_groups else 0}
                        for c in colls],
    }


def format_report(report: dict) -> str:
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    mem = report["memory_per_device_bytes"]
    lines = [f"{report['model']} on " + ",".join(f"{a}={s}" for a, s in report["mesh"].items() if s > 1)
             + (f" ({report['topology']})" if report["topology"] else ""),
             f"memory per device: arguments {mib(mem['arguments'])}, temp {mib(mem['temp'])}, "
             f"outputs {mib(mem['outputs'])} ({mib(mem['aliased'])} aliased to arguments)",
             f"model FLOPs per step: {report['model_flops_per_step'] / 1e9:,.1f} G",
             f"{'collective':<20}{'mesh axes':<16}{'link':<12}{'instr':>6}{'runs/step':>10}{'bytes/step':>16}"]
    for g in report["collective_groups"]:
        lines.append(f"{g['kind']:<20}{g['mesh_axes']:<16}{g['link_level']:<12}{g['instructions']:>6}"
                     f"{g['executions_per_step']:>10}{mib(g['bytes_per_step']):>16}")
    return "\n".join(lines)
