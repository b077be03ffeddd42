"""Gradient synchronisation measured for real: a 2-process x 4-device `jax.distributed` CPU job
(gloo between the processes, each process one node), flat all-reduce against hierarchical-grads.

    python experiments/grad_sync.py [--model llama-tiny] [--steps 30] [--link GBIT] [--json out/grad_sync.json]

Both sides reduce the same data-parallel gradients of the model's parameters (fp32, each device
its own) over data=8:
  flat          one all-reduce over all 8 data ranks per parameter, as XLA's partitioner emits;
  hierarchical  `HierarchicalGradsTransform.reduce`, the pass's own code: reduce-scatter inside the
                process, all-reduce of a quarter across the processes, all-gather inside.
Each is one jitted function, timed per call (block until ready), median over `--steps` calls after
warm-up; the two alternate call by call so load on the machine falls on both. The whole train step
(the default pipeline with and without the pass) is timed the same way. Process 0 checks that both
reductions agree and writes the JSON (keys flat_ms, hierarchical_ms, steps, ...).

Where the processes meet: by default both on this machine's loopback, where gloo carries every
collective, inside a process as between them, at the same speed, so there is no slow level to
keep bytes off. `--link GBIT` (root, Linux `ip` and `tc`) puts process 1 in its own network
namespace joined to process 0's by a veth pair shaped to GBIT in each direction: two "hosts" whose
own devices still talk over their loopback, and whose link is the slow level. Each process's gloo
then advertises its veth address (JAX's gloo factory takes a hostname; the worker passes it), and
the coordinator binds only process 0's veth address. The namespace is removed afterwards.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

PROCESSES, LOCAL_DEVICES = 2, 4
TIMEOUT_S = 1200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NETNS, HOSTS = "xlaopt-gs1", ("10.77.0.1", "10.77.0.2")


def _shaped_link(gbit: float) -> None:
    """Process 1's network namespace and a veth pair shaped to `gbit` both ways (see the docstring)."""
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    _remove_link()
    run("ip", "netns", "add", NETNS)
    run("ip", "link", "add", "xgs0", "type", "veth", "peer", "name", "xgs1")
    run("ip", "link", "set", "xgs1", "netns", NETNS)
    run("ip", "addr", "add", f"{HOSTS[0]}/24", "dev", "xgs0")
    run("ip", "link", "set", "xgs0", "up")
    inside = ("ip", "netns", "exec", NETNS)
    run(*inside, "ip", "addr", "add", f"{HOSTS[1]}/24", "dev", "xgs1")
    run(*inside, "ip", "link", "set", "xgs1", "up")
    run(*inside, "ip", "link", "set", "lo", "up")
    for prefix, dev in (((), "xgs0"), (inside, "xgs1")):
        run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit", "burst", "256kb",
            "latency", "50ms")


def _remove_link() -> None:
    subprocess.run(["ip", "link", "del", "xgs0"], capture_output=True)
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)


def launch(args) -> int:
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}")
    if args.link:
        _shaped_link(args.link)
    prefix = lambda i: ["ip", "netns", "exec", NETNS] if args.link and i == 1 else []  # noqa: E731
    host = lambda i: HOSTS[i] if args.link else "127.0.0.1"  # noqa: E731
    procs = [subprocess.Popen(prefix(i) + [sys.executable, __file__, "--worker", str(i), "--port", str(port),
                                           "--host", host(i), "--coordinator-host", host(0), "--link", str(args.link),
                                           "--model", args.model, "--steps", str(args.steps), "--json", args.json or ""],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(PROCESSES)]
    failed = False
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=TIMEOUT_S)
            if i == 0:
                print(out, end="")
            if p.returncode:
                failed = True
                print(f"process {i} exited {p.returncode}:\n{err[-3000:]}", file=sys.stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if args.link:
            _remove_link()
    return 1 if failed else 0


def _median_ms(fns: dict, steps: int) -> dict:
    for fn in fns.values():  # compile and warm up
        fn()
        fn()
    times = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - t))
    return {name: statistics.median(ts) for name, ts in times.items()}


def worker(args) -> None:
    import functools

    import jax
    from jax._src import xla_bridge

    # gloo advertises this process's address (its default, the hostname, is loopback here).
    xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(xla_bridge._jax.make_gloo_tcp_collectives,
                                                                   hostname=args.host)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    coordinator = f"{args.coordinator_host}:{args.port}"
    jax.distributed.initialize(coordinator, num_processes=PROCESSES, process_id=args.worker,
                               coordinator_bind_address=coordinator, initialization_timeout=120)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from xlaopt.compile import compile_program
    from xlaopt.data.batch import BatchShape
    from xlaopt.families import family_of
    from xlaopt.mesh import MeshSpec, make_mesh
    from xlaopt.models.registry import get_config
    from xlaopt.pipeline import pipeline, run_pipeline, select_passes
    from xlaopt.program import TrainProgram, TrainSettings
    from xlaopt.transforms.hierarchical_grads import HierarchicalGradsTransform

    config = get_config(args.model)
    batch = BatchShape(8, 64, 0) if config.family == "decoder" else family_of(config).default_batch(config)
    program = TrainProgram(config, MeshSpec.parse("data=8"), settings=TrainSettings(batch=batch))
    hier, records = run_pipeline(program, pipeline())  # the nodes are the processes
    flat, _ = run_pipeline(program, select_passes(pipeline(), disable=["hierarchical-grads"]))
    report = next(r.report for r in records if r.name == "hierarchical-grads")
    (transform,) = [t for t in hier.grad_transforms if isinstance(t, HierarchicalGradsTransform)]
    dims = dict(transform.scatter_dims)

    mesh = make_mesh(program.mesh)
    compiled = compile_program(hier, mesh)
    params = compiled.init(jax.random.key(0)).params
    names = [n for n, _ in transform.scatter_dims]
    leaves = jax.tree.leaves(params)
    # Every device's own gradient of every parameter: a leading axis over the data ranks.
    local = [jax.make_array_from_callback((8,) + leaf.shape, NamedSharding(mesh, P("data")),
                                          lambda idx, s=leaf.shape: np.full((1,) + s, float(idx[0].start or 0) + 1,
                                                                            np.float32))
             for leaf in leaves]

    def reducer(hierarchical: bool):
        def body(gs):
            out = [transform.reduce(g[0], dims[n]) if hierarchical else jax.lax.psum(g[0], "data")
                   for g, n in zip(gs, names)]
            return [o[None] for o in out]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),), out_specs=P("data"),
                                     axis_names={"data"}, check_vma=False))

    reduce_flat, reduce_hier = reducer(False), reducer(True)
    got_flat, got_hier = reduce_flat(local), reduce_hier(local)
    mine = [np.asarray(a.addressable_shards[0].data) for a in got_flat]
    assert all(np.array_equal(a, np.asarray(b.addressable_shards[0].data)) for a, b in zip(mine, got_hier))
    assert all(np.all(a == 36.0) for a in mine)  # 1 + 2 + ... + 8, every element
    sync = _median_ms({"flat": lambda: jax.block_until_ready(reduce_flat(local)),
                       "hierarchical": lambda: jax.block_until_ready(reduce_hier(local))}, args.steps)

    steps, key = {}, jax.random.key(1)
    for name, prog in (("flat", flat), ("hierarchical", hier)):
        c = compile_program(prog, mesh)
        state = c.init(jax.random.key(0))
        data = family_of(config).synthetic(config, batch, 0).batch(0)
        put = c.put_batch(c.local_part(data))
        steps[name] = lambda c=c, state=state, put=put: jax.block_until_ready(c.grads(state.params, put, key))
    step = _median_ms(steps, max(args.steps // 3, 5))

    if jax.process_index() == 0:
        result = {"model": args.model, "processes": PROCESSES, "devices_per_process": LOCAL_DEVICES,
                  "link_gbit": args.link or None,
                  "gradient_bytes_per_device": report["gradient_bytes_per_device"],
                  "network_bytes_flat": report["network_bytes_flat"], "network_bytes": report["network_bytes"],
                  "flat_ms": sync["flat"], "hierarchical_ms": sync["hierarchical"],
                  "speedup": sync["flat"] / sync["hierarchical"], "steps": args.steps,
                  "grad_step_flat_ms": step["flat"], "grad_step_hierarchical_ms": step["hierarchical"],
                  "grad_step_calls": max(args.steps // 3, 5), "jax": jax.__version__,
                  "machine": os.uname().nodename, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
        print(f"{args.model}: {report['gradient_bytes_per_device'] / 2**20:.1f} MiB of fp32 gradients per device, "
              f"{PROCESSES} processes x {LOCAL_DEVICES} devices (gloo), processes joined by "
              f"{f'a {args.link} Gbit/s link' if args.link else 'loopback'}, median of {args.steps}")
        print(f"{'':14}{'sync ms':>10}{'grad step ms':>14}{'MiB across':>12}")
        for name, across in (("flat", report["network_bytes_flat"]), ("hierarchical", report["network_bytes"])):
            print(f"{name:14}{sync[name]:10.1f}{step[name]:14.1f}{across / 2**20:12.1f}")
        print(f"sync speedup {result['speedup']:.2f}x; grad step {step['flat'] / step['hierarchical']:.2f}x")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    jnp.zeros(()).block_until_ready()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--link", type=float, default=0.0, metavar="GBIT",
                        help="join the two processes by a link shaped to GBIT Gbit/s (needs root, ip, tc)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator-host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is None:
        return launch(args)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
