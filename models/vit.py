"""A Vision Transformer for image classification (Dosovitskiy et al. 2021): the image cut into
patches, each patch one token, learned absolute positions, bidirectional attention, the mean of
the patches' outputs scored by a linear head.

The head pools by the mean (big_vision's `gap`; the paper's Appendix D.3 finds it as good as a
class token): rows are then exactly the patches, a count that splits over a context axis and
that cuDNN's fused attention takes (jax 0.10.2 refuses odd lengths, such as 197, with a mask).

The blocks are the pre-norm blocks the LLMs use (`models.block`: RMSNorm, no biases, GELU MLP),
not the paper's LayerNorm with biases: the same passes and seams then serve every family, and
the parameter counts stay within 0.2% of the paper's (the biases, norm offsets and class token
are all that differ).

Batch contract: images_BHWC (fp32 pixels), labels_B, segment_ids_BT (T = the image's patches;
1 a real image, 0 a padding row). Rows hold one image each; the
segment ids leave room for packing several (NaViT) without a new contract.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from xlaopt.models.attention import AttentionSpec
from xlaopt.models.block import TransformerBlock
from xlaopt.models.layers import RESIDUAL_BLD, RMSNorm, constrain, param, token_mean
from xlaopt.models.masks import Tokens
from xlaopt.models.registry import ConfigError, register
from xlaopt.models.stack import LayerStack, StackSpec
from xlaopt.models.transformer_config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class ViTConfig(TransformerConfig):
    """`vocab_size` is the number of classes: the head's width, as an LLM head's is its
    vocabulary (so the cost model and the rule table read both alike)."""
    family: ClassVar[str] = "vit"
    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    mlp_activation: str = "gelu"
    norm_eps: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if self.image_size <= 0 or self.patch_size <= 0 or self.channels <= 0:
            raise ConfigError(f"{self.name}: image_size={self.image_size}, patch_size={self.patch_size} and "
                              f"channels={self.channels} must be positive")
        if self.image_size % self.patch_size:
            fits = [p for p in range(1, self.image_size + 1) if self.image_size % p == 0 and p <= 64]
            raise ConfigError(f"{self.name}: patch_size={self.patch_size} does not divide image_size="
                              f"{self.image_size}; pick a patch size that does (e.g. {fits[-3:]}) or another "
                              f"image size")
        if self.num_kv_heads != self.num_heads:
            raise ConfigError(f"{self.name}: a ViT's attention has one key head per query head; set "
                              f"num_kv_heads={self.num_heads}")

    @property
    def num_classes(self) -> int:
        return self.vocab_size

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens(self) -> int:
        """A row's tokens: its image's patches."""
        return self.patches

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.channels


def image_tokens(seg_BT) -> Tokens:
    return Tokens.of(seg_BT, jnp.ones(seg_BT.shape, bool))  # each token sees its whole image


def attention_calls(batch: dict) -> tuple[tuple[Tokens, Tokens], ...]:
    tokens_T = image_tokens(jnp.asarray(batch["segment_ids_BT"]))
    return ((tokens_T, tokens_T),)


def patchify(images_BHWC: jax.Array, p: int) -> jax.Array:
    """[B, H, W, C] -> [B, (H/p)(W/p), p*p*C], patches in row-major order."""
    B, H, W, C = images_BHWC.shape
    x = images_BHWC.reshape(B, H // p, p, W // p, p, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(B, (H // p) * (W // p), p * p * C)


class ViTLayer(nn.Module):
    block: dict
    attention: AttentionSpec = AttentionSpec()

    @nn.compact
    def __call__(self, x_BTD, tokens_T):
        block = TransformerBlock(name="block", **self.block)
        q_BTHK, k_BTHK, v_BTHK, _ = block.qkv(x_BTD)  # learned positions: nothing to rotate
        return block.finish(x_BTD, self.attention(q_BTHK, k_BTHK, v_BTHK, tokens_T, tokens_T))


class ViT(nn.Module):
    config: ViTConfig
    dtype: jnp.dtype = jnp.bfloat16
    stack: StackSpec = StackSpec()
    attention: AttentionSpec = AttentionSpec()

    @nn.compact
    def __call__(self, batch: dict) -> jax.Array:
        """Class logits [B, E] in fp32."""
        c, dt = self.config, self.dtype
        D, E, X, T = c.d_model, c.vocab_size, c.patch_dim, c.tokens
        seg_BT = batch["segment_ids_BT"]
        patch_XD = param(self, "patch_embed_XD", (X, D), ("patch", "embed"))
        patch_bias_D = param(self, "patch_bias_D", (D,), ("embed",), nn.initializers.zeros)
        x_BTD = (jnp.einsum("btx,xd->btd", patchify(batch["images_BHWC"].astype(dt), c.patch_size), patch_XD.astype(dt))
                 + patch_bias_D.astype(dt))
        pos_TD = param(self, "pos_embed_TD", (T, D), ("positions", "embed"), nn.initializers.normal(0.02))
        x_BTD = constrain(x_BTD + pos_TD.astype(dt), RESIDUAL_BLD)
        block = dict(c.block_fields(dt), qk_norm=False)
        x_BTD = LayerStack(ViTLayer, dict(block=block, attention=self.attention), c.num_layers, self.stack,
                           name="layers")(x_BTD, image_tokens(seg_BT))
        real_BT1 = (seg_BT > 0)[..., None]
        pooled_BD = (jnp.sum(jnp.where(real_BT1, x_BTD.astype(jnp.float32), 0.0), axis=1)
                     / jnp.maximum(jnp.sum(real_BT1, axis=1), 1))
        h_BD = RMSNorm(D, "embed", c.norm_eps, name="final_norm")(pooled_BD.astype(dt))
        # Classes get a logical axis of their own, which the rule table does not split: a few
        # thousand columns at most, and counts like 10 divide no tensor axis.
        head_DE = param(self, "head_DE", (D, E), ("embed", "classes"), nn.initializers.zeros)
        head_bias_E = param(self, "head_bias_E", (E,), ("classes",), nn.initializers.zeros)
        return jnp.einsum("bd,de->be", h_BD, head_DE.astype(dt), preferred_element_type=jnp.float32) + head_bias_E


def classification_loss(logits_BE: jax.Array, labels_B: jax.Array, real_B: jax.Array) -> tuple[jax.Array, dict]:
    """Mean cross-entropy over the real images (a CNN shares it), and their accuracy."""
    nll_B = -jnp.take_along_axis(jax.nn.log_softmax(logits_BE, axis=-1), labels_B[:, None], axis=-1)[:, 0]
    loss = token_mean(nll_B, real_B)
    accuracy = token_mean((jnp.argmax(logits_BE, axis=-1) == labels_B).astype(jnp.float32), real_B)
    return loss, {"loss_class": loss, "accuracy": accuracy}


def loss_fn(model: ViT, params, batch: dict, key) -> tuple[jax.Array, dict]:
    del key  # no sampling in a classification step
    logits_BE = model.apply({"params": params}, batch)
    return classification_loss(logits_BE, batch["labels_B"], batch["segment_ids_BT"][:, 0] > 0)


def forward_flops(c: ViTConfig) -> float:
    """One image's forward model FLOPs: the patch embedding, the layers' weights over every
    patch, bidirectional attention (the whole square), the head on the pooled patches."""
    T, D, hk = c.tokens, c.d_model, c.num_heads * c.head_dim
    weights = 2 * D * hk + 2 * D * c.num_kv_heads * c.head_dim + 2 * D * c.mlp_dim
    return float(2 * T * c.patch_dim * D + c.num_layers * (2 * weights * T + 4 * hk * T * T)
                 + 2 * D * c.vocab_size)


def batch_train_flops(c: ViTConfig, batch: dict[str, np.ndarray]) -> float:
    return 3.0 * forward_flops(c) * float((batch["segment_ids_BT"][:, 0] > 0).sum())


# Sizes from the paper's Table 1 (ViT-B/16: 86.6M parameters, ViT-L/16: 304M, with the
# ImageNet head); vit-tiny classifies 32 x 32 images of 10 classes in 4 x 4 patches.
register("vit-tiny", ViTConfig, vocab_size=10, d_model=192, num_layers=4, num_heads=4, num_kv_heads=4,
         mlp_dim=768, image_size=32, patch_size=4)
register("vit-b16", ViTConfig, vocab_size=1000, d_model=768, num_layers=12, num_heads=12, num_kv_heads=12,
         mlp_dim=3072)
register("vit-l16", ViTConfig, vocab_size=1000, d_model=1024, num_layers=24, num_heads=16, num_kv_heads=16,
         mlp_dim=4096)
