"""Flags that several commands share, registered on each command's own parser."""
from __future__ import annotations

import argparse

CLUSTER_HELP = ("the cluster the mesh is laid on, e.g. h100:2x4 or a TOML/JSON file: passes that act on its nodes "
                "(hierarchical-grads) use them; default: in a multi-process job each process's devices are a node")


def model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, help="registered model name (see `xlaopt models`)"
                   + ("" if required else "; with --ckpt, default: the checkpoint's own"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set num_layers=2 (repeatable)")


def compile_cache_args(p: argparse.ArgumentParser) -> None:
    """The commands that compile take it; `main` points JAX's persistent cache there first."""
    p.add_argument("--compile-cache", default=None, metavar="DIR|off",
                   help="JAX's persistent compilation cache: a start or restart loads the programs an earlier run "
                        "compiled (default: $XLAOPT_CACHE/jax-compile, else ~/.cache/xlaopt/jax-compile; off: none)")
    p.add_argument("--verbose", action="store_true",
                   help="let XLA's own log lines through as they are while compiling (by default each kind of "
                        "trouble they report becomes one note beside the answer)")


def program_args(p: argparse.ArgumentParser, default_dtype: str) -> None:
    model_args(p)
    compile_cache_args(p)
    p.add_argument("--mesh", default="", help="mesh axes, e.g. data=2,fsdp=2,tensor=2 (size-1 axes may be omitted)")
    p.add_argument("--layout", default=None, metavar="FILE",
                   help="a layout file (TOML/JSON: mesh, device order, rules, batch, execution; see xlaopt.layout, "
                        "written by `xlaopt plan --out`) instead of --mesh; sizes and --exec given here override its own")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="split the residual stream (norms, residual adds) over the tensor ranks along the sequence: "
                        "tensor parallel's all-reduces become reduce-scatters and all-gathers (Megatron's sequence "
                        "parallelism); a choice of the rule table, also in a layout file's rules")
    p.add_argument("--dtype", default=None,
                   help=f"compute dtype, the execution setting compute_dtype (default: the layout's, else {default_dtype})")
    p.set_defaults(default_dtype=default_dtype)
    p.add_argument("--exec", action="append", default=[], metavar="KEY=VALUE",
                   help="an execution setting (xlaopt.execution: remat, attention, attention_block, layer_stack, "
                        "micro_batches, sharded_optimizer (ZeRO-1), grad_reduce_dtype, grad_accumulate_dtype, "
                        "loss_scale_init, loss_scale_growth_interval), e.g. --exec remat=full (repeatable); a resume accepts any")
    p.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an XLA compiler option, e.g. --xla-option xla_cpu_enable_fast_math=false (repeatable)")
    p.add_argument("--pass-option", action="append", default=[], metavar="PASS.FIELD=VALUE",
                   help="a pass's option, e.g. --pass-option mesh-layout.constrain_activations=false (repeatable)")
    p.add_argument("--batch-size", type=int, default=None, help="packed rows per step (default: the model family's)")
    p.add_argument("--text-len", type=int, default=None, help="text (reasoner) tokens per packed row")
    p.add_argument("--gen-len", type=int, default=None, help="generator tokens per packed row (Cosmos 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainable", default="all", metavar="SET",
                   help="which parameters train, the rest frozen (no gradients, no optimizer state): all (default), "
                        "or a set the model family names (Cosmos 3: generator, NVIDIA's vision fine-tuning set)")
    p.add_argument("--passes", default=None, help="run only these passes (comma-separated, pipeline order)")
    p.add_argument("--disable", default="", help="skip these passes (comma-separated)")
    p.add_argument("--dump-hlo", default=None, metavar="DIR",
                   help="write the lowered and compiled HLO before the pipeline and after each pass")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON")


def global_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-batch", type=int, default=None, metavar="B",
                   help="rows (sequences) per optimizer step over all devices; the same as --batch-size")
    p.add_argument("--seq", type=int, default=None, metavar="S",
                   help="tokens per row: a decoder's sequence length; for Cosmos 3 a row's text + generator "
                        "tokens, split in the ratio of the mix's row budget (--mix) or the family default's")


def serving_args(p: argparse.ArgumentParser, what: str) -> None:
    """--serve and what each serving mode asks for, shared by `plan` (analytic) and `analyze` (compiled)."""
    g = p.add_argument_group(f"serving ({what}: no gradients or optimizer state)")
    g.add_argument("--serve", default=None, choices=("decode", "denoise", "video"),
                   help="instead of a training step: a KV-cached decode step (rows from --global-batch, default 8), "
                        "one Cosmos 3 denoising step (clips from --global-batch, default 1), or a whole Cosmos 3 "
                        "text-to-video request (prompt, denoising steps, VAE decode) in seconds a video")
    g.add_argument("--context", type=int, default=8192, help="decode: cached tokens a row (default 8192)")
    g.add_argument("--text-tokens", type=int, default=512, help="denoise: prompt tokens a row (default 512)")
    g.add_argument("--gen-tokens", type=int, default=7680,
                   help="denoise: generator tokens a row (default 7680, a 480p clip of cosmos3-480p)")
    g.add_argument("--guidance", type=float, default=None,
                   help="denoise, video: CFG scale; above 1 both branches run (default: denoise 3, video NVIDIA's 6)")
    g.add_argument("--resolution", default="720p", help="video: the resolution tier, 256p, 480p or 720p (default 720p)")
    g.add_argument("--frames", type=int, default=189, help="video: frames, 4k+1 (default 189, 7.9 s at 24 fps)")
    g.add_argument("--steps", type=int, default=35, help="video: denoising steps (default NVIDIA's 35)")
    g.add_argument("--prompt-tokens", type=int, default=None,
                   help="video: the prompt's tokens (default 1700, NVIDIA's benchmark prompt estimated)")
    g.add_argument("--negative-tokens", type=int, default=None,
                   help="video: the negative prompt's tokens (default 3700, NVIDIA's default estimated)")
    g.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                   help="video: run the whole joint sequence every step, as NVIDIA's PyTorch reference did when "
                        "its times were published (default: xlaopt's sampler, the prompt's K/V computed once)")
