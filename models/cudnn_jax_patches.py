"""What jax 0.10.2's cuDNN attention needs to compile deviceless, and to be right under GQA.

`jax._src.cudnn.fused_attention_stablehlo` (the packed, per-segment API `cudnn_attention` uses)
has four module functions that stand in the way on this jax version:
  check_cudnn_version            asks the host's cuDNN library (none on a build machine: "cuDNN
                                 not found"); falls back to the version the plugin was built with;
  check_compute_capability,      ask the *default* backend's first GPU (the CPU on a deviceless
  is_cuda_compute_capability_equal  compile: always False, so packed rows are refused as "not
                                 Hopper"); answered from the devices of the mesh being traced for
                                 (an A100 target is still refused), and for shape-only traces
                                 with no mesh as a Hopper would answer;
  _fix_seqlen_offsets            scales the key offsets by the *query* head count, silently wrong
                                 under grouped-query attention (fixed upstream after 0.10.2, jax
                                 PR #39521); its key offsets are rescaled to the key head count.
Each patch only answers where the original could not: with a live GPU backend the originals
decide. The first three are read at trace time, the fourth at lowering time (by the primitives'
lowering of forward and backward alike), so they are installed once for the process, not
around one call. tests/test_cudnn_attention.py checks these functions exist on the installed
jax and the offset arithmetic; a jax upgrade is refused here until this file is revisited.
"""
from __future__ import annotations

import functools

import jax

from xlaopt.errors import UserError

JAX_VERSION = "0.10.2"
PATCHED = ("check_cudnn_version", "check_compute_capability", "is_cuda_compute_capability_equal",
           "_fix_seqlen_offsets")


def _module():
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


def _target_capability() -> tuple[int, int] | None:
    """The compute capability of the GPUs of the mesh being traced for (compile-only devices
    included), or None when there is no such mesh."""
    from jax._src.mesh import get_concrete_mesh

    mesh = get_concrete_mesh()
    devices = getattr(mesh, "devices", None)
    if devices is None or not devices.size:
        return None
    capability = getattr(devices.flat[0], "compute_capability", None)
    return tuple(int(x) for x in capability.split(".")) if capability else None


def _host_has_gpu() -> bool:
    from jax._src import xla_bridge

    return "cuda" in xla_bridge.get_backend().platform_version


def _compared(original, compare, unknown: bool):
    """With a GPU backend, the original decides. Without one: the traced-for mesh's GPUs decide;
    a trace for no device (eval_shape, init, whose attention outputs are never used) gets
    `unknown`, and the compile for a real target is checked again against its devices."""
    @functools.wraps(original)
    def patched(capability: str) -> bool:
        if _host_has_gpu():
            return original(capability)
        target = _target_capability()
        if target is None:
            return unknown
        return compare(target, tuple(int(x) for x in capability.split(".")))

    return patched


def _cudnn_version(original):
    @functools.wraps(original)
    def patched() -> int:
        try:
            return original()
        except RuntimeError:  # no cuDNN library on this host: the one the plugin was built against
            from jax._src.lib import cuda_versions

            return cuda_versions.cudnn_build_version()

    return patched


def _kv_offsets_per_key_head(original):
    @functools.wraps(original)
    def patched(q_seqlen, kv_seqlen, q_offsets, kv_offsets, query, key):
        q_seqlen, kv_seqlen, q_offsets, fixed = original(q_seqlen, kv_seqlen, q_offsets, kv_offsets, query, key)
        heads_q, heads_kv = query.shape[2], key.shape[2]
        if fixed is kv_offsets or heads_q == heads_kv:  # not packed (returned as given), or no GQA
            return q_seqlen, kv_seqlen, q_offsets, fixed
        return q_seqlen, kv_seqlen, q_offsets, (fixed // heads_q) * heads_kv  # exact: it multiplied by heads_q

    return patched


def install() -> None:
    """Patch the four functions once per process (see the module docstring), after checking that
    they are there to patch."""
    if jax.__version__ != JAX_VERSION:
        raise UserError(f"attention=cudnn's workarounds (xlaopt/models/cudnn_jax_patches.py) are written for jax "
                        f"{JAX_VERSION}, not {jax.__version__}: check whether {', '.join(PATCHED)} still need them "
                        f"(the GQA offsets are fixed upstream after 0.10.2), or use attention=segment")
    from jax._src.lib import cuda_versions

    if cuda_versions is None:  # jaxlib without the CUDA plugin: nothing knows cuDNN here
        raise UserError("attention=cudnn needs JAX's CUDA plugin, for a deviceless compile too: "
                        "pip install -e '.[gpu-aot]' (or a CUDA jaxlib on a GPU machine), or use attention=segment")
    fa = _module()
    missing = [name for name in PATCHED if not hasattr(fa, name)]
    if missing:
        raise UserError(f"jax {jax.__version__} has no {', '.join(missing)} in {fa.__name__}; "
                        f"attention=cudnn cannot compile here: use attention=segment")
    _patch()


@functools.cache
def _patch() -> None:
    """Once: wrapping twice would rescale the key offsets twice."""
    fa = _module()
    fa.check_cudnn_version = _cudnn_version(fa.check_cudnn_version)
    fa.check_compute_capability = _compared(fa.check_compute_capability, lambda have, need: have >= need, True)
    fa.is_cuda_compute_capability_equal = _compared(fa.is_cuda_compute_capability_equal,
                                                    lambda have, need: have == need, False)
    fa._fix_seqlen_offsets = _kv_offsets_per_key_head(fa._fix_seqlen_offsets)
