"""What a Cosmos 3 text-to-video request asks for: NVIDIA's generation profile, its resolution
tiers, and the generator tokens a clip becomes.

Sources (NVIDIA/cosmos-framework, the code behind NVIDIA/cosmos docs/reference/benchmarks.md's
PyTorch rows, read at its 2026-06-07 snapshot 3a5314b and at HEAD 5eee9ed):
  - `cosmos_framework/inference/defaults/text2video/sample_args.json`: 35 steps, guidance 6.0,
    shift 10.0, 24 fps, 189 frames, aspect 16:9, a negative prompt from `neg_prompts.json`;
    the sampler is UniPC (`inference/args.py`, `OmniSetupOverrides.sampler`);
  - `data/generator/utils.py` `VIDEO_RES_SIZE_INFO` at 16:9: 256 -> 320x192, 480 -> 832x480,
    720 -> 1280x720; `inference/args.py` caps the frames a tier takes (256: 400, 480: 300,
    720: 200) and holds a per-tier shift (3 / 5 / 10, also the training shifts), which the
    defaults file's shift 10 overrides at every tier;
  - `configs/model/Cosmos3-Nano.yaml`: the Wan2.2 VAE, 16x spatial and 4x temporal compression,
    48 channels, 2x2 patches; `cosmos3_vfm_network.py` pads an odd latent height or width to the
    patch (a 720x1280 frame is a 45x80 latent, 23x40 = 920 tokens), and F frames are
    1 + (F - 1) / 4 latent frames (the VAE is causal in time: the first frame stands alone).
A frame count the temporal factor does not fit (F - 1 not a multiple of 4) is refused here,
where the pipeline would round it up silently.
"""
from __future__ import annotations

import dataclasses
import math

from xlaopt.errors import UserError


@dataclasses.dataclass(frozen=True)
class Tier:
    """A resolution tier: its frame size in pixels (16:9), the most frames it takes, and the
    flow shift its training used."""
    name: str
    width: int
    height: int
    max_frames: int
    training_shift: float


TIERS = {t.name: t for t in (Tier("256p", 320, 192, 400, 3.0), Tier("480p", 832, 480, 300, 5.0),
                             Tier("720p", 1280, 720, 200, 10.0))}


@dataclasses.dataclass(frozen=True)
class VideoVae:
    """How a VAE latent relates to pixels (Wan2.2's: 4x in time, 16x in space, 48 channels)."""
    temporal: int = 4
    spatial: int = 16
    channels: int = 48


WAN22_VAE = VideoVae()


@dataclasses.dataclass(frozen=True)
class VideoProfile:
    """One text-to-video request: NVIDIA's defaults unless given. `prompt_tokens` and
    `negative_tokens` are the two guidance branches' text: the defaults are estimates (at 4
    characters a token, no tokenizer run) of the benchmark's prompt, `inputs/omni/t2v.json`
    (6,772 characters), and of the default negative prompt, `neg_prompts.json` (14,850)."""
    resolution: str = "720p"
    frames: int = 189
    fps: int = 24
    steps: int = 35
    guidance: float = 6.0
    shift: float = 10.0
    prompt_tokens: int = 1700
    negative_tokens: int = 3700
    vae: VideoVae = WAN22_VAE

    def __post_init__(self):
        if self.resolution not in TIERS:
            raise UserError(f"--resolution {self.resolution!r}: Cosmos 3 generates at {', '.join(TIERS)}; "
                            f"pick one of those")
        tier, t = TIERS[self.resolution], self.vae.temporal
        if isinstance(self.frames, bool) or not isinstance(self.frames, int) or self.frames < 1 \
                or (self.frames - 1) % t:
            near = max(1, self.frames - (self.frames - 1) % t) if isinstance(self.frames, int) else 189
            raise UserError(f"--frames {self.frames!r}: the VAE's temporal factor {t} needs {t}k+1 frames (the "
                            f"first frame stands alone); e.g. {near} or {near + t}")
        if self.frames > tier.max_frames:
            raise UserError(f"--frames {self.frames}: the {tier.name} tier takes at most {tier.max_frames} frames")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise UserError(f"--steps {self.steps!r}: the denoising step count must be a positive integer")
        if self.prompt_tokens < 1 or self.negative_tokens < 1:
            raise UserError("prompt and negative-prompt token counts must be positive")

    @property
    def tier(self) -> Tier:
        return TIERS[self.resolution]

    @property
    def guided(self) -> bool:
        return self.guidance != 1.0

    def latent_shape(self) -> tuple[int, int, int]:
        """(latent frames, height, width) of the VAE's latent, before patching (what it decodes)."""
        s = self.vae.spatial
        return (1 + (self.frames - 1) // self.vae.temporal, math.ceil(self.tier.height / s),
                math.ceil(self.tier.width / s))

    def latent_grid(self, patch: int) -> tuple[int, int, int]:
        """(latent frames, token rows, token columns): the latent padded up to whole patches."""
        t, h, w = self.latent_shape()
        return t, math.ceil(h / patch), math.ceil(w / patch)

    def gen_tokens(self, patch: int) -> int:
        return math.prod(self.latent_grid(patch))

    def branch_text_tokens(self) -> tuple[int, ...]:
        """The text each branch's row carries: the prompt, and with guidance the negative prompt."""
        return (self.prompt_tokens, self.negative_tokens) if self.guided else (self.prompt_tokens,)
