"""The frozen requests commands parse their arguments into, and what they share.

Nothing here imports JAX: `xlaopt --help` and the cheap commands build these too."""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any


def request_of(cls, args: argparse.Namespace, **resolved: Any):
    """A `cls` (a frozen dataclass) of the parsed arguments: each field from the argument of its
    name unless given in `resolved`; lists (repeatable flags) as tuples, so the request hashes."""
    values = {}
    for field in dataclasses.fields(cls):
        value = resolved[field.name] if field.name in resolved else getattr(args, field.name)
        values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class ProgramRequest:
    """The flags that describe a program (`flags.program_args`)."""
    model: str
    overrides: tuple[str, ...]  # --set
    mesh: str
    layout: str | None
    sequence_parallel: bool
    dtype: str | None
    default_dtype: str  # the command's, when neither --dtype nor a layout file says
    execution_settings: tuple[str, ...]  # --exec
    xla_options: tuple[str, ...]
    pass_options: tuple[str, ...]
    batch_size: int | None
    text_len: int | None
    gen_len: int | None
    seed: int
    trainable: str
    passes: str | None
    disable: str
    dump_hlo: str | None
    json: str | None
    topology: str | None

    @classmethod
    def of(cls, args: argparse.Namespace) -> ProgramRequest:
        return request_of(cls, args, overrides=args.set, execution_settings=args.exec,
                          xla_options=args.xla_option, pass_options=args.pass_option)


@dataclasses.dataclass(frozen=True)
class RowSource:
    """Where rows come from: `data` a sample store's directory, "memory" (the in-memory stream)
    or None (the command's default); `mix` a named mix; `skip_oversize` as the flag."""
    data: str | None = "memory"
    mix: str | None = None
    skip_oversize: bool = False


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """`--global-batch` and `--seq` (`flags.global_batch_args`)."""
    global_batch: int | None = None
    seq: int | None = None


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)


@dataclasses.dataclass(frozen=True)
class ServingRequest:
    """The flags of `flags.serving_args`; `mode` None: a training step, not serving."""
    mode: str | None
    context: int
    text_tokens: int
    gen_tokens: int
    guidance: float | None
    resolution: str
    frames: int
    steps: int
    prompt_tokens: int | None
    negative_tokens: int | None
    prompt_cache: bool

    @classmethod
    def of(cls, args: argparse.Namespace) -> "ServingRequest":
        return request_of(cls, args, mode=args.serve)

    def denoise_guidance(self) -> float:
        from xlaopt.inference.sample_cosmos import check_guidance

        return check_guidance(3.0 if self.guidance is None else self.guidance)

    def profile(self):
        """The video request (`inference.video_profile.VideoProfile`): NVIDIA's defaults where not given."""
        from xlaopt.inference.sample_cosmos import check_guidance
        from xlaopt.inference.video_profile import VideoProfile

        given = {k: v for k, v in (("guidance", self.guidance), ("prompt_tokens", self.prompt_tokens),
                                   ("negative_tokens", self.negative_tokens)) if v is not None}
        if "guidance" in given:
            check_guidance(given["guidance"])
        return VideoProfile(resolution=self.resolution, frames=self.frames, steps=self.steps, **given)
