"""Inference layouts: how to lay a model out to serve it, priced by the same cost model.

Serving holds no gradients and no optimizer state. Per device: the compute-dtype weights, split
over `tensor` and replicated over the data replicas (FSDP is no serving layout: it would gather
every weight again for every token), the KV cache of the rows it serves, and one step's
activations. Two steps are priced, each per layer then times the layers:
  decode   one new token per row over a cache of `context` tokens (an LLM, Cosmos 3's reasoner):
           memory-bound, it reads every weight and the whole cache once a token, so tensor
           parallelism divides the time by the devices it reads from; each layer then
           all-reduces its attention and MLP outputs (two all-reduces of rows x d_model), which
           latency-bound collectives leave exposed: nothing is left to overlap them with;
  denoise  one generator forward of a Cosmos 3 sample: `gen` tokens attending to the prompt's
           `text` cached keys and their own (the reasoner's K/V cached once a prompt,
           `xlaopt.inference.sample_cosmos`); compute-bound. Priced uncached as well (the whole
           row through both towers every step), which is what the cache saves.
Candidates split the node's devices into data replicas x tensor; the tensor group stays inside
a node, and grouped-query attention with more tensor ranks than KV heads replicates the KV
heads (each rank keeps the head its queries read). Ranked by the step's latency, then by
throughput (rows a second); a candidate whose weights and cache do not fit is over memory.
"""
from __future__ import annotations

import dataclasses

from xlaopt.analysis import costmodel as cm
from xlaopt.analysis.topology import Topology
from xlaopt.errors import UserError
from xlaopt.mesh import DEVICE_ORDER_TENSOR_INNER, MeshSpec
from xlaopt.planning.shapes import tower_shape

MODES = ("decode", "denoise")
_BF16 = 2


@dataclasses.dataclass(frozen=True)
class Request:
    """What one step serves: `rows` sequences; decode: `context` cached tokens each; denoise:
    `text` prompt tokens and `gen` generator tokens each, under guidance both branches (2x rows)."""
    mode: str
    rows: int
    context: int = 0
    text: int = 0
    gen: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise UserError(f"--serve {self.mode!r}: use one of {', '.join(MODES)}")
        if self.rows < 1 or (self.mode == "decode" and self.context < 1) or (
                self.mode == "denoise" and (self.text < 1 or self.gen < 1)):
            raise UserError(f"serving request {self}: rows, and the context (decode) or text and generator tokens "
                            f"(denoise), must be positive")


@dataclasses.dataclass(frozen=True)
class ServingPrice:
    dp: int
    tp: int
    step_s: float
    parts: dict  # seconds: weights/cache reads or matmuls, attention, TP collectives, head
    memory_bytes: float
    memory_parts: dict
    rows_per_s: float
    uncached_step_s: float | None = None  # denoise: the same step without the reasoner's K/V cache
    reason: str = ""

    @property
    def mesh(self) -> MeshSpec:
        return MeshSpec.of(DEVICE_ORDER_TENSOR_INNER, data=self.dp, tensor=self.tp)


def _tensor_dims(config) -> dict[str, int]:
    return {"heads": config.num_heads, "mlp": config.mlp_dim, "vocab": config.vocab_size}


def _layer_params(config) -> int:
    return tower_shape(config).layer_params


def _kv_heads_per_rank(config, tp: int) -> float:
    return config.num_kv_heads / tp if tp <= config.num_kv_heads else 1.0


def _tp_all_reduces(rows_tokens: float, config, tp: int, topology: Topology, eff: cm.Efficiency) -> float:
    """One layer's two activation all-reduces (attention out, MLP out) over the tensor group, as a
    serving step compiled with XLA's all-reduce kernels runs them."""
    span = cm.group_span(tp, 1, topology.devices_per_node)
    return 2 * cm.serving_all_reduce_time_s(rows_tokens * config.d_model * _BF16, span, topology, eff)


def price_decode(config, request: Request, dp: int, tp: int, topology: Topology, eff: cm.Efficiency) -> ServingPrice:
    dev, L = topology.device, config.num_layers
    rows = request.rows / dp  # this replica's rows, one new token each
    weights = _BF16 * _layer_params(config) / tp
    kv_per_layer = rows * request.context * 2 * _kv_heads_per_rank(config, tp) * config.head_dim * _BF16
    head = _BF16 * config.d_model * config.vocab_size / tp
    # A token step reads the layer's weights and cache; its matmuls (2 x rows x weights) are
    # far under the roofline's knee at serving batch sizes, so the reads set the time.
    layer_flops = 2 * rows * _layer_params(config) / tp + 4 * rows * config.num_heads / tp * config.head_dim * request.context
    peak = dev.peak_flops["bfloat16"] * eff.matmul_max_for(dev.name)
    read_s = L * cm.roofline_time_s(layer_flops, weights + kv_per_layer, peak, dev.hbm_bytes_per_s)
    head_s = cm.roofline_time_s(2 * rows * config.d_model * config.vocab_size / tp, head, peak, dev.hbm_bytes_per_s)
    comm_s = L * _tp_all_reduces(rows, config, tp, topology, eff)
    step = read_s + head_s + comm_s
    from xlaopt.families import family_of

    towers = family_of(config).towers  # Cosmos 3 keeps its generator resident too
    memory = {"weights": towers * L * weights + 2 * head, "kv_cache": L * kv_per_layer,
              "activations": rows * config.vocab_size * 4.0 / tp + 4 * rows * config.d_model * _BF16}
    return ServingPrice(dp, tp, step, {"layers": read_s, "head": head_s, "tp_collectives": comm_s},
                        sum(memory.values()), memory, request.rows / step)


def tower_forward_s(config, tokens: float, pairs: float, split: int, topology: Topology,
                    eff: cm.Efficiency) -> tuple[float, float]:
    """(matmul s, attention s) of a tower's forward over `tokens` tokens whose attention computes
    `pairs` (query, key) pairs, every layer's work split `split` ways (tensor x Ulysses): the
    matmuls on the size curve as four launches a layer (qkv, out, MLP up and gate, MLP down: the
    split the training fit's `matmul_half_flops` was fitted with, `analysis.analytic`), the fused
    attention at its fraction of peak (`costmodel.serving_efficiency` for a serving step: forward only)."""
    dev, L = topology.device, config.num_layers
    peak = dev.peak_flops["bfloat16"]
    lin = 2 * tokens * _layer_params(config) * L / split
    att = 4 * config.num_heads * config.head_dim * pairs * L / split
    return (cm.matmul_time_s(lin, peak, lin / (4 * L), eff.matmul_max_for(dev.name), eff.matmul_half_flops),
            cm.attention_time_s(att, peak, eff))


def price_denoise(config, request: Request, dp: int, tp: int, topology: Topology, eff: cm.Efficiency) -> ServingPrice:
    """A generator step over `gen` tokens a row, queries over `text + gen` keys; uncached, the
    reasoner's `text` tokens through their own tower (causal attention) every step as well."""
    L, rows = config.num_layers, request.rows / dp
    T, V = request.text, request.gen
    gen_lin, gen_att = tower_forward_s(config, rows * V, rows * V * (T + V), tp, topology, eff)
    reasoner_lin, reasoner_att = tower_forward_s(config, rows * T, rows * T * (T + 1) / 2, tp, topology, eff)
    comm_gen = L * _tp_all_reduces(rows * V, config, tp, topology, eff)
    comm_all = L * _tp_all_reduces(rows * (T + V), config, tp, topology, eff)
    weights = _BF16 * 2 * _layer_params(config) / tp  # both towers stay resident
    cache = rows * T * 2 * _kv_heads_per_rank(config, tp) * config.head_dim * _BF16
    cached = gen_lin + gen_att + comm_gen
    uncached = gen_lin + gen_att + reasoner_lin + reasoner_att + comm_all
    memory = {"weights": L * weights + 2 * _BF16 * config.d_model * config.vocab_size / tp, "kv_cache": L * cache,
              "activations": 8 * rows * V * max(config.d_model, config.mlp_dim / tp) * _BF16}
    return ServingPrice(dp, tp, cached, {"layers": gen_lin + gen_att, "tp_collectives": comm_gen},
                        sum(memory.values()), memory, request.rows / cached, uncached_step_s=uncached)


def plan_serving(config, topology: Topology, request: Request) -> list[ServingPrice]:
    """Every data x tensor split of one node's devices (or of all of them, data across nodes),
    ranked: those that fit, by latency then throughput; then those that do not, with why."""
    from xlaopt.families import family_of

    family = family_of(config)
    if request.mode == "denoise" and not family.generates_video:
        raise UserError(f"--serve denoise prices a generator's denoising step; {config.name} has no generator "
                        f"(serve it with --serve decode)")
    if request.mode == "decode" and not family.decodes_text:
        raise UserError(f"--serve decode prices a causal text tower's token step; {config.name} has none")
    eff = cm.serving_efficiency(topology)  # forward-only attention
    price = price_decode if request.mode == "decode" else price_denoise
    n, hbm = topology.num_devices, topology.device.hbm_bytes
    out = []
    for tp in (t for t in range(1, topology.devices_per_node + 1) if topology.devices_per_node % t == 0):
        dp = n // tp
        bad = [f"{name} {size}" for name, size in _tensor_dims(config).items() if size % tp]
        if bad:
            continue  # the rule table cannot split these over tensor=tp
        p = price(config, request, dp, tp, topology, eff)
        if request.rows % dp:
            p = dataclasses.replace(p, reason=f"{request.rows} rows do not split over {dp} replicas")
        elif hbm > 0 and p.memory_bytes > hbm:
            p = dataclasses.replace(p, reason=f"needs {p.memory_bytes / 2**30:,.1f} GiB per device of "
                                              f"{hbm / 2**30:,.1f}")
        out.append(p)
    if not out:
        raise UserError(f"no tensor split of {topology.devices_per_node} devices divides {config.name}'s heads, MLP "
                        f"and vocabulary")
    return sorted(out, key=lambda p: (bool(p.reason), p.step_s, -p.rows_per_s))


def format_serving(config, topology: Topology, request: Request, ranked: list[ServingPrice]) -> str:
    what = (f"decode: {request.rows} rows x 1 token over {request.context:,} cached tokens" if request.mode == "decode"
            else f"denoise: {request.rows} rows x {request.gen:,} generator tokens over a {request.text:,}-token prompt")
    lines = [f"serve {config.name} on {topology.name} ({topology.num_devices} devices), {what}; analytic, bf16",
             f"  {'layout':<16}{'step ms':>10}{'rows/s':>10}{'GiB/dev':>9}  {'tp comm ms':>10}"
             + ("  uncached ms" if request.mode == "denoise" else "") + "  reason"]
    best = next((p for p in ranked if not p.reason), None)
    for p in ranked:
        extra = f"  {p.uncached_step_s * 1e3:>11.2f}" if p.uncached_step_s is not None else ""
        reason = p.reason or ("best" if p is best else f"{p.step_s / best.step_s:.2f}x the best's latency")
        lines.append(f"  dp={p.dp:<3} tp={p.tp:<6}{p.step_s * 1e3:>10.2f}{p.rows_per_s:>10.1f}"
                     f"{p.memory_bytes / 2**30:>9.1f}  {p.parts['tp_collectives'] * 1e3:>10.2f}{extra}  {reason}")
    return "\n".join(lines)


def report(ranked: list[ServingPrice], request: Request) -> dict:
    return {"request": dataclasses.asdict(request),
            "candidates": [{"dp": p.dp, "tp": p.tp, "step_s": p.step_s, "rows_per_s": p.rows_per_s,
                            "memory_bytes": p.memory_bytes, "memory_parts": p.memory_parts, "parts": p.parts,
                            "uncached_step_s": p.uncached_step_s,
                            "speedup_vs_uncached": (p.uncached_step_s / p.step_s if p.uncached_step_s else None),
                            "reason": p.reason} for p in ranked]}
