"""The packed batches the models consume: names, shapes, dtypes, logical axes.

Cosmos 3 rows are [reasoner region of `text_len` tokens | generator region of `gen_len`
tokens] (see `xlaopt.models.cosmos3`); decoder rows are `text_len` tokens of packed
documents; ViT rows are one image, whose token count (`text_len`) its config fixes; a ResNet's
rows are one image each, counted as one token (`text_len` 1), so rows and tokens per second agree. Producers (synthetic now, the tensorstore loader later) emit exactly these arrays.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from xlaopt.errors import UserError
from xlaopt.models.cosmos3_config import Cosmos3Config
from xlaopt.models.decoder import DecoderConfig
from xlaopt.models.resnet import ResNetConfig
from xlaopt.models.vit import ViTConfig

Spec = dict[str, tuple[tuple[int, ...], np.dtype, tuple]]


@dataclasses.dataclass(frozen=True)
class BatchShape:
    batch_size: int = 8
    text_len: int = 48
    gen_len: int = 96  # generator tokens per row (Cosmos 3 only)

    def __post_init__(self):
        if min(self.batch_size, self.text_len) < 1 or self.gen_len < 0:
            raise UserError(f"batch shape {self}: batch_size and text_len must be positive, gen_len >= 0")

    @property
    def tokens(self) -> int:
        return self.batch_size * (self.text_len + self.gen_len)


def cosmos3_batch_spec(config: Cosmos3Config, shape: BatchShape) -> Spec:
    """name -> (shape, dtype, logical axes) for every array in a packed batch."""
    B, T, V, C = shape.batch_size, shape.text_len, shape.gen_len, config.generator_in_dim
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    bt, bv = ("batch", "seq"), ("batch", "seq")
    return {
        "text_tokens_BT": ((B, T), i32, bt),
        "text_segment_ids_BT": ((B, T), i32, bt),
        "text_positions_3BT": ((3, B, T), i32, (None,) + bt),
        "gen_segment_ids_BV": ((B, V), i32, bv),
        "gen_positions_3BV": ((3, B, V), f32, (None,) + bv),  # fractional with fps modulation
        "gen_modality_BV": ((B, V), i32, bv),
        "gen_action_domain_BV": ((B, V), i32, bv),
        "gen_noisy_BV": ((B, V), np.dtype(bool), bv),
        "gen_sigma_BV": ((B, V), f32, bv),
        "gen_x0_BVC": ((B, V, C), f32, bv + (None,)),
    }


def decoder_batch_spec(config: DecoderConfig, shape: BatchShape) -> Spec:
    B, T = shape.batch_size, shape.text_len
    i32 = np.dtype(np.int32)
    return {name: ((B, T), i32, ("batch", "seq")) for name in ("tokens_BT", "segment_ids_BT", "positions_BT")}


def vit_batch_spec(config: ViTConfig, shape: BatchShape) -> Spec:
    if shape.text_len != config.tokens or shape.gen_len:
        raise UserError(f"{config.name}: a row is one {config.image_size} x {config.image_size} image, "
                        f"{config.tokens} tokens ({config.patch_size} x {config.patch_size} patches), not "
                        f"{shape.text_len} + {shape.gen_len}; "
                        f"change the image with --set image_size=... or patch_size=..., not --seq/--text-len")
    B, S, T = shape.batch_size, config.image_size, config.tokens
    return {
        "images_BHWC": ((B, S, S, config.channels), np.dtype(np.float32), ("batch", None, None, None)),
        "labels_B": ((B,), np.dtype(np.int32), ("batch",)),
        "segment_ids_BT": ((B, T), np.dtype(np.int32), ("batch", "seq")),
    }


def resnet_batch_spec(config: ResNetConfig, shape: BatchShape) -> Spec:
    if shape.text_len != 1 or shape.gen_len:
        raise UserError(f"{config.name}: a row is one {config.image_size} x {config.image_size} image, counted as one "
                        f"token, not {shape.text_len} + {shape.gen_len}; change the image with --set image_size=..., "
                        f"not --seq/--text-len")
    B, S = shape.batch_size, config.image_size
    return {
        "images_BHWC": ((B, S, S, config.channels), np.dtype(np.float32), ("batch", None, None, None)),
        "labels_B": ((B,), np.dtype(np.int32), ("batch",)),
        "valid_B": ((B,), np.dtype(np.int32), ("batch",)),
    }
