"""The `xlaopt` command line.

JAX is imported only after the mesh is parsed, so the simulated CPU device count can be
set before JAX starts. Bad input ends in one line naming the problem and the fix.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
import traceback

from xlaopt.errors import UserError, XlaoptError
from xlaopt.io.outputs import check_outputs
from xlaopt.mesh import MeshSpec, make_mesh, request_cpu_devices
from xlaopt.models.registry import get_config, parse_overrides, registered_models


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="registered model name (see `xlaopt models`)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set num_layers=2 (repeatable)")


def _program_args(p: argparse.ArgumentParser, default_dtype: str) -> None:
    _model_args(p)
    p.add_argument("--mesh", default="", help="mesh axes, e.g. data=2,fsdp=2,tensor=2 (size-1 axes may be omitted)")
    p.add_argument("--layout", default=None, metavar="FILE",
                   help="a layout file (TOML/JSON: mesh, device order, rules, batch, execution; see xlaopt.layout, "
                        "written by `xlaopt plan --out`) instead of --mesh; sizes and --exec given here override its own")
    p.add_argument("--dtype", default=None,
                   help=f"compute dtype, the execution setting compute_dtype (default: the layout's, else {default_dtype})")
    p.set_defaults(default_dtype=default_dtype)
    p.add_argument("--exec", action="append", default=[], metavar="KEY=VALUE",
                   help="an execution setting (xlaopt.execution: remat, attention, attention_block, layer_stack, "
                        "micro_batches, loss_scale_init, loss_scale_growth_interval), e.g. --exec remat=full (repeatable); "
                        "a resume accepts any")
    p.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an XLA compiler option, e.g. --xla-option xla_cpu_enable_fast_math=false (repeatable)")
    p.add_argument("--pass-option", action="append", default=[], metavar="PASS.FIELD=VALUE",
                   help="a pass's option, e.g. --pass-option mesh-layout.constrain_activations=false (repeatable)")
    p.add_argument("--batch-size", type=int, default=None, help="packed rows per step (default: the model family's)")
    p.add_argument("--text-len", type=int, default=None, help="text (reasoner) tokens per packed row")
    p.add_argument("--gen-len", type=int, default=None, help="generator tokens per packed row (Cosmos 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--passes", default=None, help="run only these passes (comma-separated, pipeline order)")
    p.add_argument("--disable", default="", help="skip these passes (comma-separated)")
    p.add_argument("--dump-hlo", default=None, metavar="DIR",
                   help="write the lowered and compiled HLO before the pipeline and after each pass")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON")


def _global_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-batch", type=int, default=None, metavar="B",
                   help="rows (sequences) per optimizer step over all devices; the same as --batch-size")
    p.add_argument("--seq", type=int, default=None, metavar="S",
                   help="tokens per row: a decoder's sequence length; for Cosmos 3 a row's text + generator "
                        "tokens, split in the ratio of the mix's row budget (--mix) or the family default's")


def _apply_global_batch(args, config) -> None:
    """`--global-batch` and `--seq` as the batch-size and row-length arguments they stand for."""
    from xlaopt.families import family_of

    if args.global_batch is not None:
        if args.batch_size is not None and args.batch_size != args.global_batch:
            raise UserError(f"--global-batch {args.global_batch} and --batch-size {args.batch_size} disagree; "
                            f"they are the same setting, pass one")
        args.batch_size = args.global_batch
    if args.seq is None:
        return
    if args.seq < 2:
        raise UserError(f"--seq {args.seq}: a row needs at least 2 tokens")
    if config.family != "cosmos3":
        given = {"--text-len": args.text_len, "--gen-len": args.gen_len}
        if any(v is not None for v in given.values()):
            raise UserError(f"--seq is {config.name}'s sequence length; drop --text-len/--gen-len")
        args.text_len, args.gen_len = args.seq, 0
        return
    from xlaopt.data.loader import split_budget

    if args.text_len is not None or args.gen_len is not None:
        raise UserError("--seq splits a row between text and generator tokens itself; give --seq or "
                        "--text-len/--gen-len, not both")
    if getattr(args, "mix", None) is not None:
        from xlaopt.data.mixes import get_mix

        text, gen = get_mix(args.mix).row
    else:
        default = family_of(config).default_batch(config)
        text, gen = default.text_len, default.gen_len
    args.text_len, args.gen_len = split_budget(args.seq, text, gen)


_CLUSTER_HELP = ("the cluster the mesh is laid on, e.g. h100:2x4 or a TOML/JSON file: passes that act on its nodes "
                 "(hierarchical-grads) use them; default: in a multi-process job each process's devices are a node")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlaopt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model on synthetic data on a (simulated) device mesh")
    _program_args(p, "bfloat16")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--data", default=None, metavar="DIR|memory",
                   help="a sample store (`xlaopt data make DIR`) for Cosmos 3 models; default: a synthetic "
                        "store made on first use under $XLAOPT_CACHE (~/.cache/xlaopt); `memory`: the "
                        "in-memory synthetic stream. Decoder models train on the in-memory text stream")
    p.add_argument("--mix", default=None, metavar="NAME",
                   help="train on a store of this named sample mix of real shapes (xlaopt.data.mixes: cosmos3-480p, "
                        "cosmos3-mid, cosmos3-720p), made on first use under $XLAOPT_CACHE; rows default to the (text, generator) "
                        "budget the mix is weighted for. Not with --data")
    p.add_argument("--skip-oversize", action="store_true",
                   help="skip stored samples longer than a row (counted in the loader state and the summary) "
                        "instead of stopping with an error")
    p.add_argument("--ckpt", default=None, metavar="DIR", help="save checkpoints (state and data position) here")
    p.add_argument("--ckpt-every", type=int, default=None, metavar="K",
                   help="save every K steps (default: only after the last step)")
    p.add_argument("--keep", type=int, default=3, metavar="N", help="keep the newest N checkpoints (default 3)")
    p.add_argument("--keep-every", type=int, default=None, metavar="K",
                   help="also keep every checkpoint whose step is a multiple of K")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --ckpt DIR, or start fresh when there is none")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="join a multi-process jax.distributed job (process 0's address; with --num-processes "
                        "and --process-id). Each process brings mesh devices / N devices and reads its own rows")
    p.add_argument("--num-processes", type=int, default=None, metavar="N")
    p.add_argument("--process-id", type=int, default=None, metavar="I")
    p.add_argument("--processes", type=int, default=None, metavar="N",
                   help="run as a local job of N processes (a free loopback port for the coordinator, mesh "
                        "devices / N each), supervised and reported as one")
    p.add_argument("--peer-timeout", type=float, default=None, metavar="S",
                   help="in a multi-process job, stop with an error naming the culprit once no step has finished "
                        "for S seconds (a dead, stopped or stuck process; default 60)")
    p.add_argument("--on-nonfinite", default="stop", choices=("stop", "skip"),
                   help="a step whose loss, gradients or updated state are not all finite: stop the run before "
                        "saving that state (what is committed stays finite; default), or skip such steps' updates "
                        "and count them")
    p.add_argument("--learning-rate", type=float, default=None, metavar="LR",
                   help="peak AdamW learning rate (default: xlaopt.program.TrainSettings')")
    p.add_argument("--topology", default=None, help=_CLUSTER_HELP)
    p = sub.add_parser("verify", help="one gradient step sharded on the mesh vs on one device")
    _program_args(p, "float32")
    p.add_argument("--topology", default=None, help=_CLUSTER_HELP)
    p = sub.add_parser("inspect", help="compile one step and list its collectives and memory (nothing runs)")
    _program_args(p, "bfloat16")
    p.add_argument("--topology", default=None, help="map collectives to link levels, e.g. h100:2x4 or a TOML/JSON file")
    p = sub.add_parser("analyze", help="compile one step from abstract parameters and price it on a cluster "
                                       "topology: step time, MFU, exposed communication, memory")
    _program_args(p, "bfloat16")
    p.add_argument("--topology", required=True,
                   help="cluster to price on: PRESET:NODESxDEVICES (h100:16x8) or a TOML/JSON file")
    p.add_argument("--target", default="cpu", choices=("cpu", "gpu"),
                   help="compile with XLA's CPU pipeline on simulated devices (default), or deviceless for the "
                        "topology's GPUs (needs xlaopt[gpu-aot])")
    p.add_argument("--trace", default=None, metavar="OUT.json",
                   help="write the simulated timeline as a Chrome/Perfetto trace (ui.perfetto.dev)")
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--mix", default=None, metavar="NAME",
                      help="price rows packed from this named sample mix as the loader packs them (cosmos3-480p, "
                           "cosmos3-mid, cosmos3-720p; rows default to the mix's budget); default: the synthetic stream")
    rows.add_argument("--data", default=None, metavar="DIR",
                      help="price rows packed from this sample store as the loader packs them (its index only)")
    p.add_argument("--skip-oversize", action="store_true",
                   help="with --mix/--data: leave out samples longer than a row, as `train --skip-oversize` does")
    _global_batch_args(p)
    p.add_argument("--serve", default=None, choices=("decode", "denoise"),
                   help="price one KV-cached decode step (rows from --global-batch, default 8) or one Cosmos 3 "
                        "denoising step, cached and uncached (clips from --global-batch, default 1), instead of a "
                        "training step, beside `plan --serve`'s analytic price")
    p.add_argument("--context", type=int, default=8192, help="with --serve decode: cached tokens a row")
    p.add_argument("--text-tokens", type=int, default=512, help="with --serve denoise: prompt tokens a clip")
    p.add_argument("--gen-tokens", type=int, default=7680, help="with --serve denoise: latent tokens a clip")
    p.add_argument("--guidance", type=float, default=3.0, help="with --serve denoise: CFG scale (1: one branch)")
    p = sub.add_parser("plan", help="choose the layout (mesh, device order, remat, micro-batches, precision) for a "
                                    "model on a cluster: analytic prices, the best few compiled; ranked with reasons")
    p.add_argument("--model", default=None, help="registered model name (default: the --from layout's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--topology", required=True, help="PRESET:NODESxDEVICES (h100:16x8, cpu:1x8) or a TOML/JSON file")
    _global_batch_args(p)
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--mix", default=None, metavar="NAME",
                      help="Cosmos 3: price rows packed from this sample mix (default on GPUs: cosmos3-480p)")
    rows.add_argument("--data", default=None, metavar="DIR", help="Cosmos 3: price rows packed from this store")
    p.add_argument("--target", default="auto", choices=("auto", "cpu", "gpu"),
                   help="compile the best few for this target; auto: gpu for a GPU topology when xlaopt[gpu-aot] "
                        "is installed, else cpu (simulated devices, up to 512), else analytic prices only")
    p.add_argument("--top", type=int, default=2, metavar="K", help="compile and price the best K (default 2)")
    p.add_argument("--exhaustive", action="store_true", help="compile every candidate that fits (slow; for testing)")
    p.add_argument("--exec", action="append", default=[], metavar="KEY=VALUE",
                   help="execution settings every candidate shares (attention, attention_block, layer_stack); remat, "
                        "micro_batches and compute_dtype are what the planner chooses")
    p.add_argument("--from", dest="from_layout", default=None, metavar="OLD_LAYOUT",
                   help="re-plan: the layout a run was trained with; prints the resharding its state needs")
    p.add_argument("--out", default=None, metavar="LAYOUT.toml", help="write the best layout's file (TOML or JSON)")
    p.add_argument("--rows", type=int, default=12, help="candidates to print (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="OUT")
    serve = p.add_argument_group("serving (analytic: no gradients or optimizer state, the KV cache in memory)")
    serve.add_argument("--serve", default=None, choices=("decode", "denoise"),
                       help="plan an inference layout for a decode step (LLM, Cosmos 3's reasoner) or a Cosmos 3 "
                            "denoising step instead of training; rows from --global-batch (default 8, denoise 1)")
    serve.add_argument("--context", type=int, default=8192, help="decode: cached tokens a row (default 8192)")
    serve.add_argument("--text-tokens", type=int, default=512, help="denoise: prompt tokens a row (default 512)")
    serve.add_argument("--gen-tokens", type=int, default=7680,
                       help="denoise: generator tokens a row (default 7680, a 480p clip of cosmos3-480p)")
    serve.add_argument("--guidance", type=float, default=3.0,
                       help="denoise: CFG scale; above 1 both branches run, twice the rows (default 3)")
    p = sub.add_parser("generate", help="sample from a model (its own random init): Cosmos 3 video by rectified flow "
                                        "with the reasoner's K/V cached (timed against uncached), or text by "
                                        "KV-cached decoding (decoder LLMs; Cosmos 3 with --decode-text)")
    _model_args(p)
    p.add_argument("--mesh", default="", help="mesh axes, e.g. tensor=2 or data=2,tensor=2: parameters as training "
                                              "lays them out, rows over data/fsdp (context parallel: not yet)")
    p.add_argument("--layout", default=None, metavar="FILE", help="a layout file instead of --mesh (e.g. from "
                                                                   "`plan --serve`; its execution applies)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the layout's, else float32)")
    p.set_defaults(default_dtype="float32")
    p.add_argument("--batch-size", type=int, default=None, help="prompts, one sample each (default 1)")
    p.add_argument("--prompt", default=None, metavar="IDS", help="comma-separated token ids for every row "
                                                                 "(default: random ids of --prompt-len from --seed)")
    p.add_argument("--prompt-len", type=int, default=None, help="tokens of the random prompt (default 16)")
    p.add_argument("--text-len", type=int, default=None,
                   help="the reasoner's cache positions: video: the text region (default: the prompt's length); "
                        "text: the KV cache (default: prompt + new tokens)")
    p.add_argument("--seed", type=int, default=0, help="parameters, prompt and noise")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON")
    video = p.add_argument_group("video (Cosmos 3)")
    video.add_argument("--gen-len", type=int, default=None,
                       help="generator (video latent) tokens per clip (default 64)")
    video.add_argument("--frames", type=int, default=None, help="latent frames of the clip (default: 4, 2 or 1, "
                                                                "whichever divides --gen-len first)")
    video.add_argument("--steps", type=int, default=None, help="denoising steps (default 10)")
    video.add_argument("--guidance", type=float, default=None,
                       help="classifier-free guidance scale in [1, 20] (default 3; 1: no guidance, one branch)")
    video.add_argument("--sampler", default=None, choices=("euler", "heun"), help="default euler")
    video.add_argument("--shift", type=float, default=None, help="sigma schedule shift (default 3, the synthetic "
                                                                 "data's training shift)")
    text = p.add_argument_group("text")
    text.add_argument("--decode-text", action="store_true", help="Cosmos 3: decode reasoner text instead of video")
    text.add_argument("--new-tokens", type=int, default=None, help="tokens to decode (default 16)")
    text.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default greedy)")
    p = sub.add_parser("models", help="registered models with parameter counts")
    p.add_argument("--json", default=None, metavar="OUT")
    sub.add_parser("passes", help="the pass pipeline, in order")
    data = sub.add_parser("data", help="sample stores on tensorstore").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("make", help="write a synthetic Cosmos-like sample store")
    p.add_argument("dir")
    p.add_argument("--model", default="cosmos3-tiny", help="the Cosmos 3 config whose latent widths to use")
    p.add_argument("--mix", default=None, metavar="NAME",
                   help="samples of this named mix of real shapes (cosmos3-480p, cosmos3-mid, cosmos3-720p; "
                        "random latents) instead of the toy-sized synthetic ones")
    p.add_argument("--samples", type=int, default=None,
                   help="default 20,000 toy samples, or the mix's default, small because its latents are large: "
                        "cosmos3-480p 2,000 (~250 MB at cosmos3-tiny widths, ~1.5 GB at cosmos3-nano's), "
                        "cosmos3-mid 200 (~170 MB, ~1 GB), cosmos3-720p 16 (~90 MB, ~540 MB: a 720p clip is "
                        "44,160 x 192 float32 latents at nano's width, 34 MB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=float, default=64.0, help="approximate shard size")
    p = data.add_parser("stats", help="a store's sample count, shards and length statistics")
    p.add_argument("dir")
    p.add_argument("--json", default=None, metavar="OUT")
    p = sub.add_parser("calibrate", help="price published training runs with the cost model; per-row and "
                                         "leave-one-out errors")
    p.add_argument("--runs", required=True, metavar="CSV", help="published runs (schema: shared/calibration/README.md)")
    p.add_argument("--method", default="analytic", choices=("analytic", "compiled"),
                   help="analytic: every row from the analytic model (seconds); compiled: compile the rows xlaopt "
                        "can build (data/FSDP/tensor parallel, <= 512 devices, bf16) at full size on simulated CPU "
                        "devices and price the HLO with the simulator, the rest analytically (about a minute)")
    p.add_argument("--fit", action="store_true",
                   help="refit the efficiencies on the CSV's modelled rows and print them to 3 significant "
                        "figures beside the frozen costmodel.FITTED (changes nothing)")
    p.add_argument("--json", default=None, metavar="OUT")
    p = sub.add_parser("parity", help="NVIDIA's reference (diffusers, torch, CPU) and xlaopt on the same sample: "
                                      "per-modality differences (needs xlaopt[parity])")
    p.add_argument("--diffusers", required=True, metavar="DIR", help="a saved Cosmos3OmniTransformer directory")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--seed", type=int, default=0, help="build a sample covering every modality from this seed")
    source.add_argument("--inputs", default=None, metavar="SAMPLE.npz",
                        help="the reference forward's keyword arguments (lists as name_0, name_1, ...)")
    p.add_argument("--dump", default=None, metavar="OUT.npz", help="xlaopt's predictions (vision_0, sound_0, ...)")
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="xlaopt's compute dtype")
    p.add_argument("--rope-table", default="reference", choices=("reference", "xlaopt"),
                   help="rotary frequencies: the reference's fp32 table (default) or xlaopt's own")
    p = sub.add_parser("import-weights", help="a diffusers Cosmos3OmniTransformer directory -> an xlaopt "
                                              "checkpoint, placed on a mesh")
    p.add_argument("--from", dest="source", nargs=2, metavar=("FORMAT", "DIR"), required=True,
                   help="the format (diffusers) and directory of the weights")
    p.add_argument("--out", required=True, metavar="CKPT", help="the xlaopt checkpoint directory to write")
    p.add_argument("--mesh", default="", help="place the parameters on this mesh (e.g. fsdp=4,tensor=2)")
    p.add_argument("--name", default="cosmos3-diffusers", help="the model name recorded in the checkpoint")
    ckpt = sub.add_parser("ckpt", help="checkpoint directories").add_subparsers(dest="ckpt_command", required=True)
    p = ckpt.add_parser("ls", help="committed steps with sizes, and debris of interrupted saves")
    p.add_argument("dir")
    p.add_argument("--json", default=None, metavar="OUT")
    p = ckpt.add_parser("verify", help="check every file and chunk checksum; exits 1 on any fault")
    p.add_argument("dir")
    p.add_argument("--step", type=int, default=None, help="only this step (default: all)")
    p.add_argument("--json", default=None, metavar="OUT")
    p = ckpt.add_parser("inspect", help="a step's manifest: leaves, shapes, dtypes, shardings, run metadata")
    p.add_argument("dir")
    p.add_argument("--step", type=int, default=None, help="default: the newest")
    p.add_argument("--json", default=None, metavar="OUT")
    p = ckpt.add_parser("diff", help="exit 0 when two checkpoints hold bit-identical leaves and data position, "
                                     "1 with the leaves that differ")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--step", type=int, default=None, help="this step in both (default: each one's newest)")
    p.add_argument("--json", default=None, metavar="OUT")
    bench = sub.add_parser("bench", help="benchmarks against the anchors").add_subparsers(dest="bench_command",
                                                                                         required=True)
    p = bench.add_parser("checkpoint", help="disk vs xlaopt vs Orbax: save and cold restore of one sharded tree")
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians are reported")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices the tree is sharded over")
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: /tmp)")
    p.add_argument("--json", default=None, metavar="OUT")
    p = bench.add_parser("data", help="the xlaopt loader vs Grain feeding the same cosmos3-tiny training step")
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--store", "--data", default=None, metavar="DIR",
                      help="a sample store (default: a synthetic one in a temp dir)")
    rows.add_argument("--mix", default=None, metavar="NAME",
                      help="a named mix's store (made once in the cache), in rows of the mix's budget")
    p.add_argument("--steps", type=int, default=30, help="timed training steps per contender and round")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported")
    p.add_argument("--io", action="store_true",
                   help="instead: the loader vs the disk on real-size clips (a ~2.5 GB synthetic store of 720p "
                        "video latents unless --store), cold page cache; no training")
    p.add_argument("--dir", default=None, help="--io: where to make the synthetic store (default: the temp dir)")
    p.add_argument("--json", default=None, metavar="OUT")
    return parser


# dest -> (flag, lowest, highest) of integer flags, whichever commands have them; each was once
# taken silently (`--global-batch 0` as the default rows, `--top -1` as 0) or refused late (a
# negative --seed by numpy after the compile). Flags refused early by the code that reads them
# (--steps, --samples, --devices, --seq, the batch sizes, the process counts) are not repeated.
_COUNTS = {"seed": ("--seed", 0, 2**32 - 1), "keep": ("--keep", 1, None), "keep_every": ("--keep-every", 1, None),
           "top": ("--top", 0, None), "rows": ("--rows", 0, None), "global_batch": ("--global-batch", 1, None),
           "context": ("--context", 1, None), "text_tokens": ("--text-tokens", 1, None),
           "gen_tokens": ("--gen-tokens", 1, None), "new_tokens": ("--new-tokens", 1, None)}
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
    from xlaopt.runtime.goodput import process_start_time

    started = min(process_start_time(), time.time())  # /proc's boot time has 1 s resolution
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv, args.started = argv, started
    _choose_platform()
    try:
        _check_counts(args)  # before any work, as the outputs: a bad value costs no compile,
        check_outputs(args)  # and an unwritable output cannot lose a finished run's results
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


def _program_on_devices(args):
    """The program the arguments describe, with the simulated devices its mesh needs.
    Importing JAX is fine here; what must wait for the device count is its first backend use."""
    from xlaopt.data.batch import BatchShape
    from xlaopt.families import family_of
    from xlaopt.runtime import distributed

    layout = _layout(args)
    mesh, rules = layout.mesh, layout.rules
    config = get_config(args.model, parse_overrides(args.model, args.set))
    job = [getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id")]  # `train` only
    if distributed.check_args(*job):
        request_cpu_devices(distributed.local_device_count(mesh.num_devices, args.num_processes))
        distributed.initialize(*job, _peer_timeout(args))
    else:
        request_cpu_devices(mesh.num_devices)
    make_mesh(mesh)  # enough devices? say so before any compilation or data making
    default = family_of(config).default_batch(config)
    data = getattr(args, "data", "memory")  # only `train` reads data
    mix = getattr(args, "mix", None)  # `train` only
    if mix is not None:
        data, default = _mix_data(args, config, default)
    elif data is None and config.family == "cosmos3":
        from xlaopt.data.synthetic_store import default_store

        data = str(default_store(config))
    args.data = data = None if data == "memory" else data
    if data is not None and mix is None:
        if config.family != "cosmos3":
            raise UserError(f"--data: sample stores hold Cosmos 3 samples; {args.model} trains on synthetic text")
        from xlaopt.data.loader import split_budget
        from xlaopt.data.store import SampleStore

        # A row's budget split in the ratio of the store's mean text and generator lengths.
        stats = SampleStore(args.data).manifest["stats"]
        text, gen = split_budget(default.text_len + default.gen_len, stats["text_tokens"]["mean"],
                                 stats["gen_tokens"]["mean"])
        default = BatchShape(default.batch_size, text, gen)
    pick = lambda value, fallback: fallback if value is None else value
    batch = BatchShape(pick(args.batch_size, default.batch_size), pick(args.text_len, default.text_len),
                       pick(args.gen_len, default.gen_len))
    return _program(args, config, mesh, rules, batch)


def _mix_data(args, config, default):
    """`train --mix`: the mix's store (made once, in the cache) and the batch shape, whose row
    budget (given, else the one the mix is weighted for) is checked against the mix first."""
    from xlaopt.data.batch import BatchShape
    from xlaopt.data.mixes import get_mix
    from xlaopt.data.synthetic_store import mix_store

    if args.data is not None:
        raise UserError(f"--mix {args.mix} and --data {args.data} both given; a mix makes its own store, pass one "
                        f"or the other")
    if config.family != "cosmos3":
        raise UserError(f"--mix: mixes hold Cosmos 3 samples; {args.model} trains on synthetic text")
    mix = get_mix(args.mix)
    pick = lambda value, fallback: fallback if value is None else value
    text, gen = pick(args.text_len, mix.row[0]), pick(args.gen_len, mix.row[1])
    mix.check_row(text, gen, args.skip_oversize)
    return str(mix_store(config, mix)), BatchShape(default.batch_size, text, gen)


def _program(args, config, mesh, rules, batch, target: str = "cpu"):
    """The program of the model, layout and batch, with the arguments' settings."""
    from xlaopt.execution import ExecutionConfig, parse_execution
    from xlaopt.program import TrainProgram, TrainSettings
    from xlaopt.transforms.compiler_options import CompilerOptions

    base = args.layout_execution or ExecutionConfig()
    execution = parse_execution(args.exec, dataclasses.replace(base, compute_dtype=args.dtype))
    settings = TrainSettings(batch=batch, seed=args.seed)
    if getattr(args, "learning_rate", None) is not None:  # `train` only
        settings = dataclasses.replace(settings, learning_rate=args.learning_rate)
    if getattr(args, "on_nonfinite", None) is not None:  # `train` only
        settings = dataclasses.replace(settings, nonfinite=args.on_nonfinite)
    return TrainProgram(config, mesh, rules=rules, settings=settings,
                        execution=execution, target=target, compiler_options=CompilerOptions.parse(args.xla_option))


def _layout(args):
    """The layout of `--mesh` (default rules and order) or of `--layout FILE`. A file's batch and
    execution fill in what the command line leaves unset (kept on `args`), its model is checked."""
    from xlaopt.layout import Layout, load_layout

    args.layout_execution = None
    if args.layout is None:
        layout = Layout(MeshSpec.parse(args.mesh))
    else:
        if args.mesh:
            raise UserError("--mesh and --layout both given; a layout file holds its mesh, pass one or the other")
        layout = load_layout(args.layout)
        layout.check_model(args.model, args.layout)
        args.layout_execution = layout.execution
        if layout.batch is not None:
            for name in ("batch_size", "text_len", "gen_len"):
                if getattr(args, name) is None:
                    setattr(args, name, getattr(layout.batch, name))
    if args.dtype is None:
        args.dtype = layout.execution.compute_dtype if layout.execution is not None else args.default_dtype
    return layout


def _apply_pipeline(args, program, dump_dir, topology=None):
    from xlaopt.context import PassContext
    from xlaopt.pipeline import parse_pass_options, pipeline, run_pipeline, select_passes

    names = lambda text: [n.strip() for n in text.split(",") if n.strip()]
    only = names(args.passes) if args.passes is not None else None
    passes = select_passes(pipeline(parse_pass_options(args.pass_option)), only, names(args.disable))
    program, records = run_pipeline(program, passes, dump_dir, PassContext.for_program(program, topology, only or ()))
    return program, [{"name": r.name, "changed": r.changed, "report": r.report, "dumped": list(r.dumped)}
                     for r in records]


def _write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)


def _peer_timeout(args) -> float:
    from xlaopt.runtime.faults import DEFAULT_PEER_TIMEOUT_S

    timeout = DEFAULT_PEER_TIMEOUT_S if args.peer_timeout is None else args.peer_timeout
    if not 0 < timeout <= 86400:
        raise UserError(f"--peer-timeout {args.peer_timeout:g}: need seconds in (0, 86400]")
    return timeout


def cmd_train(args) -> int:
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: need at least 1 step")
    if args.learning_rate is not None and not (math.isfinite(args.learning_rate) and args.learning_rate >= 0):
        raise UserError(f"--learning-rate {args.learning_rate:g}: need a finite rate >= 0")
    if args.processes is not None:
        return _launch_train(args)
    program = _program_on_devices(args)
    from xlaopt.runtime.train import FaultOptions, format_summary, train

    ckpt = None
    if args.ckpt is not None:
        if args.ckpt_every is not None and args.ckpt_every < 1:
            raise UserError(f"--ckpt-every {args.ckpt_every}: must be a positive number of steps")
        from xlaopt.runtime.train import CheckpointOptions

        ckpt = CheckpointOptions(args.ckpt, args.ckpt_every, args.resume, args.keep, args.keep_every)
    elif args.resume or args.ckpt_every is not None:
        raise UserError("--resume and --ckpt-every need --ckpt DIR")
    program, passes = _apply_pipeline(args, program, args.dump_hlo, _cluster(args, program))
    import jax

    lead = jax.process_index() == 0  # in a multi-process job, one process reports
    faults = FaultOptions(_peer_timeout(args), args.started)
    result = train(program, args.steps, progress=lead and not args.no_progress, data_dir=args.data, ckpt=ckpt,
                   skip_oversize=args.skip_oversize, faults=faults)
    result["passes"] = passes
    if lead:
        print(result["message"] if not result["steps"] else format_summary(result))
        _write_json(args.json, result)
    return 0


def _launch_train(args) -> int:
    """`train --processes N`: checked here, then run as N local processes (one of them: in-process)."""
    from xlaopt.runtime import launch

    launch.check_processes(args.processes, args.coordinator, _layout(args).mesh.num_devices)
    argv = launch.strip_option(args.argv[1:], "--processes")
    if args.processes == 1:
        return main(["train", *argv])
    return launch.launch(argv, args.processes, _peer_timeout(args))


def cmd_verify(args) -> int:
    program = _program_on_devices(args)
    from xlaopt.runtime.verify import compare, one_step_grads, reference_program

    mesh = program.mesh
    topology = _cluster(args, program)
    sharded, passes = _apply_pipeline(args, program, args.dump_hlo, topology)
    single, _ = _apply_pipeline(args, reference_program(program), None, topology)
    dtype, reference_dtype = program.execution.compute_dtype, single.execution.compute_dtype
    result = compare(one_step_grads(sharded), one_step_grads(single), dtype)
    result.update(model=args.model, mesh=mesh.as_dict(), dtype=dtype, reference_dtype=reference_dtype,
                  execution=dataclasses.asdict(program.execution), passes=passes)
    against = "" if reference_dtype == dtype else f" against {reference_dtype} on one device"
    print(f"verify {args.model} on {mesh} ({dtype}{against}): loss diff {result['max_abs_diff_loss']:.3g} "
          f"(tol {result['loss_tolerance']:.3g}), max grad rel diff {result['max_rel_diff_grads']:.3g} "
          f"at {result['worst_grad']} (tol {result['grad_tolerance']:.3g}): {'ok' if result['ok'] else 'MISMATCH'}")
    _write_json(args.json, result)
    return 0 if result["ok"] else 1


def _cluster(args, program):
    """The optional --topology, checked against the program's mesh."""
    if not args.topology:
        return None
    from xlaopt.analysis.topology import parse_topology

    topology = parse_topology(args.topology)
    if program.mesh.num_devices > topology.num_devices:
        raise UserError(f"mesh {program.mesh} needs {program.mesh.num_devices} devices; topology "
                        f"{topology.name} has {topology.num_devices}")
    return topology


def cmd_inspect(args) -> int:
    program = _program_on_devices(args)
    topology = _cluster(args, program)
    from xlaopt.analysis.inspection import format_report, inspect_program

    program, passes = _apply_pipeline(args, program, args.dump_hlo, topology)
    report = inspect_program(program, topology)
    print(format_report(report))
    _write_json(args.json, dict(report, passes=passes))
    return 0


def cmd_analyze(args) -> int:
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.data.batch import BatchShape
    from xlaopt.families import family_of

    topology = parse_topology(args.topology)
    config = get_config(args.model, parse_overrides(args.model, args.set))
    _apply_global_batch(args, config)
    layout = _layout(args)
    if args.layout is not None:
        layout.check_topology(topology.name, args.layout)
    mesh, rules = layout.mesh, layout.rules
    if mesh.num_devices > topology.num_devices:
        raise UserError(f"mesh {mesh} needs {mesh.num_devices} devices but topology {topology.name} has "
                        f"{topology.num_devices}; use a smaller mesh or a larger topology")
    if args.target == "cpu":
        request_cpu_devices(mesh.num_devices)  # one simulated device per mesh device (at most 512)
    else:
        import jax

        jax.config.update("jax_platforms", "cpu")  # the GPU compiler runs deviceless
    if args.serve is not None:
        from xlaopt.analysis import serving_step

        if args.serve == "decode":
            result = serving_step.analyze_decode(config, mesh, rules, topology, args.target, args.global_batch or 8,
                                                 args.context, args.dtype or "bfloat16")
            print(serving_step.format_decode(result))
        else:
            result = serving_step.analyze_denoise(config, mesh, rules, topology, args.target, args.global_batch or 1,
                                                  args.text_tokens, args.gen_tokens, args.guidance,
                                                  args.dtype or "bfloat16")
            print(serving_step.format_denoise(result))
        _write_json(args.json, result)
        return 0
    from xlaopt.analysis.analyze import analysis_batch_size, analyze, format_analysis
    from xlaopt.analysis.priced_batch import mix_batch, store_batch

    default = family_of(config).default_batch(config)
    if args.mix is not None:  # rows of the budget the mix is weighted for, unless given
        from xlaopt.data.mixes import get_mix

        default = BatchShape(default.batch_size, *get_mix(args.mix).row)
    pick = lambda value, fallback: fallback if value is None else value
    batch = BatchShape(analysis_batch_size(mesh, default.batch_size, args.batch_size),
                       pick(args.text_len, default.text_len), pick(args.gen_len, default.gen_len))
    program = _program(args, config, mesh, rules, batch, target=args.target)
    program, passes = _apply_pipeline(args, program, None, topology)
    priced = (mix_batch(program, args.mix, args.skip_oversize) if args.mix is not None
              else store_batch(program, args.data, args.skip_oversize) if args.data is not None else None)
    result = analyze(program, topology, program.target, args.trace, args.dump_hlo, batch=priced)
    result["passes"] = passes
    print(format_analysis(result))
    _write_json(args.json, result)
    return 0


def cmd_plan(args) -> int:
    from xlaopt.planning.defaults import plan_program, prepare_devices

    if args.serve is not None:
        return _plan_serving(args)
    prepare_devices(args.target, args.topology)
    from xlaopt.analysis.topology import parse_topology

    old = None
    if args.from_layout is not None:
        from xlaopt.layout import load_layout

        old = load_layout(args.from_layout)
        if args.model is None:
            args.model = old.model
    if args.model is None:
        raise UserError("--model is required (or --from a layout file that names its model)")
    if old is not None:
        old.check_model(args.model, args.from_layout)
    topology = parse_topology(args.topology)
    config = get_config(args.model, parse_overrides(args.model, args.set))
    args.batch_size = args.text_len = args.gen_len = None
    _apply_global_batch(args, config)
    program, batch, target_note = plan_program(args, config, topology, old)
    from xlaopt.context import PassContext
    from xlaopt.passes.layout_plan import LayoutPlan

    planner = LayoutPlan(enabled=True, top=args.top, exhaustive=args.exhaustive)
    result = planner.plan_with(program, PassContext.for_program(program, topology), batch)
    report = result["report"]
    report["target_note"] = target_note
    from xlaopt.planning.report import format_plan

    print(format_plan(report, args.rows))
    if target_note:
        print(f"note: {target_note}")
    if old is not None:
        from xlaopt.planning.replan import format_resharding, resharding

        moves = resharding(old, result["layout"], config)
        report["resharding"] = moves
        print(format_resharding(moves))
    if args.out:
        from xlaopt.layout import save_layout

        save_layout(result["layout"], args.out)
        print(f"best layout written to {args.out}")
    _write_json(args.json, report)
    return 0


def _plan_serving(args) -> int:
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.inference.sample_cosmos import check_guidance
    from xlaopt.planning import serving

    if args.model is None:
        raise UserError("--model is required")
    config = get_config(args.model, parse_overrides(args.model, args.set))
    topology = parse_topology(args.topology)
    rows = args.global_batch or (8 if args.serve == "decode" else 1)
    if args.serve == "denoise" and check_guidance(args.guidance) != 1.0:
        rows *= 2  # both guidance branches in one batch
    request = serving.Request(args.serve, rows, args.context, args.text_tokens, args.gen_tokens)
    ranked = serving.plan_serving(config, topology, request)
    print(serving.format_serving(config, topology, request, ranked))
    best = next((p for p in ranked if not p.reason), None)
    if best is None:
        raise UserError(f"no serving layout of {config.name} fits {topology.name}: "
                        f"{ranked[0].reason} at best; serve fewer rows or a shorter context, or on more devices")
    if args.out:
        from xlaopt.layout import Layout, save_layout

        save_layout(Layout(best.mesh, model=config.name, topology=topology.name), args.out)
        print(f"best layout written to {args.out}")
    _write_json(args.json, {"model": config.name, "topology": topology.name, **serving.report(ranked, request)})
    return 0


def cmd_generate(args) -> int:
    from xlaopt.runtime.generate import format_generation, generate

    result = generate(args, _layout)
    print(format_generation(result))
    _write_json(args.json, result)
    return 0


def cmd_models(args) -> int:
    from xlaopt.families import family_of
    from xlaopt.program import TrainProgram, TrainSettings
    from xlaopt.step import param_count

    rows = []
    shape_fields = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size")
    for name in registered_models():
        c = get_config(name)
        program = TrainProgram(c, settings=TrainSettings(family_of(c).default_batch(c)))
        # A CNN has no transformer shape: its fields are absent (None), printed as "-".
        rows.append({"name": name, "family": c.family, "param_count": param_count(program),
                     **{f: getattr(c, f, None) for f in shape_fields}})
    cell = lambda v: "-" if v is None else v  # noqa: E731
    print(f"{'model':<16}{'family':>8}{'params':>10}  {'d_model':>7} {'layers':>6} {'heads':>5} {'kv':>3} {'mlp':>6}")
    for r in rows:
        print(f"{r['name']:<16}{r['family']:>8}{_human(r['param_count']):>10}  {cell(r['d_model']):>7} "
              f"{cell(r['num_layers']):>6} {cell(r['num_heads']):>5} {cell(r['num_kv_heads']):>3} {cell(r['mlp_dim']):>6}")
    print("params: counted from the abstract parameter tree (Cosmos 3: both towers, embedding, LM head, "
          "generator I/O; the reasoner's ViT image encoder is not modelled and not counted).")
    _write_json(args.json, {"models": rows})
    return 0


def cmd_passes(args) -> int:
    from xlaopt.pipeline import pipeline

    for i, p in enumerate(pipeline(), start=1):
        print(f"{i:2d}. {p.name:<24} {p.summary}")
        options = [f"{f.name}={getattr(p, f.name)!r}" for f in dataclasses.fields(p) if f.name not in ("name", "summary")]
        if options:
            print(f"    {'':<24} options (--pass-option {p.name}.FIELD=VALUE): {', '.join(options)}")
    return 0


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def cmd_data(args) -> int:
    from xlaopt.data.store import SampleStore

    if args.data_command == "make":
        config, shard_bytes = get_config(args.model), int(args.shard_mb * 2**20)
        if args.mix is None:
            from xlaopt.data.synthetic_store import DEFAULT_SAMPLES, make_store

            samples = DEFAULT_SAMPLES if args.samples is None else args.samples
            manifest = make_store(args.dir, config, samples, args.seed, shard_bytes)
        else:
            from xlaopt.data.mixes import get_mix, latent_bytes
            from xlaopt.data.synthetic_store import make_mix_store

            mix = get_mix(args.mix)
            samples = mix.default_samples if args.samples is None else args.samples
            if samples >= 1 and config.family == "cosmos3":
                print(f"{args.dir}: writing {samples} samples of {mix.name} at {config.name}'s widths, "
                      f"~{latent_bytes(mix.lengths(samples, args.seed), config) / 1e6:.0f} MB of latents")
            manifest = make_mix_store(args.dir, config, mix, samples, args.seed, shard_bytes)
        size = sum(f.stat().st_size for f in pathlib.Path(args.dir).rglob("*") if f.is_file())
        print(f"{args.dir}: store size {size / 1e6:.1f} MB")
    else:
        manifest = SampleStore(args.dir).manifest
        _write_json(args.json, manifest)
    stats = manifest["stats"]
    print(f"{args.dir}: {manifest['num_samples']} samples in {len(manifest['shards'])} shards; "
          + ", ".join(f"{k} {v}" for k, v in stats["modalities"].items()))
    for key in ("text_tokens", "gen_tokens", "tokens"):
        q = stats[key]
        print(f"  {key:<12} mean {q['mean']:.1f}  p50 {q['p50']:.0f}  p90 {q['p90']:.0f}  p99 {q['p99']:.0f}  max {q['max']}")
    return 0


def cmd_parity(args) -> int:
    from xlaopt.interop.parity import cmd_parity as run

    return run(args)


def cmd_import_weights(args) -> int:
    from xlaopt.interop.parity import cmd_import_weights as run

    return run(args)


def cmd_calibrate(args) -> int:
    from xlaopt.analysis.calibrate import format_refit, format_table, main_calibrate

    result = main_calibrate(args.runs, args.json, method=args.method, refit_only=args.fit)
    print(format_refit(result) if args.fit else format_table(result))
    return 0


def cmd_ckpt(args) -> int:
    from xlaopt.checkpoint import catalog

    if args.ckpt_command == "ls":
        result = catalog.listing(args.dir)
        print(f"{'step':>10} {'size':>10} {'leaves':>7} {'files':>6} {'procs':>5}")
        for r in result["steps"]:
            print(f"{r['step']:>10} {r['bytes'] / 1e6:>8.1f}MB {r['leaves']:>7} {r['files']:>6} {r['process_count']:>5}")
        if result["debris"]:
            print(f"interrupted saves (removed at the next training start): {', '.join(result['debris'])}")
        code = 0
    elif args.ckpt_command == "verify":
        result = catalog.verify(args.dir, args.step)
        for step, faults in result["steps"].items():
            print(f"step {step}: " + ("ok" if not faults else f"{len(faults)} fault(s)"))
            for fault in faults:
                print(f"  {fault}")
        code = 0 if result["ok"] else 1
    elif args.ckpt_command == "diff":
        result = catalog.diff(args.a, args.b, args.step)
        print(f"{args.a} (step {result['steps'][0]}) vs {args.b} (step {result['steps'][1]}): "
              + ("identical" if result["identical"] else "differ"))
        for what in ("differing", "only_in_a", "only_in_b"):
            for name in result[what]:
                print(f"  {what.replace('_', ' ')}: {name}")
        if not result["data_state_equal"]:
            print("  the data positions differ")
        code = 0 if result["identical"] else 1
    else:
        result = catalog.describe(args.dir, args.step)
        print(f"step {result['step']}: {len(result['leaves'])} leaves, {sum(result['files'].values()) / 1e6:.1f} MB "
              f"in {len(result['files'])} files, saved by {result['process_count']} process(es)")
        for leaf in result["leaves"]:
            sharding = leaf["sharding"]
            where = f"  {sharding['spec']} on {sharding['mesh']}" if sharding else ""
            print(f"  {leaf['name']:<56} {leaf['dtype']:>8} {str(leaf['shape']):<16}{where}")
        meta = result["meta"]
        if meta.get("model"):
            print(f"model {meta['model']}, seed {meta.get('seed')}, data position {meta.get('data')}")
        code = 0
    _write_json(args.json, result)
    return code


def cmd_bench(args) -> int:
    from xlaopt.benchmarks import disk

    disk.allow_system_drop()  # cold reads via drop_caches where root; library callers evict per file
    row = None
    if args.bench_command == "data" and args.mix is not None:
        from xlaopt.benchmarks.data import MODEL
        from xlaopt.data.mixes import get_mix
        from xlaopt.data.synthetic_store import mix_store

        mix = get_mix(args.mix)
        args.store, row = str(mix_store(get_config(MODEL), mix)), mix.row
    if args.bench_command == "data" and args.io:
        from xlaopt.benchmarks import data_io

        result = data_io.run_io(args.store, args.repeats, progress=print, scratch_dir=args.dir)
        print(data_io.format_io_table(result))
        _write_json(args.json, result)
        return 0
    if args.bench_command == "data":
        from xlaopt.benchmarks import data as bench
        result = bench.run(args.store, args.steps, args.repeats, progress=print, row=row)
    else:
        if args.devices < 1:
            raise UserError(f"--devices {args.devices}: need at least one device")
        request_cpu_devices(args.devices)
        from xlaopt.benchmarks import checkpoint as bench
        result = bench.run(args.size_gb, args.repeats, args.dir, progress=print)
    print(bench.format_table(result))
    _write_json(args.json, result)
    return 0


_COMMANDS = {"train": cmd_train, "verify": cmd_verify, "inspect": cmd_inspect, "analyze": cmd_analyze, "plan": cmd_plan,
             "models": cmd_models,
             "passes": cmd_passes, "data": cmd_data, "ckpt": cmd_ckpt, "bench": cmd_bench,
             "calibrate": cmd_calibrate, "parity": cmd_parity, "import-weights": cmd_import_weights,
             "generate": cmd_generate}

if __name__ == "__main__":
    sys.exit(main())
