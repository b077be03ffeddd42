"""Pipeline parallelism: the layer stack cut into stages over the mesh axis `stage`.

An SPMD pipeline (one program on every device, as GSPMD partitions the rest), in a shard_map
manual over `stage`, over `data` where it splits the rows, and over the axis an attention wrapper
gathers the sequence over (Ulysses' `context`), so FSDP, tensor and the rest stay automatic and
compose inside each stage. The ranks of data and context all hold whole weights: manual over
them, each sums its weight gradients over the ticks and they are reduced once a step (automatic,
the partitioner reduced them at every tick). The stacked parameters' `layers` axis is split over `stage` by the rule table
(device p holds layers [p*k, (p+1)*k)), so the parameter tree, a checkpoint and a layout file
are those of every other strategy.

The rows entering the stack are cut into M micro-batches. At tick t, stage p runs its k layers
on micro-batch t - p and hands the result to stage p + 1 with one `ppermute`; stage 0 reads
micro-batch t from the stack's input and the last stage writes micro-batch t - (P - 1) to the
output. A reduce-scatter over `stage` then hands each stage M / P micro-batches of the output,
and which rows form a micro-batch is chosen so that these are exactly the rows the rule table
gives that stage (`batch` splits rows over data, FSDP and then stage): the final norm, the head
and the loss run split over the stages like data parallelism, not on one stage for all rows.

With V virtual stages (MaxText's circular pipeline) the layers are cut into P * V chunks of
L / (P * V), chunk v * P + p on stage p, and a micro-batch goes round the ring of stages V times:
at tick t stage p runs chunk v of its own on micro-batch m, where t - p = v * M + m. The last
stage hands each round's result back to stage 0, which keeps it until that micro-batch's next
round (M >= P ticks later). V * M + P - 1 ticks of 1 / V of a stage's layers: the bubble is V
times smaller than GPipe's, for one more send a tick (P - 1 to 0) and the stacked weights
reordered into chunk order once a step (the rule table keeps each stage's contiguous layers).

The backward pass is JAX's transpose of the tick loop: every forward tick, then every backward
tick in reverse (GPipe's schedule, `PipelineSchedule`). Stage ticks outside a micro-batch's
window (the bubble) compute on a stand-in whose result is never written.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from xlaopt.mesh import DATA, STAGE
from xlaopt.models.attention import attention_sequence_axis
from xlaopt.models.layers import batch_mesh_axes, manual_axes, manual_over, rows_split_over

SCHEDULES = ("gpipe", "1f1b")  # 1f1b: `xlaopt.models.pipeline_1f1b`; over virtual stages, interleaved 1F1B
# Schedules of the published runs this SPMD loop cannot run yet.
NOT_BUILT = {"zero-bubble": "split backward passes"}
# Names the published runs give schedules this loop runs under another name.
ALIASES = {"interleaved": "pipeline_schedule=1f1b with pipeline_virtual_stages=2 or more (interleaved 1F1B)"}


# The name scope of each of 1F1B's conditional branches (`xlaopt.models.pipeline_1f1b`), by which
# the simulator picks, tick by tick, the branch some stage takes (`PipelineSchedule.taken_at`).
BRANCH_SCOPE = "pipeline_{}"


def check_schedule(name: str) -> None:
    """A ValueError naming what is built where `name` is not a schedule this loop runs."""
    if name in ALIASES:
        raise ValueError(f"pipeline schedule {name!r}: set {ALIASES[name]}")
    if name in NOT_BUILT:
        raise ValueError(f"pipeline schedule {name!r} ({NOT_BUILT[name]}) is not built yet; xlaopt's pipeline runs "
                         f"{', '.join(SCHEDULES)}")
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)} (not built yet: "
                         f"{', '.join(NOT_BUILT)})")


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """Which micro-batch each stage runs at each tick, and what that costs. GPipe: micro-batch
    m runs on stage p at forward tick m + p; the backward ticks mirror the forward ones. With
    V virtual stages, round v of micro-batch m runs on stage p at tick v * M + m + p. 1F1B: a
    tick runs a forward and a backward, micro-batch m's forward on stage p at tick m + p and its
    backward at tick m + 2P - 2 - p. Interleaved 1F1B (1F1B over V virtual stages): groups of P
    micro-batches go round the ring V times, one chunk a tick (`unit`), so the last stage's
    result reaches stage 0 just as its next round starts; the backward follows the same units in
    reverse chunk order, VP + P - 2 - p ticks behind (`backward_lag`)."""
    stages: int
    microbatches: int
    name: str = "gpipe"
    virtual_stages: int = 1

    def __post_init__(self):
        check_schedule(self.name)
        if self.stages < 1 or self.microbatches < self.stages or self.microbatches % self.stages:
            raise ValueError(f"{self.microbatches} micro-batches over {self.stages} stages: the count must be a "
                             f"multiple of the stages (each stage receives an equal share of the output)")
        if self.virtual_stages < 1:
            raise ValueError(f"{self.virtual_stages} virtual stages: at least 1")

    @property
    def ticks(self) -> int:
        """GPipe: forward ticks (the backward has as many), each 1 / V of a stage's layers.
        1F1B: ticks of a forward and a backward each."""
        if self.name == "1f1b":
            return self.virtual_stages * self.microbatches + self.backward_lag(0)
        return self.virtual_stages * self.microbatches + self.stages - 1

    def unit(self, i):
        """1F1B: (micro-batch, chunk round) of a stage's i-th forward (i = tick - stage) or, with
        the round counted from the last, its i-th backward (i = tick - `backward_lag`). Works on
        ints and on traced integers alike."""
        P, PV = self.stages, self.stages * self.virtual_stages
        return i // PV * P + i % P, i % PV // P

    def backward_unit(self, i):
        """1F1B: (micro-batch, round, the forward unit that kept its residuals) of a stage's i-th
        backward (i = tick - `backward_lag`); ints or traced integers."""
        P, PV = self.stages, self.stages * self.virtual_stages
        m, back = self.unit(i)
        v = self.virtual_stages - 1 - back
        return m, v, i - i % PV + v * P + i % P

    def backward_lag(self, stage):
        """1F1B: the ticks by which `stage`'s backward units trail its forward ones' ticks (its
        forward unit i runs at tick i + stage): the last stage runs a micro-batch's last-round
        forward, the tail and that chunk's backward in one tick."""
        return self.virtual_stages * self.stages + self.stages - 2 - stage

    def forward_at(self, stage: int, tick: int) -> tuple[int, int] | None:
        """1F1B: (micro-batch, round) whose forward `stage` runs at `tick`, None where none."""
        i = tick - stage
        return self.unit(i) if 0 <= i < self.virtual_stages * self.microbatches else None

    def backward_at(self, stage: int, tick: int) -> tuple[int, int] | None:
        """1F1B: (micro-batch, round) whose backward `stage` runs at `tick`, None where none."""
        i = tick - self.backward_lag(stage)
        return self.backward_unit(i)[:2] if 0 <= i < self.virtual_stages * self.microbatches else None

    def work_at(self, stage: int, tick: int) -> tuple[int, int] | None:
        """(micro-batch, round) `stage` runs at forward `tick`, None in the bubble."""
        i = tick - stage
        return divmod(i, self.microbatches)[::-1] if 0 <= i < self.virtual_stages * self.microbatches else None

    def microbatch_at(self, stage: int, tick: int) -> int | None:
        """The micro-batch `stage` runs at forward `tick`, None in the bubble."""
        work = self.work_at(stage, tick)
        return None if work is None else work[0]

    def taken_at(self, tick: int) -> dict[str, bool]:
        """1F1B: whether any stage runs a forward, the tail (the loss, on the last stage, after a
        micro-batch's last round) and a backward at `tick`. In lockstep a tick lasts as long as
        its busiest stage: the first VP - 1 ticks run forwards alone, the last VP - 1 backwards
        alone (P - 1 each without virtual stages)."""
        P, V, units = self.stages, self.virtual_stages, self.virtual_stages * self.microbatches
        last = self.forward_at(P - 1, tick)
        return {"forward": tick < units + P - 1, "tail": last is not None and last[1] == V - 1,
                "backward": tick >= self.backward_lag(P - 1)}

    def branches_taken(self) -> dict[str, Callable[[int], bool]]:
        """For the simulator (`build_schedule`'s `branch_taken`): the name scope of each of
        1F1B's branches, and whether some stage takes it at a tick. GPipe has no branches."""
        if self.name != "1f1b":
            return {}
        return {BRANCH_SCOPE.format(part): (lambda tick, part=part: self.taken_at(tick)[part])
                for part in ("forward", "tail", "backward")}

    @property
    def bubble_fraction(self) -> float:
        """The share of each device's time that runs no micro-batch: (P - 1) / (V M + P - 1).
        1F1B's is GPipe's: its first VP - 1 ticks run forwards alone and its last VP - 1
        backwards alone, so (V M + P - 1) (F + B) / V in all."""
        return (self.stages - 1) / (self.virtual_stages * self.microbatches + self.stages - 1)

    @property
    def saved_ticks(self) -> int:
        """Ticks whose activations a stage holds at most: GPipe, every forward tick at the turn
        from forward to backward, the bubble's included (it holds all M micro-batches; this SPMD
        loop also saves what its bubble ticks computed). 1F1B: the slots of its ring, a tick's
        chunk each. Stage 0 keeps a micro-batch's first round from its forward to its backward
        2VP - 2 ticks later, so 2VP - 1 slots (2P - 1 micro-batches without virtual stages); the
        most held at once over virtual stages is (V + 1) P - 1."""
        if self.name == "1f1b":
            return min(self.virtual_stages * self.microbatches, 2 * self.virtual_stages * self.stages - 1)
        return self.ticks

    def check_layers(self, layers: int) -> None:
        """A ValueError naming the virtual stage counts that work where `layers` do not cut into
        stages x virtual stages equal chunks."""
        if layers % (self.stages * self.virtual_stages):
            works = virtual_stage_counts(layers, self.stages)
            raise ValueError(f"{self.virtual_stages} virtual stages do not divide each of the {self.stages} stages' "
                             f"{layers / self.stages:g} layers into equal chunks; use "
                             f"{', '.join(map(str, works))}")


def virtual_stage_counts(layers: int, stages: int, most: int | None = None) -> list[int]:
    """The virtual stage counts (up to `most`) that cut each of `stages` stages' layers into equal
    chunks: 1 alone where the stages themselves do not divide the layers."""
    if layers % stages:
        return [1]
    per_stage = layers // stages
    return [v for v in range(1, min(per_stage, most or per_stage) + 1) if per_stage % v == 0]


def stages_of_mesh() -> int:
    """The size of `stage` in the mesh installed while tracing (1 where there is none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(STAGE, 1)


def _micro_batching(carry, args, M: int, stages: int):
    """(data, seq, row_axes, split, merge): the axes the pipeline's shard_map takes manual beside
    `stage` (None where not), what splits a data rank's rows inside a stage, and the cut of the
    stack's inputs into M micro-batches and its inverse."""
    rows = {x.shape[0] for x in jax.tree.leaves((carry, args))}
    if len(rows) != 1:
        raise ValueError(f"pipeline: every input of the layer stack must lead with the batch's rows; got leading "
                         f"dimensions {sorted(rows)}")
    B = rows.pop()
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    # The data axis goes manual beside stage where it splits the rows (it splits no parameter):
    # each data rank then accumulates its weight gradients over the ticks and the shard_map's
    # transpose sums them over data once a step. Left to the partitioner, the gradients are
    # all-reduced over data inside the tick loop, once per tick.
    data = DATA if DATA in batch_mesh_axes() and DATA not in manual_axes() else None
    # So does the axis an attention wrapper gathers each sequence over (Ulysses' context): its
    # ranks hold whole weights too, and every op outside attention reads its own tokens alone.
    seq = attention_sequence_axis()
    seq = seq if seq and sizes.get(seq, 1) > 1 and seq not in manual_axes() else None
    row_axes = tuple(a for a in batch_mesh_axes() if a not in (STAGE, data, seq))
    D, local_B = math.prod(sizes[a] for a in row_axes), B // (sizes[data] if data else 1)
    if local_B % (M * D):
        raise ValueError(f"pipeline: {B} rows do not split into {M} micro-batches over {D} row shards")
    r = local_B // (M * D)

    def split(x):  # [B, ...] -> [M, B/M, ...]: micro-batch (s, q) is part q of stage s's rows of each row shard
        x = jnp.moveaxis(x.reshape(D, stages, M // stages, r, *x.shape[1:]), 0, 2)
        return x.reshape(M, D * r, *x.shape[4:])

    def merge(y):  # the inverse, each data rank's rows in turn: [data ranks, M, B/M, ...] -> [B, ...]
        y = jnp.moveaxis(y.reshape(y.shape[0], stages, M // stages, D, r, *y.shape[3:]), 3, 1)
        return y.reshape(B, *y.shape[5:])

    return data, seq, row_axes, split, merge


def _chunk_routes(stages: int, V: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each layer chunk goes when a stage's contiguous layers (chunks qV .. qV + V - 1 on
    stage q, as the rule table splits them) are reordered into its round order (chunk vP + p is
    stage p's v-th): `send[q, p, i]`, the local chunk stage q sends stage p as its i-th (-1:
    none), and `take[p, v]`, the (source stage, i) stage p's v-th chunk arrives as."""
    slots = -(-V // stages)
    send, take = np.full((stages, stages, slots), -1), np.zeros((stages, V, 2), int)
    for c in range(stages * V):
        (q, j), (v, p) = divmod(c, V), divmod(c, stages)
        i = int(np.sum(send[q, p] >= 0))
        send[q, p, i], take[p, v] = j, (q, i)
    return send, take


def _to_round_order(w, stages: int, V: int):
    """Inside the shard_map manual over `stage`: this stage's [V k, ...] contiguous layers -> its
    V chunks in round order. Each chunk moves once, point to point: one `ppermute` per (shift,
    slot) over the stages that have a chunk for it (a stage keeps its own chunks). Left to the
    partitioner the reorder is an all-to-all where V and P divide one another, and otherwise
    every stage gathers every stage's weights."""
    send, take = _chunk_routes(stages, V)
    stage = jax.lax.axis_index(STAGE)
    chunks = w.reshape(V, w.shape[0] // V, *w.shape[1:])
    received, where = [], np.zeros((stages, V), int)  # where[p, v]: the received buffer of p's v-th chunk
    for shift in range(stages):
        for slot in range(send.shape[2]):
            local = send[np.arange(stages), (np.arange(stages) + shift) % stages, slot]
            pairs = [(q, (q + shift) % stages) for q in range(stages) if local[q] >= 0]
            if not pairs:
                continue
            pick = chunks[jnp.asarray(np.maximum(local, 0))[stage]]
            received.append(pick if shift == 0 else jax.lax.ppermute(pick, STAGE, pairs))
            for p in range(stages):
                where[p][[v for v in range(V) if tuple(take[p, v]) == ((p - shift) % stages, slot)]] = len(received) - 1
    return jnp.stack(received)[jnp.asarray(where)[stage]].reshape(w.shape)


def pipeline_layers(layer_fn: Callable, params_L, carry, args: tuple, microbatches: int, inner: Callable,
                    gather: Callable | None = None, virtual_stages: int = 1):
    """The layers of `params_L` ([L, ...] leaves) over `carry`, pipelined over the mesh's stages
    in `microbatches` micro-batches (0: one per stage) and `virtual_stages` rounds of the ring;
    `inner(layer_fn, params_k, carry, args)` runs a stage's own k layers of one round;
    `gather(params_k) -> params_k`, where given, lays out a stage's weights once before the ticks
    (`StackSpec.weights_once`). One stage: `inner` over all layers, the same numbers."""
    stages = stages_of_mesh()
    if stages == 1:
        return inner(layer_fn, params_L, carry, args)
    schedule = PipelineSchedule(stages, microbatches or stages, virtual_stages=virtual_stages)
    M, V = schedule.microbatches, schedule.virtual_stages
    schedule.check_layers(jax.tree.leaves(params_L)[0].shape[0])
    data, seq, row_axes, split, merge = _micro_batching(carry, args, M, stages)
    manual = tuple(a for a in (STAGE, data, seq) if a)

    # A ring where rounds follow each other: the last stage's result goes back to stage 0.
    shift = [(p, (p + 1) % stages) for p in range(stages - (V == 1))]

    def local(params_k, carry, args):
        if gather is not None:
            params_k = gather(params_k)
        if V > 1:
            params_k = jax.tree.map(lambda w: _to_round_order(w, stages, V), params_k)
        params_Vk = jax.tree.map(lambda w: w.reshape(V, w.shape[0] // V, *w.shape[1:]), params_k)
        carry_M, args_M = jax.tree.map(split, carry), jax.tree.map(split, args)
        stage = jax.lax.axis_index(STAGE)
        first, last = stage == 0, stage == stages - 1
        take = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
        put = lambda tree, i, new, when: jax.tree.map(  # noqa: E731
            lambda o, n: o.at[i].set(jnp.where(when, n, o[i])), tree, new)

        def tick(state, t):
            handed, rounds, out = state
            i = jnp.clip(t - stage, 0, V * M - 1)  # this stage's work item, clamped in the bubble
            m, v = i % M, i // M
            fresh = take(carry_M, m)
            if V > 1:  # stage 0 keeps what the last stage finished a tick ago for its next round
                back = t - stages
                rounds = put(rounds, jnp.maximum(back, 0) % M, handed, (back >= 0) & (back < (V - 1) * M))
                fresh = jax.tree.map(lambda new, kept: jnp.where(v == 0, new, kept), fresh, take(rounds, m))
            x = jax.tree.map(lambda own, h: jnp.where(first, own, h), fresh, handed)
            y = inner(layer_fn, take(params_Vk, v) if V > 1 else params_k, x, take(args_M, m))
            done = t - (stages - 1)  # the work item the last stage finishes now, if any
            out = put(out, done % M, y, last & (done >= (V - 1) * M) & (done < V * M))
            return (jax.tree.map(lambda a: jax.lax.ppermute(a, STAGE, shift), y), rounds, out), None

        zeros = jax.tree.map(jnp.zeros_like, carry_M)
        empty = (take(zeros, 0), zeros if V > 1 else None, zeros)
        (_, _, out), _ = jax.lax.scan(tick, empty, jnp.arange(schedule.ticks))
        # Only the last stage wrote: the sum hands each stage its share of the micro-batches.
        return jax.tree.map(lambda o: jax.lax.psum_scatter(o, STAGE, scatter_dimension=0, tiled=True)[None], out)

    inputs = PartitionSpec(data, seq)  # every input leads with the rows, then the sequence
    with manual_over(manual_axes() + manual), rows_split_over(row_axes):
        # Unchecked, as the attentions' own shard_maps inside are: their custom VJPs know nothing
        # of varying axes. An input a manual axis does not split (the weights over data; the
        # stack's input, used on stage 0 only, over the stages) gets its cotangent summed over that
        # axis by the transpose, which the tests check.
        out = jax.shard_map(local, in_specs=(PartitionSpec(STAGE), inputs, inputs),
                            out_specs=PartitionSpec(data, STAGE, None, seq), axis_names=set(manual),
                            check_vma=False)(params_L, carry, args)
    return jax.tree.map(merge, out)
