"""`xlaopt generate`: sample from a model (its own random init, or a checkpoint): video or text."""
from __future__ import annotations

import argparse

from xlaopt.cli import flags
from xlaopt.cli.requests import write_json


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample from a model (its own random init, or --ckpt): Cosmos 3 video by "
                                        "rectified flow with the reasoner's K/V cached (timed against uncached), "
                                        "or text by KV-cached decoding (decoder LLMs; Cosmos 3 with --decode-text)")
    flags.model_args(p, required=False)
    flags.compile_cache_args(p)
    p.add_argument("--ckpt", default=None, metavar="DIR",
                   help="sample from this checkpoint's parameters (`xlaopt train --ckpt` or `import-weights` "
                        "output); its model is the one it was saved from")
    p.add_argument("--ckpt-step", type=int, default=None, metavar="N", help="the checkpoint's step (default: newest)")
    p.add_argument("--mesh", default="", help="mesh axes, e.g. tensor=2 or data=2,tensor=2: parameters as training "
                                              "lays them out, rows over data/fsdp (with guidance each branch on its own group: "
                                              "CFG parallel); video: context splits each row's positions (Ulysses)")
    p.add_argument("--layout", default=None, metavar="FILE", help="a layout file instead of --mesh (e.g. from "
                                                                   "`plan --serve`; its execution applies)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the layout's, else float32)")
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


def main(args: argparse.Namespace) -> int:
    # Imported here, not at the top: xlaopt.runtime.generate imports JAX, which `xlaopt --help` must not.
    from xlaopt.cli.requests import request_of
    from xlaopt.runtime.generate import GenerateRequest, format_generation, generate

    request = request_of(GenerateRequest, args, overrides=args.set)
    result = generate(request)
    print(format_generation(result))
    write_json(args.json, result)
    return 0
