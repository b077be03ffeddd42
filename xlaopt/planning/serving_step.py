"""A serving step compiled and priced as `xlaopt analyze` prices a training step: one KV-cached
decode step (an LLM, Cosmos 3's reasoner), or one Cosmos 3 denoising step with the reasoner's
K/V cached and the same step uncached, on a mesh, compiled by XLA's CPU pipeline or deviceless
for the topology's GPUs, its scheduled HLO simulated on the topology, beside the serving
planner's analytic price (`serving.py` beside it) for the same split.

Nothing is allocated: the parameters (in the compute dtype, as a server holds them), the tokens
and the cache are abstract arrays carrying their shardings (`xlaopt.inference.placement`), and
the step is `xlaopt.inference.decode.decode_step`, the function `xlaopt generate` runs, with
its cache donated.
"""
from __future__ import annotations

import contextlib
import functools
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from xlaopt.analysis.topology import Topology
from xlaopt.compiler import cache as compile_cache
from xlaopt.errors import UserError
from xlaopt.inference.decode import SERVING_XLA_OPTIONS
from xlaopt.mesh import MESH_AXES, MeshSpec, make_mesh
from xlaopt.sharding import Rule


def _mesh(spec: MeshSpec, topology: Topology, target: str):
    if target == "gpu":
        from xlaopt.analysis.gpu_aot import gpu_mesh

        return gpu_mesh(topology, spec.sizes, MESH_AXES, spec.placement())
    return make_mesh(spec)


def _cache_for(target: str):
    """JAX's persistent cache for a compile for `target`: none for the deviceless GPU's, whose
    executables cannot be read back (`xlaopt.compiler.cache.unused`)."""
    return compile_cache.unused() if target == "gpu" else contextlib.nullcontext()


def _abstract(x, dtype, sharding):
    served = dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    return jax.ShapeDtypeStruct(x.shape, served, sharding=sharding)


def fused_attention_flops(hlo_text: str, heads: int, head_dim: int, rows: int) -> dict[str, dict[str, float]]:
    """FLOPs of each cuDNN fused-attention call of a serving step (XLA counts none), by its name
    scope (`fused_tag`): `rows` rows of `heads` query heads on a device, every query over every
    key of the call (L x S pairs: a request's row is one segment; a causal call is counted whole,
    an upper bound)."""
    import re

    from xlaopt.models.cudnn_attention import FORWARD_TARGET

    tags = set(re.findall(r"xlaopt_fused_L(\d+)_S(\d+)", hlo_text))
    return {f"xlaopt_fused_L{L}_S{S}": {FORWARD_TARGET: 4.0 * heads * head_dim * rows * int(L) * int(S)}
            for L, S in tags}


def _heads_per_call(config, spec: MeshSpec) -> int:
    """Query heads one fused-attention call runs on a device: its tensor share, and under Ulysses
    (whole rows) that share's part of the context ranks, cut into the transform's head groups."""
    from xlaopt.transforms.ulysses_attention import ulysses_split

    heads, context = config.num_heads // spec.size("tensor"), spec.size("context")
    if context == 1:
        return heads
    _, chunks = ulysses_split(config.num_heads, config.num_kv_heads, spec.size("tensor"), context)
    return heads // (context * chunks)


def _priced(compiled, spec: MeshSpec, topology: Topology, target: str, dtype: str,
            custom_call_flops: dict | None = None) -> dict:
    """A compiled step's simulated time and memory on the topology; on the GPU target with XLA's
    all-reduce kernels, as it was compiled (`SERVING_XLA_OPTIONS`), and `step_time_nccl_s` with
    every all-reduce on NCCL instead (the option changes no HLO, only which thunk runs)."""
    from xlaopt.analysis.costmodel import serving_efficiency
    from xlaopt.analysis.schedule import build_schedule
    from xlaopt.analysis.simulate import simulate

    text = compiled.as_text()
    cpu = target == "cpu"
    schedule = build_schedule(text, custom_call_flops=custom_call_flops)
    sims = [simulate(schedule, topology.placed(spec.placement()), spec.as_dict(), eff=serving_efficiency(topology),
                     matmul_dtype=dtype if cpu else None, cpu_fixups=cpu, keep_timeline=False, kernels=kernels)
            for kernels in (not cpu, False)]
    sim = sims[0]
    memory = compiled.memory_analysis()
    return {"step_time_s": sim.step_time_s, "step_time_nccl_s": sims[1].step_time_s, "compute_s": sim.compute_s,
            "comm_s": sim.comm_s, "exposed_comm_s": sim.exposed_comm_s,
            "memory": {"arguments": int(memory.argument_size_in_bytes), "temp": int(memory.temp_size_in_bytes),
                       "aliased": int(memory.alias_size_in_bytes)},
            "all_reduces": text.count("all-reduce-start(") + text.count(" all-reduce("),
            "kernel_all_reduces": sum(1 for op in schedule.ops if op.kind in ("collective", "collective-start")
                                      and op.collective.kernel)}


def _served_params(config, execution, placement, dtype):
    """The model's parameters as abstract arrays in the compute dtype, in their training layout."""
    from xlaopt import step
    from xlaopt.families import family_of
    from xlaopt.program import TrainProgram, TrainSettings

    params, _ = step.abstract_params_with_axes(
        TrainProgram(config, settings=TrainSettings(family_of(config).default_batch(config)), execution=execution,
                     target=placement.program.target))
    return jax.tree.map(lambda p, s: _abstract(p, jnp.dtype(dtype), s), params, placement.param_shardings)


def analyze_denoise(config, spec: MeshSpec, rules: tuple[Rule, ...], topology: Topology, target: str, rows: int,
                    text: int, gen: int, guidance: float = 3.0, dtype: str = "bfloat16",
                    which: tuple[str, ...] = ("cached", "uncached")) -> dict:
    """Compile and price one denoising step of `rows` clips of `gen` latent tokens after `text`
    prompt tokens (both guidance branches in one batch when `guidance` != 1), cached and uncached
    (or the one of them `which` names)."""
    from xlaopt.analysis.costmodel import serving_efficiency
    from xlaopt.data.batch import BatchShape, cosmos3_batch_spec
    from xlaopt.execution import ExecutionConfig, target_attention
    from xlaopt.families import family_of
    from xlaopt.inference import sample_cosmos as sc
    from xlaopt.inference.decode import CACHE_AXES
    from xlaopt.inference.placement import Placement
    from xlaopt.planning.serving import Request, price_denoise

    if not family_of(config).generates_video:
        raise UserError(f"--serve denoise compiles a generator's denoising step; {config.name} has no generator")
    sc.check_guidance(guidance)
    cfg = guidance != 1.0
    R = 2 * rows if cfg else rows
    execution = ExecutionConfig(compute_dtype=dtype, attention=target_attention(target))
    placement = Placement.on(config, spec, execution, rules, mesh=_mesh(spec, topology, target), positions=True)
    model = family_of(config).module(config, execution)
    params = _served_params(config, execution, placement, dtype)
    replicated = NamedSharding(placement.mesh, PartitionSpec())
    spec_ = cosmos3_batch_spec(config, BatchShape(R, text, gen))

    def field(name):
        shape, dt, axes = spec_[name]
        return jax.ShapeDtypeStruct(shape, dt, sharding=placement.sharding(axes, shape, f"request field {name}"))

    x = jax.ShapeDtypeStruct((rows, gen, config.generator_in_dim), jnp.float32,
                             sharding=placement.sharding(sc.LATENT_AXES, (rows, gen, config.generator_in_dim),
                                                         "the latents"))
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    L, N, K = config.num_layers, config.num_kv_heads, config.head_dim
    kv_shape = (L, R, text, N, K)
    kv = jax.ShapeDtypeStruct(kv_shape, jnp.dtype(dtype), sharding=placement.sharding(CACHE_AXES, kv_shape, "the K/V"))
    steps = {
        "cached": (lambda p, b, x, s, g, c: sc._cached_step(model, cfg, p, b, x, s, g, c),
                   (sc.generator_params(params), {k: field(k) for k in sc.GEN_FIELDS}, x, scalar, scalar,
                    sc.ReasonerKV(kv, kv))),
        "uncached": (lambda p, b, x, s, g: sc._uncached_step(model, cfg, p, b, x, s, g),
                     (params, {k: field(k) for k in spec_}, x, scalar, scalar)),
    }
    out: dict = {"model": config.name, "mode": "denoise", "mesh": spec.as_dict(), "topology": topology.name,
                 "target": target, "rows": rows, "text": text, "gen": gen, "guidance": guidance, "compute_dtype": dtype}
    for name, (fn, args) in ((n, steps[n]) for n in which):
        t0 = time.perf_counter()
        with placement.tracing(R), sc.ulysses(placement, config, (text, gen)), _cache_for(target):
            compiled = jax.jit(fn, out_shardings=x.sharding).lower(*args).compile(compiler_options=SERVING_XLA_OPTIONS)
        # On the GPU the attention is cuDNN's: its FLOPs, per device (rows over data, heads over tensor).
        fused = fused_attention_flops(compiled.as_text(), _heads_per_call(config, spec), config.head_dim,
                                      max(1, R // spec.size("data"))) if target == "gpu" else None
        out[name] = dict(_priced(compiled, spec, topology, target, dtype, fused), compile_s=time.perf_counter() - t0)
    if len(which) == 2:
        out["speedup_vs_uncached"] = out["uncached"]["step_time_s"] / out["cached"]["step_time_s"]
    data = spec.size("data") * spec.size("fsdp")
    analytic = price_denoise(config, Request("denoise", R, text=text, gen=gen), data, spec.size("tensor"), topology,
                             serving_efficiency(topology))
    out["analytic"] = {"cached_step_s": analytic.step_s, "uncached_step_s": analytic.uncached_step_s}
    return out


def format_denoise(r: dict) -> str:
    mesh = ",".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1) or "one device"
    c, u, a = r["cached"], r["uncached"], r["analytic"]
    return "\n".join([
        f"{r['model']} denoising step on {mesh}, topology {r['topology']}, target {r['target']}: {r['rows']} clip(s) "
        f"of {r['gen']:,} latent tokens after {r['text']:,} prompt tokens, guidance {r['guidance']:g}, "
        f"{r['compute_dtype']}",
        f"cached (reasoner K/V once a prompt): {c['step_time_s'] * 1e3:.2f} ms (analytic {a['cached_step_s'] * 1e3:.2f})"
        f"   uncached: {u['step_time_s'] * 1e3:.2f} ms (analytic {a['uncached_step_s'] * 1e3:.2f})   "
        f"speedup {r['speedup_vs_uncached']:.2f}x",
        f"memory per device, cached: arguments {c['memory']['arguments'] / 2**30:.2f} GiB, temp "
        f"{c['memory']['temp'] / 2**30:.2f} GiB; compile {c['compile_s'] + u['compile_s']:.1f} s",
    ])


def analyze_decode(config, spec: MeshSpec, rules: tuple[Rule, ...], topology: Topology, target: str, rows: int,
                   context: int, dtype: str = "bfloat16") -> dict:
    """Compile and price one decode step of `rows` rows over a cache of `context` tokens."""
    from xlaopt.analysis.costmodel import serving_efficiency
    from xlaopt.execution import ExecutionConfig
    from xlaopt.families import family_of
    from xlaopt.inference.decode import (
        K_CACHE_AXES,
        TOKEN_AXES,
        V_CACHE_AXES,
        KVCache,
        cache_shapes,
        decode_step,
        layer_params,
        tower_of,
    )
    from xlaopt.inference.placement import Placement
    from xlaopt.planning.serving import Request, price_decode

    if not family_of(config).decodes_text:
        raise UserError(f"--serve decode compiles a causal text tower's token step; {config.name} has none")
    if spec.num_devices > topology.num_devices:
        raise UserError(f"mesh {spec} needs {spec.num_devices} devices but topology {topology.name} has "
                        f"{topology.num_devices}")
    execution = ExecutionConfig(compute_dtype=dtype)
    placement = Placement.on(config, spec, execution, rules, mesh=_mesh(spec, topology, target))
    tower = tower_of(family_of(config).module(config, execution))
    params = layer_params(tower, _served_params(config, execution, placement, dtype))
    one = {}
    for name, axes, shape in zip("kv", (K_CACHE_AXES, V_CACHE_AXES), cache_shapes(tower, rows, context)):
        sharding = placement.sharding(axes, shape, "the KV cache")
        one[name] = tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
                          for _ in range(tower.num_layers))
    cache = KVCache(one["k"], one["v"],
                    jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(placement.mesh, PartitionSpec())))
    token = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=placement.sharding(TOKEN_AXES, (rows,), "the tokens"))
    t0 = time.perf_counter()
    with placement.tracing(rows):
        lowered = jax.jit(functools.partial(decode_step, tower), donate_argnums=(2,)).lower(params, token, cache)
    with _cache_for(target):
        compiled = lowered.compile(compiler_options=SERVING_XLA_OPTIONS)
    compile_s = time.perf_counter() - t0
    data = spec.size("data") * spec.size("fsdp")
    analytic = price_decode(config, Request("decode", rows, context), data, spec.size("tensor"), topology,
                            serving_efficiency(topology))
    priced = _priced(compiled, spec, topology, target, dtype)
    # A token step reads each of its arguments (every weight, the whole cache) at least once:
    # over the HBM bandwidth, the floor no decode step of this layout can beat.
    floor_s = priced["memory"]["arguments"] / topology.device.hbm_bytes_per_s
    return {
        "model": config.name, "mode": "decode", "mesh": spec.as_dict(), "topology": topology.name, "target": target,
        "rows": rows, "context": context, "compute_dtype": dtype, **priced,
        "floor_s": floor_s, "step_over_floor": priced["step_time_s"] / floor_s,
        "cache_aliased": "input_output_alias" in compiled.as_text(),
        "analytic_step_s": analytic.step_s, "analytic_memory_bytes": analytic.memory_bytes,
        "compile_s": compile_s,
    }


def format_decode(r: dict) -> str:
    mesh = ",".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1) or "one device"
    gib = 2.0**30
    return "\n".join([
        f"{r['model']} decode step on {mesh}, topology {r['topology']}, target {r['target']}: {r['rows']} rows over "
        f"{r['context']:,} cached tokens, {r['compute_dtype']}",
        f"step time {r['step_time_s'] * 1e3:.2f} ms (analytic {r['analytic_step_s'] * 1e3:.2f} ms; floor "
        f"{r['floor_s'] * 1e3:.2f} ms, the arguments read once over HBM: {r['step_over_floor']:.2f}x)   compute "
        f"{r['compute_s'] * 1e3:.2f} ms   comm {r['comm_s'] * 1e3:.2f} ms   exposed {r['exposed_comm_s'] * 1e3:.2f} ms",
        f"memory per device: arguments {r['memory']['arguments'] / gib:.2f} GiB (weights and cache; analytic "
        f"{r['analytic_memory_bytes'] / gib:.2f} GiB), temp {r['memory']['temp'] / gib:.2f} GiB; cache updated in "
        f"place: {'yes' if r['cache_aliased'] else 'no'}; {r['all_reduces']} all-reduces, {r['kernel_all_reduces']} "
        f"of them XLA's kernels (all on NCCL: {r['step_time_nccl_s'] * 1e3:.2f} ms a step); compile "
        f"{r['compile_s']:.1f} s",
    ])
