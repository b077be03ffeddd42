"""One multimodal training sample, as stored and as packed (see `xlaopt.data.packing`).

A sample is a text split (reasoner tokens) and at most one generator split of a single
modality: video latent patches on a (frames, height, width) grid, actions of one embodiment
domain, or sound latents. The first `n_clean` generator tokens are clean conditioning
(e.g. the first frame of image-to-video) and get no noise, timestep or loss.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from xlaopt.errors import UserError
from xlaopt.models.cosmos3 import ACTION, PAD, SOUND, VIDEO

TEXT_ONLY = PAD  # a sample with no generator split
MODALITY_NAMES = {TEXT_ONLY: "text", VIDEO: "video", ACTION: "action", SOUND: "sound"}


class SampleError(UserError):
    pass


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    text: np.ndarray  # int32 [n_text]
    modality: int = TEXT_ONLY
    latents: np.ndarray | None = None  # float32 [n_gen, width of the modality]
    grid: tuple[int, int, int] = (0, 0, 0)  # video: (frames, height, width); else (n_gen, 1, 1)
    domain: int = 0  # action embodiment
    n_clean: int = 0
    fps: float | None = None  # frame rate of a video or action clip; None: the model's base rate

    @property
    def n_text(self) -> int:
        return len(self.text)

    @property
    def n_gen(self) -> int:
        return 0 if self.latents is None else len(self.latents)

    def validate(self, where: str = "sample") -> None:
        """Raise SampleError when the parts of the sample disagree."""
        if self.modality not in MODALITY_NAMES:
            raise SampleError(f"{where}: unknown modality {self.modality}")
        if self.modality == TEXT_ONLY:
            if self.n_gen:
                raise SampleError(f"{where}: a text-only sample carries {self.n_gen} generator tokens")
            return
        if self.latents is None or self.latents.ndim != 2:
            raise SampleError(f"{where}: {MODALITY_NAMES[self.modality]} latents must be a 2-D array [tokens, width]")
        if int(np.prod(self.grid)) != self.n_gen:
            raise SampleError(f"{where}: grid {self.grid} holds {int(np.prod(self.grid))} tokens but the latents "
                              f"hold {self.n_gen}")
        if self.fps is not None and not self.fps > 0:
            raise SampleError(f"{where}: fps={self.fps} must be positive")
        if not 0 <= self.n_clean <= self.n_gen:
            raise SampleError(f"{where}: n_clean={self.n_clean} outside 0..{self.n_gen}")
