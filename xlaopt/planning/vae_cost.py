"""The Wan2.2 VAE decoder's work for one clip, counted from its architecture.

The decoder (`WanVAE_` in Wan-Video/Wan2.2 `wan/modules/vae2_2.py`, the same module in
NVIDIA/cosmos-framework `model/generator/tokenizers/wan2pt2_vae_4x16x16.py`): `dec_dim` 256 with
`dim_mult` (1, 2, 4, 4) and 2 residual blocks a level, so widths 1024, 1024, 1024, 512, 256;
  conv_in      causal 3x3x3 conv, 48 latent channels -> 1024
  middle       residual block, one-head attention within each frame over its pixels, residual block
  4 up-levels  3 residual blocks each (two causal 3x3x3 convs, a 1x1x1 shortcut where the width
               changes); levels 0 and 1 then double time (a causal 3x1x1 conv to twice the channels,
               folded into frames) and space (nearest 2x, a 3x3 conv), level 2 doubles space only
  head         causal 3x3x3 conv, 256 -> 12, unpatchified 2x2 to RGB pixels
It decodes one latent frame at a time with a two-frame cache, so time doubles causally: 1 + 2(T - 1).
Counted: every conv's and the attention's multiply-adds (x2); norms, SiLU and the nearest
upsampling are left out (memory traffic, small next to the convs at these widths).
"""
from __future__ import annotations

import dataclasses

_K3 = 27  # a 3x3x3 kernel
_WIDTHS = (1024, 1024, 1024, 512, 256)
_UP = (("time", "space"), ("time", "space"), ("space",), ())
_BLOCKS = 3
_LATENT = 48
_OUT = 12  # 3 RGB channels x a 2x2 patch


@dataclasses.dataclass(frozen=True)
class DecoderWork:
    flops: float
    by_level: dict  # name -> FLOPs
    calls: int  # conv and attention matmuls run: each layer's once per latent frame (decoded one at a time)

    @property
    def largest(self) -> str:
        return max(self.by_level, key=self.by_level.get)


def _res_block(cin: int, cout: int, points: float) -> float:
    shortcut = cin * cout if cin != cout else 0
    return 2 * points * (_K3 * cin * cout + _K3 * cout * cout + shortcut)


def decoder_flops(latent_frames: int, latent_h: int, latent_w: int) -> DecoderWork:
    """FLOPs to decode a latent of `latent_frames` x `latent_h` x `latent_w` (unpadded) to pixels."""
    t, h, w = latent_frames, latent_h, latent_w
    c = _WIDTHS[0]
    levels = {"conv_in": 2 * t * h * w * _K3 * _LATENT * c}
    pixels = h * w
    attention = t * (2 * pixels * 4 * c * c + 2 * 2 * pixels * pixels * c)  # qkv and out 1x1; QK^T and PV
    levels["middle"] = 2 * _res_block(c, c, t * h * w) + attention
    for i, up in enumerate(_UP):
        cin, cout = _WIDTHS[i], _WIDTHS[i + 1]
        work = sum(_res_block(cin if b == 0 else cout, cout, t * h * w) for b in range(_BLOCKS))
        if "time" in up:
            work += 2 * t * h * w * 3 * cout * 2 * cout
            t = 1 + 2 * (t - 1)
        if "space" in up:
            h, w = 2 * h, 2 * w
            work += 2 * t * h * w * 9 * cout * cout
        levels[f"level{i}"] = work
    levels["head"] = 2 * t * h * w * _K3 * _WIDTHS[-1] * _OUT
    widths = list(zip(_WIDTHS, _WIDTHS[1:]))
    per_frame = (1 + 2 * 2 + 2  # conv_in; the middle's two blocks and its attention (projections, QK^T and PV)
                 + sum(2 * _BLOCKS + (cin != cout) + len(up) for (cin, cout), up in zip(widths, _UP)) + 1)
    return DecoderWork(float(sum(levels.values())), {k: float(v) for k, v in levels.items()}, per_frame * latent_frames)
