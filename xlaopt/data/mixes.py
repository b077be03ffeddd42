"""Named Cosmos 3 sample mixes whose sample shapes are real (the latents are random).

Shapes follow from the architecture facts in shared/docs/cosmos3-architecture.md: the Wan2.2
VAE compresses 4x16x16 (time x height x width) and the generator patchifies latents 2x2, so a
clip of F frames is 1 + (F-1)//4 latent frames (the first frame alone, then four per latent) of
(height/32 x width/32) tokens, an image one latent frame; sound is 25 latents per second;
actions come one per video frame at the clip's frame rate. The parts' weights are our
assumption (NVIDIA publishes no proportions), chosen so that rows of the mix's budget pack
full (tests/test_mixes.py measures it); the token counts are derived from the cited facts.

The shapes of a mix's samples are drawn first and vectorised from `seed`, the token ids and
latents after them from a second stream, so `Mix.lengths` prices a store without making it.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Iterator

import numpy as np

from xlaopt.data.sample import MODALITY_NAMES, TEXT_ONLY, Sample
from xlaopt.errors import UserError
from xlaopt.models.cosmos3 import ACTION, SOUND, VIDEO
from xlaopt.models.cosmos3_config import Cosmos3Config

VAE_FRAMES_PER_LATENT = 4  # Wan2.2: the first frame is a latent frame alone, then 4 frames each
SOUND_LATENTS_PER_S = 25
FIRST_TEXT_ID = 16  # ids below are the toy stream's class ids (synthetic_cosmos); kept clear
# Token grids (height, width) of one latent frame: pixels / 16 (VAE) / 2 (patches), rounded down,
# except 720p, taken as the doc publishes it (40 x 23 = 920; 720 / 32 = 22.5 is rounded up there).
# 480p buckets: 848x480, 480x848, 640x480, 480x640, 640x640 pixels, about the same area each.
GRID_480P = {"16:9": (15, 26), "9:16": (26, 15), "4:3": (15, 20), "3:4": (20, 15), "1:1": (20, 20)}
GRID_720P = (23, 40)
GRID_256P = (8, 14)  # 448 x 256


class MixError(UserError):
    pass


def latent_frames(frames: np.ndarray) -> np.ndarray:
    return 1 + (np.asarray(frames) - 1) // VAE_FRAMES_PER_LATENT


def clip_frames(lo: int, hi: int) -> tuple[int, ...]:
    """The VAE's natural clip lengths (4k + 1 frames) from `lo` to `hi` frames."""
    return tuple(f for f in range(1, hi + 1, VAE_FRAMES_PER_LATENT) if f >= lo)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The shapes of drawn samples, one entry each; no token ids, no latents."""
    modality: np.ndarray  # int64 [n]
    n_text: np.ndarray  # int64 [n]
    grid: np.ndarray  # int64 [n, 3]: video (latent frames, height, width); else (n_gen, 1, 1); text (0, 0, 0)
    n_clean: np.ndarray  # int64 [n]
    fps: np.ndarray  # float64 [n]; 0 where none is stated (images, sound, text)

    @property
    def n_gen(self) -> np.ndarray:
        return self.grid.prod(axis=1)

    def lengths(self) -> np.ndarray:
        return np.stack([self.modality, self.n_text, self.n_gen, self.n_clean], axis=1).astype(np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Part:
    """One kind of sample in a mix: a share of the samples and how their shapes are drawn."""
    name: str
    weight: float  # share of the mix's samples (normalised over its parts)
    text: tuple[int, int]  # caption / prompt tokens, drawn uniformly from this closed range
    modality: ClassVar[int] = TEXT_ONLY

    def gen_range(self) -> tuple[int, int]:
        return 0, 0

    def draw_gen(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """grid [n, 3], n_clean [n], fps [n] of `n` samples."""
        return np.zeros((n, 3), np.int64), np.zeros(n, np.int64), np.zeros(n)

    def draw(self, rng: np.random.Generator, n: int) -> Shapes:
        n_text = rng.integers(self.text[0], self.text[1] + 1, n)
        grid, n_clean, fps = self.draw_gen(rng, n)
        return Shapes(np.full(n, self.modality, np.int64), n_text, grid, n_clean, fps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextOnly(Part):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class Video(Part):
    """Images (frames (1,)) or clips, on one of `grids` (a latent frame's tokens, height x width)."""
    grids: tuple[tuple[int, int], ...]
    frames: tuple[int, ...] = (1,)
    fps: tuple[float, ...] = ()  # a clip's frame rate, drawn from these; () for images
    clean_first: bool = False  # image-to-video: the first latent frame is clean conditioning
    modality: ClassVar[int] = VIDEO

    def gen_range(self) -> tuple[int, int]:
        sizes = [h * w for h, w in self.grids]
        return int(latent_frames(min(self.frames))) * min(sizes), int(latent_frames(max(self.frames))) * max(sizes)

    def draw_gen(self, rng, n):
        hw = np.asarray(self.grids, np.int64)[rng.integers(len(self.grids), size=n)]
        t = latent_frames(rng.choice(np.asarray(self.frames, np.int64), n))
        fps = rng.choice(np.asarray(self.fps, float), n) if self.fps else np.zeros(n)
        n_clean = hw.prod(axis=1) if self.clean_first else np.zeros(n, np.int64)
        return np.column_stack([t, hw]), n_clean, fps


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sound(Part):
    seconds: tuple[float, float]
    modality: ClassVar[int] = SOUND

    def gen_range(self) -> tuple[int, int]:
        return round(self.seconds[0] * SOUND_LATENTS_PER_S), round(self.seconds[1] * SOUND_LATENTS_PER_S)

    def draw_gen(self, rng, n):
        lo, hi = self.gen_range()
        return _track(rng.integers(lo, hi + 1, n)), np.zeros(n, np.int64), np.zeros(n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Actions(Part):
    """Robot actions of one embodiment, one per video frame of a clip at `fps`."""
    seconds: tuple[float, float]
    fps: tuple[float, ...]
    modality: ClassVar[int] = ACTION

    def gen_range(self) -> tuple[int, int]:
        return round(self.seconds[0] * min(self.fps)), round(self.seconds[1] * max(self.fps))

    def draw_gen(self, rng, n):
        fps = rng.choice(np.asarray(self.fps, float), n)
        lo, hi = np.round(self.seconds[0] * fps).astype(np.int64), np.round(self.seconds[1] * fps).astype(np.int64)
        return _track(rng.integers(lo, hi + 1)), np.zeros(n, np.int64), fps


def _track(n_gen: np.ndarray) -> np.ndarray:
    return np.column_stack([n_gen, np.ones_like(n_gen), np.ones_like(n_gen)])


@dataclasses.dataclass(frozen=True)
class Mix:
    name: str
    description: str  # one line
    source: str  # the facts and configs its shapes come from
    parts: tuple[Part, ...]
    row: tuple[int, int]  # the (text, generator) row budget the weights were chosen for
    default_samples: int  # what `xlaopt data make --mix` and `train --mix` write

    def __post_init__(self):
        if not self.parts or min(p.weight for p in self.parts) <= 0:
            raise MixError(f"mix {self.name}: needs parts, each of positive weight")
        if len({p.name for p in self.parts}) != len(self.parts):
            raise MixError(f"mix {self.name}: part names repeat")

    def shapes(self, rng: np.random.Generator, samples: int) -> Shapes:
        """Shapes of `samples` samples: the part of each, then every part's samples at once."""
        w = np.asarray([p.weight for p in self.parts], float)
        part = rng.choice(len(self.parts), samples, p=w / w.sum())
        out = Shapes(np.zeros(samples, np.int64), np.zeros(samples, np.int64), np.zeros((samples, 3), np.int64),
                     np.zeros(samples, np.int64), np.zeros(samples))
        for k, p in enumerate(self.parts):
            where = np.flatnonzero(part == k)
            drawn = p.draw(rng, len(where))
            for f in dataclasses.fields(Shapes):
                getattr(out, f.name)[where] = getattr(drawn, f.name)
        return out

    def lengths(self, samples: int, seed: int = 0) -> np.ndarray:
        """int64 [samples, 4]: modality, n_text, n_gen, n_clean of what `draw_many(samples, seed)` yields."""
        return self.shapes(np.random.default_rng([seed, 0]), samples).lengths()

    def draw_many(self, samples: int, seed: int, config: Cosmos3Config) -> Iterator[Sample]:
        """The samples a store of this mix holds: shapes from one stream, contents from another."""
        shapes = self.shapes(np.random.default_rng([seed, 0]), samples)
        rng = np.random.default_rng([seed, 1])
        return (_sample(shapes, i, rng, config) for i in range(samples))

    def draw(self, rng: np.random.Generator, config: Cosmos3Config) -> Sample:
        return _sample(self.shapes(rng, 1), 0, rng, config)

    def smallest(self) -> tuple[int, int]:
        """(text, generator) tokens of the mix's smallest possible sample (fewest tokens)."""
        return min(((p.text[0], p.gen_range()[0]) for p in self.parts), key=sum)

    def largest(self) -> tuple[int, int]:
        """The most text and the most generator tokens a sample can have: the row budget that
        holds every sample of the mix."""
        return max(p.text[1] for p in self.parts), max(p.gen_range()[1] for p in self.parts)

    def check_row(self, text_len: int, gen_len: int, skip_oversize: bool = False) -> None:
        """Raise MixError when rows of (text_len, gen_len) tokens hold no sample of the mix, or,
        unless `skip_oversize`, not all of them: before a store is made for such rows."""
        most = self.largest()
        if not any(p.text[0] <= text_len and p.gen_range()[0] <= gen_len for p in self.parts):
            raise MixError(f"mix {self.name}: rows of ({text_len}, {gen_len}) text and generator tokens hold none "
                           f"of its samples; the smallest needs {self.smallest()}, {most} holds every one (the "
                           f"mix is weighted for rows of {self.row}); raise --text-len/--gen-len")
        if not skip_oversize and (text_len < most[0] or gen_len < most[1]):
            raise MixError(f"mix {self.name}: rows of ({text_len}, {gen_len}) text and generator tokens cannot hold "
                           f"its largest samples; {most} holds every one (the mix is weighted for rows of "
                           f"{self.row}); raise --text-len/--gen-len, or skip the longer samples with --skip-oversize")


def latent_widths(config: Cosmos3Config) -> dict[int, int]:
    """modality -> latent width of a sample: the store's widths."""
    return {VIDEO: config.latent_patch_dim, ACTION: config.action_dim, SOUND: config.sound_dim}


def latent_bytes(lengths: np.ndarray, config: Cosmos3Config) -> int:
    """Bytes of float32 latents the samples of `lengths` (as `Mix.lengths` gives) hold at `config`'s widths."""
    per_token = np.zeros(max(MODALITY_NAMES) + 1, np.int64)
    for modality, width in latent_widths(config).items():
        per_token[modality] = 4 * width
    return int((per_token[lengths[:, 0]] * lengths[:, 2]).sum())


def _sample(shapes: Shapes, i: int, rng: np.random.Generator, config: Cosmos3Config) -> Sample:
    text = rng.integers(FIRST_TEXT_ID, config.vocab_size, int(shapes.n_text[i]), dtype=np.int32)
    modality = int(shapes.modality[i])
    if modality == TEXT_ONLY:
        return Sample(text)
    width = latent_widths(config)[modality]
    grid = tuple(int(g) for g in shapes.grid[i])
    latents = rng.standard_normal((int(np.prod(grid)), width), dtype=np.float32)
    domain = int(rng.integers(config.num_action_domains)) if modality == ACTION else 0
    return Sample(text, modality, latents, grid, domain, int(shapes.n_clean[i]), float(shapes.fps[i]) or None)


MIXES: dict[str, Mix] = {}


def register(mix: Mix) -> Mix:
    if mix.name in MIXES:
        raise MixError(f"mix {mix.name} is registered twice")
    MIXES[mix.name] = mix
    return mix


def get_mix(name: str) -> Mix:
    if name not in MIXES:
        raise MixError(f"unknown mix {name!r}; registered mixes: {', '.join(sorted(MIXES))}")
    return MIXES[name]


_FACTS = ("shared/docs/cosmos3-architecture.md: Wan2.2 VAE 4x16x16 then 2x2 patches, 48 latent frames per "
          "189-frame clip, 920 tokens per 720p latent frame, sound 25 latents/s, base fps 24")
_ASPECTS_480P = tuple(GRID_480P.values())

# Pretraining at 480p: images of five aspect buckets, 1-3 s clips that fit one 7,680-token
# generator region (73 frames: 19 x 390 = 7,410), 1-8 s 256p clips, and small text, sound and
# action samples that fill the gaps. The weights are our assumption; the shapes are derived from
# the facts above. They put text : generator tokens at about 0.056, a little under the row's
# 512 : 7,680 = 0.067 on purpose: the loader fills rows oldest-first, and a generator surplus
# keeps the region holding 94% of the slots full (rows pack ~99% full; tests/test_mixes.py).
register(Mix(
    name="cosmos3-480p",
    description="pretraining: 480p images and 1-3 s clips, 256p clips, text, sound and robot actions, "
                "many samples per row of 512 + 7,680 tokens",
    source=_FACTS + "; 480p = 848x480 -> 26 x 15 tokens per latent frame; weights are our assumption",
    parts=(
        Video(name="image", weight=0.15, text=(16, 96), grids=_ASPECTS_480P),
        Video(name="text2video-480p", weight=0.11, text=(48, 256), grids=(GRID_480P["16:9"], GRID_480P["9:16"]),
              frames=clip_frames(25, 73), fps=(24.0, 30.0)),
        Video(name="image2video-480p", weight=0.045, text=(24, 160), grids=(GRID_480P["16:9"],),
              frames=clip_frames(25, 73), fps=(24.0, 30.0), clean_first=True),
        Video(name="text2video-256p", weight=0.045, text=(32, 192), grids=(GRID_256P,),
              frames=clip_frames(25, 189), fps=(24.0,)),
        TextOnly(name="text", weight=0.31, text=(8, 96)),
        Sound(name="sound", weight=0.15, text=(8, 24), seconds=(1, 8)),
        Actions(name="action", weight=0.19, text=(8, 24), seconds=(1, 8), fps=(24.0, 30.0)),
    ),
    row=(512, 7680),
    default_samples=2_000,
))

# Fine-tuning at 720p: one default 189-frame clip (48 latent frames x 920 = 44,160 tokens) and its
# prompt per row of NVIDIA's fine-tuning packing limit, 45,056 = 896 + 44,160.
register(Mix(
    name="cosmos3-720p",
    description="fine-tuning: one 189-frame 720p clip (44,160 tokens) and its prompt per row of 45,056",
    source=_FACTS + "; 45,056-token fine-tuning packing limit (cosmos-framework configs)",
    parts=(
        Video(name="text2video-720p", weight=0.8, text=(100, 800), grids=(GRID_720P,), frames=(189,),
              fps=(24.0,)),
        Video(name="image2video-720p", weight=0.2, text=(100, 800), grids=(GRID_720P,), frames=(189,),
              fps=(24.0,), clean_first=True),
    ),
    row=(896, 44160),
    default_samples=16,
))

# Mid-training: longer and sharper clips (2-8 s at 720p and 480p), 720p images, and the small
# fillers of pretraining, in rows of NVIDIA's mid-training packing limit, 74,000 tokens; the
# 2,048-token text region and the weights are our assumption.
register(Mix(
    name="cosmos3-mid",
    description="mid-training: 2-8 s 720p and 480p clips, 720p images, text, sound and robot actions in "
                "rows of 74,000 = 2,048 + 71,952 tokens",
    source=_FACTS + "; 74,000-token mid-training packing limit (cosmos-framework configs); weights and the "
                    "text region are our assumption",
    parts=(
        Video(name="text2video-720p", weight=0.16, text=(100, 800), grids=(GRID_720P,),
              frames=clip_frames(49, 189), fps=(24.0, 30.0)),
        Video(name="image2video-720p", weight=0.05, text=(100, 800), grids=(GRID_720P,),
              frames=clip_frames(49, 189), fps=(24.0, 30.0), clean_first=True),
        Video(name="text2video-480p", weight=0.12, text=(64, 512), grids=(GRID_480P["16:9"], GRID_480P["9:16"]),
              frames=clip_frames(49, 189), fps=(24.0, 30.0)),
        Video(name="image-720p", weight=0.15, text=(16, 160), grids=(GRID_720P, GRID_720P[::-1])),
        TextOnly(name="text", weight=0.20, text=(8, 256)),
        Sound(name="sound", weight=0.15, text=(8, 24), seconds=(1, 8)),
        Actions(name="action", weight=0.17, text=(8, 24), seconds=(1, 8), fps=(24.0, 30.0)),
    ),
    row=(2048, 71952),
    default_samples=200,
))
