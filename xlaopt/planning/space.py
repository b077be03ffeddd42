"""The candidate layouts for a model on a topology and a global batch.

A candidate is a mesh (data replicas x FSDP shards x tensor x context over every device), the
device order that keeps the tensor and context groups innermost and the FSDP shard group inside
the data replicas (HSDP's shard group on the fast links: `DEVICE_ORDER_TENSOR_INNER`), a
recomputation policy, a micro-batch count, a precision (the compute dtype, and whether the
projections' matmuls run in fp8), and with tensor parallelism whether
the rule table splits the residual stream over the tensor ranks too (sequence parallelism, which
also splits each row's tokens over them). Pure data parallel (fsdp=1),
pure FSDP (dp=1) and every HSDP split between them are enumerated. Tensor and context groups are
kept inside a node (tp x cp <= devices per node): across the network their per-layer
collectives cannot hide. Pipeline stages (`pp`, the mesh axis `stage`, outermost) are tried where
asked (`stages`); a pipelined candidate's micro-batches are the pipeline's (multiples of the
stages, no gradient accumulation), and with FSDP each stage's weights are gathered either per
tick or once a step (`weights_once`). With data replicas, the optimizer's moments are kept whole
on each or split over them too (`sharded_optimizer`, ZeRO-1). Candidates that cannot be built say
why (`Rejected`).
"""
from __future__ import annotations

import dataclasses
import itertools

from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.execution import DTYPES
from xlaopt.mesh import DEVICE_ORDER_TENSOR_INNER, MeshSpec
from xlaopt.models.pipeline import virtual_stage_counts
from xlaopt.transforms.ulysses_attention import ulysses_split

# Recomputation policies (`xlaopt.models.remat`), from the least recomputed to the most: keep
# everything; Megatron's selective (the core attention again); MaxText's named sets, from every
# projection's and the attention's output down to q, k and v alone; JAX's matmul outputs; each
# layer's input only.
REMATS = ("none", "selective_megatron", "minimal_with_context", "dots", "save_dot_with_context_except_mlp",
          "save_dot_except_mlp", "save_qkv_proj", "full")
# Precisions by name: a compute dtype (fp32 compute is never the fast choice), or "fp8": bf16
# compute with the projections' matmuls in fp8 (`xlaopt.models.fp8`), only on devices with an fp8 peak.
PRECISIONS = ("bfloat16", "float16", "fp8")
_PRECISION = {"bfloat16": ("bfloat16", "compute"), "float16": ("float16", "compute"), "fp8": ("bfloat16", "fp8")}
assert all(dtype in DTYPES for dtype, _ in _PRECISION.values())


def check_precisions(names) -> tuple[str, ...]:
    """The precision names, each known; else a UserError listing them."""
    bad = [n for n in names if n not in PRECISIONS]
    if bad or not names:
        raise UserError(f"precision {', '.join(bad) or '(none)'!s}: precisions are {', '.join(PRECISIONS)}")
    return tuple(names)
MAX_MICRO_BATCHES = 8
# Virtual stages tried with a pipeline: each count up to this that divides a stage's layers. The
# bubble shrinks V times, for a send each of V times as many ticks and the stage's weights
# reordered once a step.
MAX_VIRTUAL_STAGES = 8


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    dp: int  # data-parallel replicas (HSDP's replica axis when fsdp > 1)
    fsdp: int  # parameter shards within a replica
    tp: int
    cp: int
    remat: str = "none"
    micro_batches: int = 1
    compute_dtype: str = "bfloat16"
    sequence_parallel: bool = False
    matmuls: str = "compute"  # "fp8": the projections' matmuls (`xlaopt.models.fp8`)
    pp: int = 1  # pipeline stages; with pp > 1, micro_batches are the pipeline's (`xlaopt.models.pipeline`)
    weights_once: bool = False  # pp > 1 with FSDP: each stage's weights gathered once a step, not per tick
    virtual_stages: int = 1  # pp > 1: rounds of the ring, a stage's layers in this many chunks
    schedule: str = "gpipe"  # pp > 1: `xlaopt.models.pipeline.SCHEDULES` (1f1b over virtual stages: interleaved)
    sharded_optimizer: bool = False  # dp > 1: ZeRO-1, the moments split over the replicas too

    @property
    def precision(self) -> str:
        """The name in PRECISIONS."""
        return "fp8" if self.matmuls == "fp8" else self.compute_dtype

    @property
    def data(self) -> int:
        return self.dp * self.fsdp

    @property
    def num_devices(self) -> int:
        return self.data * self.tp * self.cp * self.pp

    @property
    def mesh(self) -> MeshSpec:
        return MeshSpec.of(DEVICE_ORDER_TENSOR_INNER, stage=self.pp, data=self.dp, fsdp=self.fsdp, tensor=self.tp,
                           context=self.cp)

    @property
    def kind(self) -> str:
        base = "FSDP" if self.dp == 1 and self.fsdp > 1 else "HSDP" if self.fsdp > 1 else "DP"
        return (base + (f"+TP{self.tp}" if self.tp > 1 else "") + ("+SP" if self.sequence_parallel else "")
                + (f"+CP{self.cp}" if self.cp > 1 else "") + (f"+PP{self.pp}" if self.pp > 1 else ""))

    def __str__(self) -> str:
        dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "fp8": "fp8"}[self.precision]
        stages = (f" pp={self.pp}{' 1f1b' if self.schedule == '1f1b' else ''}"
                  f"{f' v={self.virtual_stages}' if self.virtual_stages > 1 else ''}"
                  f"{' weights-once' if self.weights_once else ''}" if self.pp > 1 else "")
        return (f"dp={self.dp}{' zero1' if self.sharded_optimizer else ''} fsdp={self.fsdp} tp={self.tp}"
                f"{' sp' if self.sequence_parallel else ''} cp={self.cp}{stages} remat={self.remat} "
                f"mb={self.micro_batches} {dtype}")


@dataclasses.dataclass(frozen=True)
class Rejected:
    candidate: Candidate
    reason: str


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_space(config, batch: BatchShape, num_devices: int, devices_per_node: int, attention: str,
                    precisions: tuple[str, ...] = PRECISIONS, sequence_parallel: tuple[bool, ...] = (False, True),
                    remats: tuple[str, ...] = REMATS, stages: tuple[int, ...] = (1,),
                    target: str = "gpu") -> tuple[list[Candidate], list[Rejected]]:
    """(buildable candidates, rejected ones with their reasons) over all `num_devices` devices;
    `sequence_parallel` the choices tried where there is tensor parallelism, `remats` the
    recomputation policies, `stages` the pipeline stage counts, `target` the compiler."""
    ok: list[Candidate] = []
    rejected: list[Rejected] = []
    from xlaopt.families import family_of

    row_lengths = [n for n in (batch.text_len, batch.gen_len) if n > 0]
    stacked = family_of(config).has_layer_stack
    tensor_dims = ({} if not stacked else
                   {"heads": config.num_heads, "kv_heads": config.num_kv_heads, "mlp": config.mlp_dim,
                    "vocab": config.vocab_size})
    for pp, tp, cp in _meshes(num_devices, devices_per_node, stages):
        data = num_devices // (pp * tp * cp)
        for fsdp in _divisors(data):
            base = Candidate(data // fsdp, fsdp, tp, cp, pp=pp)
            reason = (_structural_reason(base, config, batch, stacked, tensor_dims, row_lengths, attention)
                      or _pipeline_reason(base, config, batch, stacked))
            rows_per_rank = batch.batch_size // data if batch.batch_size % data == 0 else 0
            # A pipeline's micro-batches are multiples of its stages (each stage gets an equal share).
            micro = [pp * m for m in _divisors(max(rows_per_rank // pp, 1))
                     if m <= MAX_MICRO_BATCHES and rows_per_rank % (pp * m) == 0] or [pp]
            for sp in sequence_parallel if tp > 1 else (False,):
                split = reason or (_sequence_parallel_reason(base, row_lengths) if sp else "")
                for remat in remats:
                    for mb in micro:
                        for precision in precisions:
                            for once, zero1, (schedule, v) in itertools.product(
                                    (False, True) if pp > 1 and fsdp > 1 else (False,),
                                    (False, True) if base.dp > 1 else (False,), _schedules(config, pp, stacked)):
                                dtype, matmuls = _PRECISION[precision]
                                c = dataclasses.replace(base, remat=remat, micro_batches=mb, compute_dtype=dtype,
                                                        matmuls=matmuls, sequence_parallel=sp, weights_once=once,
                                                        sharded_optimizer=zero1, virtual_stages=v, schedule=schedule)
                                why = (split or _remat_reason(stacked, remat) or _fp8_reason(stacked, matmuls)
                                       or _pipeline_target_reason(c, target))
                                (rejected.append(Rejected(c, why)) if why else ok.append(c))
    return ok, rejected


def _meshes(num_devices: int, devices_per_node: int, stages: tuple[int, ...]):
    """(stages, tensor, context) sizes: tensor x context within a node, the rest data."""
    for pp in (p for p in stages if num_devices % p == 0):
        per_stage = num_devices // pp
        for tp in (t for t in _divisors(devices_per_node) if per_stage % t == 0):
            for cp in (c for c in _divisors(devices_per_node // tp) if per_stage % (tp * c) == 0):
                yield pp, tp, cp


def pipeline_stages(nodes: int) -> tuple[int, ...]:
    """The stage counts the planner tries by default: those that give each stage whole nodes.
    A stage hands on one activation a tick, point to point, which crosses the network well; the
    links inside a node are kept for tensor and context parallelism (Megatron's placement)."""
    return tuple(_divisors(nodes))


def _virtual_stages(config, pp: int, stacked: bool) -> list[int]:
    """The virtual stage counts tried on `pp` stages: those that cut a stage's layers evenly."""
    return virtual_stage_counts(config.num_layers, pp, MAX_VIRTUAL_STAGES) if pp > 1 and stacked else [1]


def _schedules(config, pp: int, stacked: bool) -> list[tuple[str, int]]:
    """(schedule, virtual stages) tried on `pp` stages: GPipe over each virtual stage count, and
    1F1B over each (interleaved 1F1B where more than one) where the family's loss can run inside
    the layer stack."""
    from xlaopt.families import family_of

    counts = _virtual_stages(config, pp, stacked)
    one_f_one_b = pp > 1 and stacked and family_of(config).loss_in_stack
    return [("gpipe", v) for v in counts] + ([("1f1b", v) for v in counts] if one_f_one_b else [])


def _pipeline_reason(c: Candidate, config, batch: BatchShape, stacked: bool) -> str:
    """Why a candidate with stages cannot be built (`TrainProgram._check_pipeline`), or ''."""
    if c.pp == 1:
        return ""
    if not stacked:
        return "a CNN has no layer stack to cut into pipeline stages"
    layers = config.num_layers
    if layers % c.pp:
        fits = ", ".join(str(d) for d in _divisors(layers) if d > 1)
        return f"{c.pp} pipeline stages do not divide the model's {layers} layers ({fits} do)"
    rows = batch.batch_size // c.data
    if rows % c.pp:
        return f"{rows} rows per data rank do not split into {c.pp} pipeline micro-batches (or a multiple)"
    return ""


def _pipeline_target_reason(c: Candidate, target: str) -> str:
    if c.pp > 1 and target == "cpu" and c.compute_dtype == "bfloat16":
        return "a pipeline in bfloat16 aborts XLA:CPU's compile on jax 0.10.2 (the GPU target builds it)"
    return ""


def _structural_reason(c: Candidate, config, batch: BatchShape, stacked: bool, tensor_dims: dict,
                       row_lengths: list, attention: str) -> str:
    """Why the candidate cannot be built at all, or ''."""
    if batch.batch_size % c.data:
        return f"the global batch of {batch.batch_size} rows does not split over {c.data} data ranks"
    if not stacked:
        return _conv_reason(c, config)
    bad = [f"{name} {n}" for name, n in tensor_dims.items() if n % c.tp]
    if bad:
        return f"tensor={c.tp} does not divide {', '.join(bad)}"
    if config.d_model % c.fsdp:
        return f"fsdp={c.fsdp} does not divide d_model {config.d_model}"
    if c.cp > 1:
        if attention == "cudnn" and ulysses_split(config.num_heads, config.num_kv_heads, c.tp, c.cp) is None:
            return (f"context parallel reaches cuDNN's attention only through Ulysses, which needs the "
                    f"{config.num_heads // c.tp} query heads of each tensor rank to split over context={c.cp}")
        if any(n % c.cp for n in row_lengths):
            return f"context={c.cp} does not divide the row's {' + '.join(map(str, row_lengths))} tokens"
    return ""


def _sequence_parallel_reason(c: Candidate, row_lengths: list) -> str:
    """Sequence parallelism splits a row's tokens over context x tensor ranks: each part must."""
    ways = c.cp * c.tp
    if any(n % ways for n in row_lengths):
        return (f"sequence parallel: context x tensor = {ways} does not divide the row's "
                f"{' + '.join(map(str, row_lengths))} tokens")
    return ""


def _remat_reason(stacked: bool, remat: str) -> str:
    return "a CNN has no layer stack to recompute" if not stacked and remat != "none" else ""


def _fp8_reason(stacked: bool, matmuls: str) -> str:
    return "a CNN's convolutions have no fp8 path" if not stacked and matmuls == "fp8" else ""


def _conv_reason(c: Candidate, config) -> str:
    """A CNN here is data parallel, its parameters at most FSDP-sharded along their output channels."""
    if c.tp > 1 or c.cp > 1:
        return "a CNN has no heads, MLP or sequence to split: the rule table maps its channels to fsdp only"
    if config.width % c.fsdp:
        return f"fsdp={c.fsdp} does not divide the first stage's {config.width} channels"
    return ""
