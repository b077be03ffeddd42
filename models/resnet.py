"""A ResNet for image classification (He et al. 2016; torchvision's v1.5, the stride on the 3x3
conv of a bottleneck), with batch norm that is right under data parallelism.

Batch norm in training normalises with the statistics of the whole global batch: the moments
are means over the batch's rows, so when the rows are split over data axes XLA's partitioner
reduces them across those axes (synchronised batch norm, with nothing to configure), and a
sharded step normalises exactly as one device does on the whole batch. The running averages
that inference normalises with are not parameters: the model writes each step's batch moments
into its `batch_stats` collection and the train step folds them into the train state's
`model_state` (`update_running`), which the checkpoint saves with the rest of the state.

Channels take the logical axis `embed`, the model dimension FSDP shards; nothing maps to
tensor parallelism (a CNN this size is data parallel).

Batch contract: images_BHWC (fp32 pixels), labels_B, valid_B (1 a real image, 0 a padding row,
which neither the loss nor the statistics count).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from xlaopt.models.layers import constrain, param
from xlaopt.models.registry import ConfigError, register
from xlaopt.models.vit import classification_loss

BLOCKS = ("basic", "bottleneck")
STEMS = ("imagenet", "cifar")  # 7x7/2 conv and 3x3/2 max-pool; or one 3x3/1 conv for 32 x 32 images


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    family: ClassVar[str] = "resnet"
    name: str
    num_classes: int = 1000
    stage_sizes: tuple[int, ...] = (3, 4, 6, 3)
    block: str = "bottleneck"
    width: int = 64  # the first stage's channels; each later stage doubles them
    stem: str = "imagenet"
    image_size: int = 224
    channels: int = 3
    bn_momentum: float = 0.9  # running = momentum * running + (1 - momentum) * batch (torch's 0.1)
    bn_eps: float = 1e-5

    def __post_init__(self):
        if self.block not in BLOCKS or self.stem not in STEMS:
            raise ConfigError(f"{self.name}: block={self.block!r}, stem={self.stem!r}; use a block of {BLOCKS} "
                              f"and a stem of {STEMS}")
        if not self.stage_sizes or min(self.stage_sizes) < 1 or min(self.num_classes, self.width, self.channels) < 1:
            raise ConfigError(f"{self.name}: stage_sizes={self.stage_sizes}, num_classes={self.num_classes}, "
                              f"width={self.width} and channels={self.channels} must all be positive")
        if not 0 <= self.bn_momentum < 1:
            raise ConfigError(f"{self.name}: bn_momentum={self.bn_momentum} must be in [0, 1)")
        if self.image_size % self.downsampling:
            raise ConfigError(f"{self.name}: image_size={self.image_size} must be a multiple of {self.downsampling} "
                              f"(the stem and {len(self.stage_sizes) - 1} strided stages halve it each time)")

    @property
    def expansion(self) -> int:
        return 4 if self.block == "bottleneck" else 1

    @property
    def features(self) -> int:
        """The channels the classifier reads: the last stage's output."""
        return self.width * 2 ** (len(self.stage_sizes) - 1) * self.expansion

    @property
    def downsampling(self) -> int:
        return (4 if self.stem == "imagenet" else 1) * 2 ** (len(self.stage_sizes) - 1)


class Conv(NamedTuple):
    """One convolution of the network, as the model builds it and the FLOP count reads it."""
    name: str
    kernel: int
    stride: int
    c_in: int
    c_out: int
    out_size: int  # output height (= width)


def blocks(c: ResNetConfig):
    """(block name, [convs], shortcut conv or None) for each residual block, in order."""
    size = c.image_size // (4 if c.stem == "imagenet" else 1)
    c_in = c.width
    for s, depth in enumerate(c.stage_sizes):
        width = c.width * 2**s
        for b in range(depth):
            stride = 2 if s > 0 and b == 0 else 1
            out = size // stride
            name = f"stage{s}_block{b}"
            if c.block == "bottleneck":
                convs = [Conv("conv1", 1, 1, c_in, width, size), Conv("conv2", 3, stride, width, width, out),
                         Conv("conv3", 1, 1, width, width * 4, out)]
            else:
                convs = [Conv("conv1", 3, stride, c_in, width, out), Conv("conv2", 3, 1, width, width, out)]
            c_out = width * c.expansion
            shortcut = Conv("shortcut", 1, stride, c_in, c_out, out) if stride != 1 or c_in != c_out else None
            yield name, convs, shortcut
            c_in, size = c_out, out


def stem_conv(c: ResNetConfig) -> Conv:
    if c.stem == "imagenet":
        return Conv("stem", 7, 2, c.channels, c.width, c.image_size // 2)
    return Conv("stem", 3, 1, c.channels, c.width, c.image_size)


class BatchNorm(nn.Module):
    """Batch norm over (rows, height, width) of the real rows; see the module docstring. In
    `train` mode the batch's (mean, unbiased variance) are written to `batch_stats`; otherwise
    the running averages there are read."""
    channels: int
    eps: float
    train: bool = True

    @nn.compact
    def __call__(self, x_BHWC, valid_B):
        C = self.channels
        scale_C = param(self, "scale", (C,), ("embed",), nn.initializers.ones)
        bias_C = param(self, "bias", (C,), ("embed",), nn.initializers.zeros)
        mean_var = self.variable("batch_stats", "mean", jnp.zeros, (C,), jnp.float32)
        var_var = self.variable("batch_stats", "var", jnp.ones, (C,), jnp.float32)
        x32 = x_BHWC.astype(jnp.float32)
        if self.train:
            w_B111 = valid_B.astype(jnp.float32)[:, None, None, None]
            count = jnp.maximum(jnp.sum(w_B111) * x_BHWC.shape[1] * x_BHWC.shape[2], 2.0)
            mean_C = jnp.sum(x32 * w_B111, axis=(0, 1, 2)) / count
            var_C = jnp.sum(jnp.square(x32 - mean_C) * w_B111, axis=(0, 1, 2)) / count  # biased, as torch normalises
            if not self.is_initializing():  # init keeps the running averages' starting values
                mean_var.value, var_var.value = mean_C, var_C * count / (count - 1)
        else:
            mean_C, var_C = mean_var.value, var_var.value
        y = (x32 - mean_C) * jax.lax.rsqrt(var_C + self.eps) * scale_C + bias_C
        return y.astype(x_BHWC.dtype)


def update_running(running, batch_moments, momentum: float):
    """The running averages after one step's batch moments."""
    return jax.tree.map(lambda r, b: momentum * r + (1 - momentum) * b, running, batch_moments)


class ResNet(nn.Module):
    config: ResNetConfig
    dtype: jnp.dtype = jnp.bfloat16
    train: bool = True

    def _conv(self, x_BHWC, conv: Conv, name: str):
        kernel = param(self, f"{name}_kernel", (conv.kernel, conv.kernel, conv.c_in, conv.c_out),
                       (None, None, "conv_in", "embed"), fan_in_axes=(0, 1, 2))
        pad = (conv.kernel - 1) // 2
        y = jax.lax.conv_general_dilated(x_BHWC, kernel.astype(self.dtype), (conv.stride,) * 2, [(pad, pad)] * 2,
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return constrain(y, ("batch", None, None, "act_embed"))

    def _bn(self, x, name, valid_B):
        return BatchNorm(x.shape[-1], self.config.bn_eps, self.train, name=name)(x, valid_B)

    @nn.compact
    def __call__(self, batch: dict) -> jax.Array:
        """Class logits [B, E] in fp32."""
        c, dt = self.config, self.dtype
        valid_B = batch["valid_B"] > 0
        x = constrain(batch["images_BHWC"].astype(dt), ("batch", None, None, None))
        x = nn.relu(self._bn(self._conv(x, stem_conv(c), "stem"), "stem_bn", valid_B))
        if c.stem == "imagenet":
            x = nn.max_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1)))
        for name, convs, shortcut in blocks(c):
            h = x
            for i, conv in enumerate(convs):
                h = self._bn(self._conv(h, conv, f"{name}_{conv.name}"), f"{name}_bn{i + 1}", valid_B)
                if i < len(convs) - 1:
                    h = nn.relu(h)
            if shortcut is not None:
                x = self._bn(self._conv(x, shortcut, f"{name}_shortcut"), f"{name}_shortcut_bn", valid_B)
            x = nn.relu(x + h)
        pooled_BC = jnp.mean(x.astype(jnp.float32), axis=(1, 2))
        C, E = x.shape[-1], c.num_classes
        head_CE = param(self, "head_CE", (C, E), ("embed", "classes"))
        head_bias_E = param(self, "head_bias_E", (E,), ("classes",), nn.initializers.zeros)
        return pooled_BC @ head_CE + head_bias_E


def loss_fn(model: ResNet, params, batch: dict, key) -> tuple[jax.Array, dict]:
    """Cross-entropy over the real images; the step's batch moments ride in the metrics
    (`BATCH_MOMENTS`) for the train step to fold into the running averages."""
    del key
    logits_BE, variables = model.apply({"params": params}, batch, mutable=["batch_stats"])
    loss, metrics = classification_loss(logits_BE, batch["labels_B"], batch["valid_B"] > 0)
    return loss, {**metrics, BATCH_MOMENTS: variables["batch_stats"]}


BATCH_MOMENTS = "batch_moments"


def forward_flops(c: ResNetConfig) -> float:
    """One image's forward model FLOPs: every convolution (2 x kernel area x c_in x c_out per
    output pixel) and the head; norms, pooling and additions are not counted, as is usual."""
    convs = [stem_conv(c)] + [conv for _, main, short in blocks(c) for conv in main + ([short] if short else [])]
    total = sum(2 * conv.kernel**2 * conv.c_in * conv.c_out * conv.out_size**2 for conv in convs)
    return float(total + 2 * c.features * c.num_classes)


def batch_train_flops(c: ResNetConfig, batch: dict[str, np.ndarray]) -> float:
    return 3.0 * forward_flops(c) * float((batch["valid_B"] > 0).sum())


# torchvision's resnet50 (25,557,032 parameters, 4.09 GMACs at 224 x 224); resnet-tiny a
# ResNet-10 of basic blocks for 32 x 32 images of 10 classes.
register("resnet50", ResNetConfig)
register("resnet-tiny", ResNetConfig, num_classes=10, stage_sizes=(1, 1, 1, 1), block="basic", width=16,
         stem="cifar", image_size=32)
