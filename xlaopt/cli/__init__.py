"""The `xlaopt` command line.

One module per command registers its flags and parses them into a frozen request.

JAX is imported only after the mesh is parsed, so the simulated CPU device count can be set before
JAX starts. Bad input ends in one line naming the problem and the fix.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

from xlaopt.cli import (
    analyze,
    bench,
    calibrate,
    ckpt,
    data,
    export_weights,
    generate,
    goodput,
    import_weights,
    inspect,
    models,
    parity,
    passes,
    plan,
    train,
    verify,
)
from xlaopt.errors import UserError, XlaoptError
from xlaopt.io.outputs import check_outputs

# The commands in `xlaopt --help`'s order, each module's `main(args)` by name.
_MODULES = {"train": train, "verify": verify, "inspect": inspect, "analyze": analyze, "plan": plan,
            "generate": generate, "models": models, "passes": passes, "data": data, "calibrate": calibrate,
            "parity": parity, "import-weights": import_weights, "export-weights": export_weights, "ckpt": ckpt, "bench": bench,
            "goodput": goodput}
_COMMANDS = {name: module.main for name, module in _MODULES.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlaopt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _MODULES.values():
        module.register(sub)
    return parser


# dest -> (flag, lowest, highest) of integer flags, whichever commands have them; each was once
# taken silently (`--global-batch 0` as the default rows, `--top -1` as 0) or refused late (a
# negative --seed by numpy after the compile). Flags refused early by the code that reads them
# (--steps, --samples, --devices, --seq, the batch sizes, the process counts) are not repeated.
_COUNTS = {"seed": ("--seed", 0, 2**32 - 1), "keep": ("--keep", 1, None), "keep_every": ("--keep-every", 1, None),
           "top": ("--top", 0, None), "rows": ("--rows", 0, None), "global_batch": ("--global-batch", 1, None),
           "context": ("--context", 1, None), "text_tokens": ("--text-tokens", 1, None),
           "gen_tokens": ("--gen-tokens", 1, None), "new_tokens": ("--new-tokens", 1, None),
           "prompt_tokens": ("--prompt-tokens", 1, None), "negative_tokens": ("--negative-tokens", 1, None)}
# Float flags that must be finite and > 0 (`bench checkpoint --size-gb -1` ran and reported).
_POSITIVE = {"size_gb": "--size-gb", "shard_mb": "--shard-mb", "temperature": "--temperature"}


def _check_counts(args) -> None:
    for dest, (flag, low, high) in _COUNTS.items():
        value = getattr(args, dest, None)
        if value is not None and (value < low or (high is not None and value > high)):
            raise UserError(f"{flag} {value}: must be " + (f"at least {low}" if high is None else f"in [{low}, {high}]"))
    for dest, flag in _POSITIVE.items():
        value = getattr(args, dest, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(f"{flag} {value:g}: must be a finite number > 0")


# What str.splitlines breaks at: a message quoting input that holds one would print as two lines.
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


# The device nodes JAX's own check looks for (jax._src.hardware_utils.has_visible_nvidia_gpu, 0.10.2).
_NVIDIA_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def _choose_platform() -> None:
    """Run JAX on the CPU when no platform was chosen and no NVIDIA GPU is visible.

    With the gpu-aot extra installed, JAX's first backend start imports the CUDA plugin and calls
    its initialize(); when jax_platforms is unset that checks the CUDA runtime, fails on a machine
    without a driver, and JAX logs "Jax plugin configuration error" with a traceback before falling
    back to the CPU. With `cpu` chosen up front the plugin skips that check and still registers,
    so `analyze --target gpu` keeps its compile-only GPU topology. JAX_PLATFORMS set by the user
    (even empty), a platform a caller gave jax.config (the tests), or a visible GPU leave the
    choice alone. The variable is inherited by the processes a command starts, which run on the
    same CPU.
    """
    if "JAX_PLATFORMS" in os.environ or any(os.path.exists(node) for node in _NVIDIA_DEVICE_NODES):
        return
    if "jax" not in sys.modules:
        os.environ["JAX_PLATFORMS"] = "cpu"  # read when JAX is imported (not imported here: cheap commands)
        return
    import jax

    if jax.config.jax_platforms is None:
        jax.config.update("jax_platforms", "cpu")


def main(argv: list[str] | None = None) -> int:
    from xlaopt.runtime.goodput import process_start_time, started_by_launcher

    started = started_by_launcher(min(process_start_time(), time.time()))
    argv = sys.argv[1:] if argv is None else argv
    # What a command may need beyond its flags, given before parsing: nothing writes into args after.
    args = build_parser().parse_args(argv, argparse.Namespace(argv=tuple(argv), started=started))
    _choose_platform()
    try:
        _check_counts(args)  # before any work, as the outputs: a bad value costs no compile,
        check_outputs(_command_words(args), vars(args))  # and an unwritable output cannot lose a finished run's results
        if "compile_cache" in vars(args):  # a command that compiles (flags.compile_cache_args)
            from xlaopt.compiler import cache as compile_cache, log as compiler_log

            compiler_log.show_raw(args.verbose)

            # An unwritable directory: exit 2 before any work. A launcher (`train --processes N`)
            # compiles nothing: it checks the directory without importing JAX; its processes use it.
            if getattr(args, "processes", None) is not None:
                compile_cache.check(args.compile_cache)
            else:
                compile_cache.configure(args.compile_cache)
        return _COMMANDS[args.command](args)
    except XlaoptError as e:  # the one place an error becomes its exit status (xlaopt.errors' table)
        print(f"xlaopt {args.command}: error: {str(e).translate(_LINE_BREAKS)}", file=sys.stderr)
        code = e.exit_code
    except BaseException:
        if not _joined_job():
            raise
        traceback.print_exc()
        code = 1
    if _joined_job():
        # A process of a job that failed: jax.distributed's exit handler would wait in a shutdown
        # barrier for peers that are stopping on their own (xlaopt.runtime.faults), then abort.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _joined_job() -> bool:
    from xlaopt.runtime import distributed

    return distributed.joined()


def _command_words(args: argparse.Namespace) -> str:
    """The command and its subcommand, if it has one: `data make`."""
    subcommand = getattr(args, f"{args.command}_command", None)
    return args.command if subcommand is None else f"{args.command} {subcommand}"
