"""Device meshes from `data=2,fsdp=2,tensor=2` specs, and simulated CPU device counts.

Every mesh carries all of MESH_AXES (size 1 where the spec omits an axis), so rule
tables and passes can name any axis without checking whether it exists.

Where the axes sit on the cluster is the spec's `order`: the axes from outermost to innermost
over the devices, which are numbered node-major (a node's devices are consecutive). The last
axes in the order vary fastest, so they stay inside a node: `order = (data, fsdp, context,
tensor)` keeps a tensor group of up to a node on the fast links and sends data parallel over
the network. The order does not change what is computed, only which device holds which shard:
`placement()` maps each logical mesh position (row-major over MESH_AXES, as the compiled HLO's
replica groups number them) to its device.
"""
from __future__ import annotations

import dataclasses
import math

from xlaopt.errors import UserError

# `stage` cuts the layer stack into pipeline stages (`xlaopt.models.pipeline`); first, so that a
# stage is the outermost block of devices by default, as in Megatron's rank order.
MESH_AXES = ("stage", "data", "fsdp", "tensor", "context")
STAGE = "stage"
DATA = "data"
# Megatron's rank order (tensor innermost, then context, then data, pipeline stages outermost),
# the one the analytic cost model assumes; the FSDP shard ranks sit inside the data replicas
# (HSDP's shard group inner).
DEVICE_ORDER_TENSOR_INNER = ("stage", "data", "fsdp", "context", "tensor")
# Beyond this many simulated CPU devices compile time and host memory stop being practical;
# larger meshes are analysed abstractly, not run.
MAX_SIMULATED_DEVICES = 512


class MeshError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Mesh axis sizes in the canonical order of MESH_AXES, and the axes' order over the devices
    (outermost first)."""
    sizes: tuple[int, ...] = (1,) * len(MESH_AXES)
    order: tuple[str, ...] = MESH_AXES

    def __post_init__(self):
        if STAGE not in self.order and len(self.order) == len(MESH_AXES) - 1:
            # An order written before pipeline stages existed: its stage axis (size 1) outermost.
            object.__setattr__(self, "order", (STAGE, *self.order))
        if len(self.sizes) != len(MESH_AXES) or any(s < 1 for s in self.sizes):
            raise MeshError(f"mesh sizes {self.sizes} must be {len(MESH_AXES)} positive ints for {MESH_AXES}")
        if sorted(self.order) != sorted(MESH_AXES):
            raise MeshError(f"mesh order {list(self.order)} must name each of {', '.join(MESH_AXES)} once "
                            f"(outermost first), e.g. {list(DEVICE_ORDER_TENSOR_INNER)}")
        object.__setattr__(self, "order", tuple(self.order))

    @classmethod
    def of(cls, order: tuple[str, ...] = MESH_AXES, **sizes: int) -> "MeshSpec":
        """A mesh from axis sizes by name (an axis left out has size 1)."""
        unknown = sorted(set(sizes) - set(MESH_AXES))
        if unknown:
            raise MeshError(f"unknown mesh axes {unknown}; axes are {', '.join(MESH_AXES)}")
        return cls(tuple(sizes.get(a, 1) for a in MESH_AXES), order)

    def with_order(self, order) -> "MeshSpec":
        return MeshSpec(self.sizes, tuple(order))

    def inside_manual(self, axes) -> "MeshSpec":
        """The mesh as an array inside a shard_map manual over `axes` sees it: each of those axes
        already split out of the array (size 1), the others as they are."""
        return MeshSpec(tuple(1 if a in axes else s for a, s in zip(MESH_AXES, self.sizes)), self.order)

    def placement(self) -> tuple[int, ...]:
        """Device index (node-major) of each logical mesh position, row-major over MESH_AXES."""
        import numpy as np

        slots = np.arange(self.num_devices).reshape([self.size(a) for a in self.order])
        return tuple(int(i) for i in slots.transpose([self.order.index(a) for a in MESH_AXES]).reshape(-1))

    @property
    def inner_axes(self) -> tuple[str, ...]:
        """The axes of size > 1, innermost first."""
        return tuple(a for a in reversed(self.order) if self.size(a) > 1)

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        sizes = dict.fromkeys(MESH_AXES, 1)
        seen = set()
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep:
                raise MeshError(f"mesh {text!r}: {part!r} is not axis=size; e.g. --mesh data=2,fsdp=2,tensor=2")
            if name not in sizes:
                raise MeshError(f"mesh {text!r}: unknown axis {name!r}; axes are {', '.join(MESH_AXES)}")
            if name in seen:
                raise MeshError(f"mesh {text!r}: axis {name!r} given twice")
            try:
                size = int(value)
            except ValueError:
                size = 0
            if size < 1:
                raise MeshError(f"mesh {text!r}: size of {name!r} must be a positive integer, got {value!r}")
            sizes[name] = size
            seen.add(name)
        return cls(tuple(sizes[a] for a in MESH_AXES))

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        return self.sizes[MESH_AXES.index(axis)]

    def as_dict(self) -> dict[str, int]:
        return dict(zip(MESH_AXES, self.sizes))

    def __str__(self) -> str:
        parts = [f"{a}={s}" for a, s in self.as_dict().items() if s > 1]
        text = ",".join(parts) or "single-device"
        split = [a for a in self.order if self.size(a) > 1]
        default = [a for a in MESH_AXES if self.size(a) > 1]
        return text if split == default else f"{text} (devices ordered {'>'.join(split)})"


def request_cpu_devices(count: int) -> None:
    """Ask for `count` simulated CPU devices; must run before JAX initialises its backends.

    If the backends are already up (a test harness that set XLA_FLAGS, a notebook), the
    existing devices are used and `make_mesh` reports a shortfall clearly.
    """
    if count > MAX_SIMULATED_DEVICES:
        raise MeshError(f"mesh needs {count} devices; at most {MAX_SIMULATED_DEVICES} simulated CPU devices "
                        f"are allowed. Use a smaller mesh, or price a larger one with `xlaopt analyze --target gpu` "
                        f"(no devices needed).")
    import jax
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # backends already initialised; make_mesh checks the count


def make_mesh(spec: MeshSpec):
    import jax

    devices = jax.devices()
    if spec.num_devices > len(devices):
        raise MeshError(f"mesh {spec} needs {spec.num_devices} devices but {jax.default_backend()} has "
                        f"{len(devices)}; use a mesh of at most {len(devices)} devices")
    return mesh_over(spec, devices[: spec.num_devices])


def mesh_over(spec: MeshSpec, devices):
    """A jax Mesh of `spec` over `devices` (node-major, len == spec.num_devices), placed by its order."""
    import jax
    import numpy as np
    from jax.sharding import AxisType

    placed = np.array(devices, dtype=object)[list(spec.placement())].reshape(spec.sizes)
    return jax.sharding.Mesh(placed, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
