"""The schedule read from compiled HLO: exact matmul FLOPs from shapes, loop bodies expanded by
trip count, async pairs and what runs between them, and the CPU-pipeline artefacts recognised."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from xlaopt.analysis import gpu_aot
from xlaopt.analysis.schedule import build_schedule
from xlaopt.analysis.simulate import compute_time_s, simulate
from xlaopt.analysis.topology import parse_topology

# A scheduled module in the syntax `compiled.as_text()` prints: operands without types, fused
# computations first, ENTRY last.
HLO = """HloModule jit_step, is_scheduled=true

%fused_dot (param_0: f32[64,128], param_1: f32[128,32]) -> f32[64,32] {
  %param_0 = f32[64,128]{1,0} parameter(0)
  %param_1 = f32[128,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], f32[64,128])) -> (s32[], f32[64,128]) {
  %p = (s32[], f32[64,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,128]{1,0} get-tuple-element(%p), index=1
  %w = f32[128,128]{1,0} constant({...})
  %d = f32[64,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[64,128]{1,0}) tuple(%i, %d)
}

%cond (p.1: (s32[], f32[64,128])) -> pred[] {
  %p.1 = (s32[], f32[64,128]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_rs (q: f32[64,128]) -> f32[32,128] {
  %q = f32[64,128]{1,0} parameter(0)
  ROOT %rs = f32[32,128]{1,0} reduce-scatter(%q), channel_id=3, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[64,128], w: f32[128,32], g: f32[32,128]) -> f32[64,32] {
  %x = f32[64,128]{1,0} parameter(0)
  %w = f32[128,32]{1,0} parameter(1)
  %g = f32[32,128]{1,0} parameter(2)
  %ag-start = (f32[32,128]{1,0}, f32[64,128]{1,0}) all-gather-start(%g), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %f = f32[64,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %ag-done = f32[64,128]{1,0} all-gather-done(%ag-start)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,128]{1,0}) tuple(%zero, %ag-done)
  %loop = (s32[], f32[64,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[64,128]{1,0} get-tuple-element(%loop), index=1
  %rs-start = ((f32[64,128]{1,0}), f32[32,128]{1,0}) async-start(%y), calls=%wrapped_rs
  %rs-done = f32[32,128]{1,0} async-done(%rs-start)
  %ar = f32[64,32]{1,0} all-reduce(%f), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  ROOT %out = f32[64,32]{1,0} add(%ar, %ar)
}
"""


def test_dot_flops_fusions_and_loops_from_shapes():
    s = build_schedule(HLO)
    by_name = {}
    for op in s.ops:
        by_name.setdefault(op.name, []).append(op)
    assert by_name["f"][0].flops == 2 * 64 * 32 * 128  # fusion: its fused dot
    assert by_name["f"][0].dtype == "tf32"  # f32 at default precision: TF32 tensor cores (below)
    assert len(by_name["d"]) == 3  # the while body, expanded by its trip count
    assert by_name["d"][0].flops == 2 * 64 * 128 * 128
    assert s.flops == 2 * 64 * 32 * 128 + 3 * 2 * 64 * 128 * 128
    (loop,) = s.loops
    first, end = loop["ops"]  # the entry-level loop's span of the expanded ops: its 3 bodies exactly
    assert {k: v for k, v in loop.items() if k != "ops"} == {"name": "loop", "computation": "main", "body": "body", "trip_count": 3, "known": True,
                    "given": False}
    assert [o.name for o in s.ops[first:end]] == [o.name for o in s.templates["body"]] * 3
    # The simulation times the loop on the compute stream: a loop of compute only, its ops' sum.
    h100 = parse_topology("h100:1x2")
    assert simulate(s, h100).loop_time_s == {"loop": pytest.approx(
        sum(compute_time_s(o, h100) for o in s.ops[first:end] if o.kind == "compute"))}
    # bytes: operands + result of the fusion
    assert by_name["f"][0].bytes == 4 * (64 * 128 + 128 * 32 + 64 * 32)


def test_collective_kinds_and_async_windows():
    s = build_schedule(HLO)
    kinds = [(op.name, op.kind) for op in s.ops if op.kind != "free" and op.kind != "compute"]
    assert kinds == [("ag-start", "collective-start"), ("ag-done", "collective-done"),
                     ("rs-start", "collective-start"), ("rs-done", "collective-done"), ("ar", "collective")]
    ag = next(op for op in s.ops if op.name == "ag-start").collective
    assert (ag.kind, ag.bytes, ag.replica_groups) == ("all-gather", 64 * 128 * 4, ((0, 1),))
    rs = next(op for op in s.ops if op.name == "rs-start").collective  # async-start wrapping reduce-scatter
    assert (rs.kind, rs.bytes) == ("reduce-scatter", 64 * 128 * 4)
    windows = {w["start"]: w for w in s.async_windows()}
    assert windows["ag-start"]["compute_ops_between"] == 1
    assert windows["ag-start"]["flops_between"] == 2 * 64 * 32 * 128
    assert windows["rs-start"]["ops_between"] == 0


CPU_ARTEFACTS = """HloModule m, is_scheduled=true

%widen (p0: f32[32,64]) -> f32[32,64] {
  %p0 = f32[32,64]{1,0} parameter(0)
  %c0 = bf16[32,64]{1,0} convert(%p0)
  ROOT %c1 = f32[32,64]{1,0} convert(%c0)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (w: f32[32,64], g: f32[256,64], i: s32[]) -> (f32[256,64], f32[32,64]) {
  %w = f32[32,64]{1,0} parameter(0)
  %g = f32[256,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %rt = f32[32,64]{1,0} fusion(%w), kind=kLoop, calls=%widen
  %ag = f32[256,64]{1,0} all-gather(%rt), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %ar = f32[256,64]{1,0} all-reduce(%g), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  %z = s32[] constant(0)
  %mine = f32[32,64]{1,0} dynamic-slice(%ar, %i, %z), dynamic_slice_sizes={32,64}
  ROOT %t = (f32[256,64]{1,0}, f32[32,64]{1,0}) tuple(%ag, %mine)
}
"""


def test_cpu_widening_and_all_reduce_plus_slice_are_recognised():
    ops = {op.name: op for op in build_schedule(CPU_ARTEFACTS).ops}
    assert ops["rt"].widening_roundtrip
    ag = ops["ag"].collective
    assert (ag.bytes, ag.narrow_bytes) == (256 * 64 * 4, 256 * 64 * 2)  # gathered value is bf16-exact
    ar = ops["ar"].collective
    assert ar.scattered_fraction == 1.0  # only this device's 1/8 is kept: a reduce-scatter
    assert ar.narrow_bytes == ar.bytes  # its operand is not a widened value


def test_exact_flops_of_a_compiled_dot():
    """The same count from XLA's own compiled text (CPU)."""
    f = jax.jit(lambda a, b: jnp.tanh(a @ b))
    text = f.lower(jax.ShapeDtypeStruct((96, 80), jnp.float32),
                   jax.ShapeDtypeStruct((80, 48), jnp.float32)).compile().as_text()
    s = build_schedule(text)
    assert s.flops == 2 * 96 * 48 * 80


def test_compiled_batched_dot_with_while_loop():
    def body(i, x):
        return jnp.einsum("bij,bjk->bik", x, x)

    f = jax.jit(lambda x: jax.lax.fori_loop(0, 4, body, x))
    text = f.lower(jax.ShapeDtypeStruct((3, 16, 16), jnp.float32)).compile().as_text()
    s = build_schedule(text)
    assert s.flops == pytest.approx(4 * 2 * 3 * 16 * 16 * 16)


def test_a_switch_under_a_rule_runs_branch_0_or_its_busiest_other_branch_at_each_trip():
    """A switch inside a loop under a `branch_taken` rule (1F1B's chunks: branch 0 runs nothing,
    branch c + 1 chunk c): at a trip the rule says runs nothing, branch 0; at the others, the
    branch of the most FLOPs (a dot chain of 1, 2 or 3 matmuls here), never the sum of them."""
    def body(i, x):
        with jax.named_scope("chunks"):
            return jax.lax.switch(i % 4, [lambda x: x] + [lambda x, n=n: _chain(x, n) for n in (1, 3, 2)], x)

    def _chain(x, n):
        for _ in range(n):
            x = jnp.tanh(x @ x)
        return x

    f = jax.jit(lambda x: jax.lax.fori_loop(0, 6, body, x))
    text = f.lower(jax.ShapeDtypeStruct((16, 16), jnp.float32)).compile().as_text()
    one = 2 * 16 ** 3
    taken = lambda t: t in (1, 2, 4)  # noqa: E731
    assert build_schedule(text, branch_taken={"chunks": taken}).flops == pytest.approx(3 * 3 * one)
    assert build_schedule(text, branch_taken={"chunks": lambda t: False}).flops == 0
    assert build_schedule(text).flops == pytest.approx(6 * 3 * one)  # no rule: the busiest at every trip


def test_async_combined_reduce_scatter_and_all_gather_bytes():
    """GPU async starts return ((operands...), (results...)); V is the whole arrays."""
    text = """HloModule m, is_scheduled=true

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

ENTRY %main (x: bf16[64,16], y: bf16[32,16], u: bf16[8,16], v: bf16[4,16]) -> bf16[8,16] {
  %x = bf16[64,16]{1,0} parameter(0)
  %y = bf16[32,16]{1,0} parameter(1)
  %u = bf16[8,16]{1,0} parameter(2)
  %v = bf16[4,16]{1,0} parameter(3)
  %rs = ((bf16[64,16]{1,0}, bf16[32,16]{1,0}), (bf16[8,16]{1,0}, bf16[4,16]{1,0})) reduce-scatter-start(%x, %y), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %rsd = (bf16[8,16]{1,0}, bf16[4,16]{1,0}) reduce-scatter-done(%rs)
  %ag = ((bf16[8,16]{1,0}, bf16[4,16]{1,0}), (bf16[64,16]{1,0}, bf16[32,16]{1,0})) all-gather-start(%u, %v), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  %agd = (bf16[64,16]{1,0}, bf16[32,16]{1,0}) all-gather-done(%ag)
  ROOT %r = bf16[8,16]{1,0} get-tuple-element(%rsd), index=0
}
"""
    ops = {op.name: op for op in build_schedule(text).ops}
    assert ops["rs"].collective.bytes == (64 + 32) * 16 * 2
    assert ops["ag"].collective.bytes == (64 + 32) * 16 * 2


def test_copies_and_point_to_point_transfers_get_their_own_kinds():
    """copy-start / copy-done (host memory is layout memory space S(5)) and send / recv with
    their dones, as XLA prints them; the sends' pairs come from their frontend attribute."""
    text = """HloModule m, is_scheduled=true

ENTRY %main (x: f32[8,16], t: token[]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %t = token[] parameter(1)
  %off = (f32[8,16]{1,0:S(5)}, f32[8,16]{1,0}, u32[]) copy-start(%x)
  %off-done = f32[8,16]{1,0:S(5)} copy-done(%off)
  %dup = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[]) copy-start(%x)
  %dup-done = f32[8,16]{1,0} copy-done(%dup)
  %recv = (f32[8,16]{1,0}, u32[], token[]) recv(%t), channel_id=1, frontend_attributes={_xla_send_recv_source_target_pairs="{{0,1},{1,2}}"}
  %send = (f32[8,16]{1,0}, u32[], token[]) send(%x, %t), channel_id=2, frontend_attributes={_xla_send_recv_source_target_pairs="{{0,1},{1,2}}"}
  %recv-done = (f32[8,16]{1,0}, token[]) recv-done(%recv), channel_id=1
  %send-done = token[] send-done(%send), channel_id=2
  ROOT %y = f32[8,16]{1,0} get-tuple-element(%recv-done), index=0
}
"""
    ops = {op.name: op for op in build_schedule(text).ops}
    assert {n: ops[n].kind for n in ("off", "off-done", "dup", "recv", "send", "recv-done", "send-done")} == {
        "off": "copy-start", "off-done": "copy-done", "dup": "copy-start", "recv": "recv", "send": "send",
        "recv-done": "recv-done", "send-done": "send-done"}
    assert ops["off"].bytes == ops["dup"].bytes == 8 * 16 * 4
    assert ops["off"].host_transfer and not ops["dup"].host_transfer
    for name in ("send", "recv"):
        info = ops[name].collective
        assert (info.kind, info.bytes, info.replica_groups) == (name, 8 * 16 * 4, ((0, 1), (1, 2)))


def test_compute_inside_an_async_collective_is_counted_between_its_start_and_done():
    from xlaopt.analysis.hlo import compute_inside_async

    text = """HloModule m

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %s = ((f32[4]{0}), f32[4]{0}) all-to-all-start(f32[4]{0} %p), replica_groups={{0,1}}
  %f = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%fused
  %d = f32[4]{0} all-to-all-done(((f32[4]{0}), f32[4]{0}) %s)
  %s2 = ((f32[4]{0}), f32[4]{0}) all-to-all-start(f32[4]{0} %f), replica_groups={{0,1}}
  %d2 = f32[4]{0} all-to-all-done(((f32[4]{0}), f32[4]{0}) %s2)
  ROOT %r = f32[4]{0} add(f32[4]{0} %d, f32[4]{0} %d2)
}
"""
    assert compute_inside_async(text, "all-to-all") == [1, 0]  # the fusion hides the first, nothing the second
    assert compute_inside_async(text, "all-gather") == []


# XLA's GPU pipeline turns a convolution and its two gradients into cuDNN custom calls that keep
# the forward's dim_labels (lines as a resnet50 gpu-aot compile prints them, backend configs cut).
CUDNN_CONVS = """HloModule jit_step, is_scheduled=true

ENTRY %main (x: bf16[8,32,32,16], w: bf16[32,3,3,16], dy: bf16[8,16,16,32]) -> bf16[8,32,32,16] {
  %x = bf16[8,32,32,16]{3,2,1,0} parameter(0)
  %w = bf16[32,3,3,16]{3,2,1,0} parameter(1)
  %dy = bf16[8,16,16,32]{3,2,1,0} parameter(2)
  %fwd = (bf16[8,16,16,32]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w), window={size=3x3 stride=2x2 pad=0_1x0_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward"
  %fused = (bf16[8,16,16,32]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w, %dy), window={size=3x3 stride=2x2 pad=0_1x0_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBiasActivationForward"
  %dx = (bf16[8,32,32,16]{3,2,1,0}, u8[0]{0}) custom-call(%dy, %w), window={size=3x3 stride=2x2 pad=0_1x0_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardInput"
  %dw = (bf16[32,3,3,16]{3,2,1,0}, u8[0]{0}) custom-call(%x, %dy), window={size=3x3 stride=2x2 pad=0_1x0_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardFilter"
  ROOT %out = bf16[8,32,32,16]{3,2,1,0} get-tuple-element(%dx), index=0
}
"""


def test_cudnn_convolutions_each_count_the_forward_flops():
    """2 x output pixels (8 x 16 x 16) x output channels (32) x kernel area x input channels (3 x 3 x 16)."""
    flops = {op.name: op.flops for op in build_schedule(CUDNN_CONVS).ops}
    forward = 2 * 8 * 16 * 16 * 32 * 3 * 3 * 16
    assert flops["fwd"] == flops["fused"] == flops["dx"] == flops["dw"] == forward


# A cuBLAS GEMM as jax 0.10.2's GPU compile emits it (`xla_gpu_enable_triton_gemm=false`), with its
# s8 workspace as the last element of its result, beside a cuDNN convolution's empty u8 one.
CUBLAS_GEMM = """HloModule jit_step, is_scheduled=true

ENTRY %main (x: bf16[64,128], w: bf16[128,32]) -> bf16[64,32] {
  %x = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,32]{1,0} parameter(1)
  %gemm = (bf16[64,32]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %out = bf16[64,32]{1,0} get-tuple-element(%gemm), index=0
}
"""


def test_a_library_calls_workspace_is_not_counted_as_bytes_it_moves():
    (gemm,) = [op for op in build_schedule(CUBLAS_GEMM).ops if op.name == "gemm"]
    assert gemm.matmuls == (2 * 64 * 32 * 128,)
    assert gemm.bytes == 2 * (64 * 128 + 128 * 32 + 64 * 32)  # its operands and result, not its 4 MiB of scratch
    ops = {op.name: op for op in build_schedule(CUDNN_CONVS).ops}
    assert ops["fwd"].bytes == 2 * (8 * 32 * 32 * 16 + 32 * 3 * 3 * 16 + 8 * 16 * 16 * 32)


# A loop carrying a cache in a transposed layout reads and updates it through a bitcast (as a
# gpu-aot decode step's V cache does): the bitcast moves no bytes, the slice and update are all.
BITCAST_CACHE = """HloModule jit_step, is_scheduled=true

%fused_read (param_0: bf16[80,8,128], param_1: s32[]) -> bf16[1,8,128] {
  %param_0 = bf16[80,8,128]{1,2,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %b = bf16[80,128,8]{2,1,0} bitcast(%param_0)
  %z = s32[] constant(0)
  %ds = bf16[1,128,8]{2,1,0} dynamic-slice(%b, %param_1, %z, %z), dynamic_slice_sizes={1,128,8}
  ROOT %r = bf16[1,8,128]{1,2,0} bitcast(%ds)
}

%fused_write (param_0: bf16[80,8,128], param_1: bf16[1,128,8], param_2: s32[]) -> bf16[80,128,8] {
  %param_0 = bf16[80,8,128]{1,2,0} parameter(0)
  %param_1 = bf16[1,128,8]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %b = bf16[80,128,8]{2,1,0} bitcast(%param_0)
  %z = s32[] constant(0)
  ROOT %dus = bf16[80,128,8]{2,1,0} dynamic-update-slice(%b, %param_1, %param_2, %z, %z)
}

ENTRY %main (c: bf16[80,8,128], u: bf16[1,128,8], i: s32[]) -> bf16[80,128,8] {
  %c = bf16[80,8,128]{1,2,0} parameter(0)
  %u = bf16[1,128,8]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %read = bf16[1,8,128]{1,2,0} fusion(%c, %i), kind=kLoop, calls=%fused_read
  ROOT %write = bf16[80,128,8]{2,1,0} fusion(%c, %u, %i), kind=kLoop, calls=%fused_write
}
"""


def test_a_cache_read_and_updated_through_a_bitcast_counts_the_slice_only():
    ops = {op.name: op for op in build_schedule(BITCAST_CACHE).ops}
    layer = 8 * 128 * 2  # one layer's slice of the cache, bf16
    assert ops["read"].bytes == 2 * layer + 4  # the slice read and written, and the index
    assert ops["write"].bytes == 2 * layer + 4  # the update read and written in place, and the index


def test_a_slice_added_to_and_written_back_in_place_counts_the_slice_not_the_buffer():
    """XLA's in-place `d[i] += g` (a one-index scatter-add's fusion): the buffer is read through
    its slice and updated in place, so the fusion moves the slice read, the update read and the
    slice written, not the whole buffer (here 80 slices)."""
    text = BITCAST_CACHE.replace("""  ROOT %dus = bf16[80,128,8]{2,1,0} dynamic-update-slice(%b, %param_1, %param_2, %z, %z)""",
                                 """  %old = bf16[1,128,8]{2,1,0} dynamic-slice(%b, %param_2, %z, %z), dynamic_slice_sizes={1,128,8}
  %sum = bf16[1,128,8]{2,1,0} add(%old, %param_1)
  ROOT %dus = bf16[80,128,8]{2,1,0} dynamic-update-slice(%b, %sum, %param_2, %z, %z)""")
    assert text != BITCAST_CACHE
    write = next(op for op in build_schedule(text).ops if op.name == "write")
    layer = 8 * 128 * 2
    assert write.bytes == 3 * layer + 4  # the slice and the update read, the slice written, the index


def _updated_then(read_on: str, result: str) -> str:
    """BITCAST_CACHE with its write fusion's update read on by `read_on` (the fusion's result,
    shaped `result`) instead of being the result."""
    return (BITCAST_CACHE
            .replace("ROOT %dus = bf16[80,128,8]{2,1,0} dynamic-update-slice(%b, %param_1, %param_2, %z, %z)",
                     f"%dus = bf16[80,128,8]{{2,1,0}} dynamic-update-slice(%b, %param_1, %param_2, %z, %z)\n"
                     f"  ROOT %on = {result}{{2,1,0}} {read_on}")
            .replace("param_2: s32[]) -> bf16[80,128,8] {", f"param_2: s32[]) -> {result} {{")
            .replace("ROOT %write = bf16[80,128,8]{2,1,0} fusion", f"ROOT %write = {result}{{2,1,0}} fusion"))


def test_an_update_read_on_inside_its_fusion_is_read_as_it_is_read_on():
    """A dynamic-update-slice updates its buffer in place only as the fusion's result. Read on by
    an add inside the fusion (R11's gradient stack, its last layer's slice written in and the whole
    stack added to the accumulator), every element of the buffer is read; read on through a slice
    (1F1B's stage inputs), the slice is."""
    layer = 8 * 128 * 2
    added = _updated_then("add(%dus, %dus)", "bf16[80,128,8]")
    write = next(op for op in build_schedule(added).ops if op.name == "write")
    assert write.bytes == 80 * layer + layer + 80 * layer + 4  # the buffer and the update read, all written
    sliced = _updated_then("dynamic-slice(%dus, %param_2, %z, %z), dynamic_slice_sizes={1,128,8}", "bf16[1,128,8]")
    write = next(op for op in build_schedule(sliced).ops if op.name == "write")
    assert write.bytes == layer + layer + layer + 4  # a slice of the buffer and the update read, a slice written


# XLA's GPU pipeline peels a micro-batch scan's first iteration and leaves the rest without
# `known_trip_count`: the same loop as HLO's, counting up from 1 through fusions and copies.
_COUNTED = (HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
            .replace("%body (p:", """%fused_inc (q.0: s32[]) -> s32[] {
  %q.0 = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %next = s32[] add(%q.0, %one)
}

%fused_lt (q.1: s32[]) -> pred[] {
  %q.1 = s32[] parameter(0)
  %n.1 = s32[] constant(3)
  ROOT %lt.1 = pred[] compare(%q.1, %n.1), direction=LT
}

%body (p:""")
            .replace("ROOT %t = (s32[], f32[64,128]{1,0}) tuple(%i, %d)",
                     "%i.c = s32[] copy(%i)\n  %inc = s32[] fusion(%i.c), kind=kLoop, calls=%fused_inc\n"
                     "  ROOT %t = (s32[], f32[64,128]{1,0}) tuple(%inc, %d)")
            .replace("ROOT %lt = pred[] compare(%i.1, %n), direction=LT",
                     "ROOT %lt = pred[] fusion(%i.1), kind=kLoop, calls=%fused_lt")
            .replace("%zero = s32[] constant(0)", "%start = s32[] constant(1)\n  %zero = s32[] copy(%start)"))


def test_a_loop_without_xlas_trip_count_is_counted_from_its_start_bound_and_step():
    s = build_schedule(_COUNTED)
    assert [{k: v for k, v in loop.items() if k != "ops"} for loop in s.loops] == [
        {"name": "loop", "computation": "main", "body": "body", "trip_count": 2, "known": True, "given": False}]
    assert s.flops == 2 * 64 * 32 * 128 + 2 * 2 * 64 * 128 * 128
    # A body that does not step its counter: nothing to count by, so the loop stays unknown (once).
    still = build_schedule(_COUNTED.replace("tuple(%inc, %d)", "tuple(%i, %d)"))
    assert [(loop["trip_count"], loop["known"]) for loop in still.loops] == [(1, False)]


def _one_dot(operands: str, attrs: str = "") -> str:
    return f"""HloModule m

ENTRY %main (x: {operands}[256,512], w: {operands}[512,128]) -> f32[256,128] {{
  %x = {operands}[256,512]{{1,0}} parameter(0)
  %w = {operands}[512,128]{{1,0}} parameter(1)
  ROOT %d = f32[256,128]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}{attrs}
}}
"""


def test_an_f32_matmul_at_default_precision_is_priced_at_the_tf32_peak():
    h100 = parse_topology("h100:1x8")
    cases = {"tf32": _one_dot("f32"), "f32": _one_dot("f32", ", operand_precision={highest,highest}"),
             "bf16": _one_dot("bf16")}
    for expected, text in cases.items():
        (op,) = [o for o in build_schedule(text).ops if o.matmuls]
        assert op.dtype == expected
    tf32, f32, bf16 = ([o for o in build_schedule(t).ops if o.matmuls][0] for t in cases.values())
    big = lambda op: dataclasses.replace(op, matmuls=(1e15,), flops=1e15)  # noqa: E731 (compute-bound)
    times = [compute_time_s(big(op), h100) for op in (tf32, f32, bf16)]
    peaks = h100.device.peak_flops
    assert times[0] / times[2] == pytest.approx(peaks["bfloat16"] / peaks["tfloat32"], rel=1e-3)  # 2x
    assert times[1] / times[0] == pytest.approx(peaks["tfloat32"] / peaks["float32"], rel=1e-3)
    # A device without TF32 (the simulated CPU's) runs it at its f32 peak.
    cpu = parse_topology("cpu:1x8")
    assert compute_time_s(big(tf32), cpu) == compute_time_s(big(f32), cpu)


@pytest.mark.skipif(not gpu_aot.available(), reason="needs the gpu-aot extra (jax-cuda12-plugin)")
def test_jaxs_gpu_compiler_runs_an_f32_matmul_in_tf32_unless_asked_for_highest(tmp_path):
    """The fact the pricing above rests on, from the installed compiler's own PTX: a default f32
    dot's kernel uses TF32 tensor-core instructions, a HIGHEST one f32 FMAs and none."""
    import subprocess
    import sys
    import textwrap

    from conftest import command_env

    script = textwrap.dedent("""
        import sys, jax, jax.numpy as jnp
        from jax.sharding import PartitionSpec as P, NamedSharding
        from xlaopt.analysis import gpu_aot
        from xlaopt.analysis.topology import parse_topology
        mesh = gpu_aot.gpu_mesh(parse_topology("h100:1x8"), (1,), ("x",))
        a = jax.ShapeDtypeStruct((2048, 2048), jnp.float32, sharding=NamedSharding(mesh, P()))
        precision = None if sys.argv[1] == "default" else jax.lax.Precision.HIGHEST
        jax.jit(lambda x, y: jnp.dot(x, y, precision=precision)).lower(a, a).compile()
    """)
    ptx = {}
    for precision in ("default", "highest"):
        dump = tmp_path / precision
        env = dict(command_env(), XLA_FLAGS=f"--xla_dump_to={dump}", JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, "-c", script, precision], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        ptx[precision] = "".join(p.read_text() for p in dump.glob("*.ptx"))
    assert "mma.sync.aligned" in ptx["default"] and ".tf32.tf32" in ptx["default"]
    assert "mma" not in ptx["highest"] and "fma.rn.f32" in ptx["highest"]
