"""The training objective: rectified-flow velocity MSE on noisy generator tokens plus
next-token cross-entropy on reasoner text, combined as a weighted sum of per-modality means
(as NVIDIA's trainer does; each mean is over that modality's noisy elements only)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaopt.models.cosmos3 import ACTION, MODALITY_NAMES, SOUND, VIDEO, Cosmos3
from xlaopt.models.cosmos3_config import Cosmos3Config
from xlaopt.models.layers import next_token_loss, token_mean


def noised_inputs(batch: dict, noise_BVC: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x_t = sigma*eps + (1-sigma)*x0 on noisy tokens (clean tokens pass x0), and v = eps - x0."""
    x0_BVC = batch["gen_x0_BVC"]
    sigma_BV1 = batch["gen_sigma_BV"][..., None]
    x_t_BVC = jnp.where(batch["gen_noisy_BV"][..., None], sigma_BV1 * noise_BVC + (1 - sigma_BV1) * x0_BVC, x0_BVC)
    return x_t_BVC, noise_BVC - x0_BVC


# The step's random draws, made from the whole (micro-)batch before any rewrite splits it over
# devices by hand: each device then holds its slice of exactly the draws one device would make.
DRAW_AXES = (("gen_noise_BVC", ("batch", "seq", None)),)


def draws(batch: dict, key: jax.Array) -> dict:
    """The flow noise, one normal draw per generator channel, from `key`."""
    return {"gen_noise_BVC": jax.random.normal(key, batch["gen_x0_BVC"].shape, jnp.float32)}


def loss_fn(model: Cosmos3, params, batch: dict, key: jax.Array) -> tuple[jax.Array, dict]:
    """Total loss and per-modality terms; the batch holds its draws (`draws`)."""
    del key  # drawn from already
    c: Cosmos3Config = model.config
    x_t_BVC, target_BVC = noised_inputs(batch, batch["gen_noise_BVC"])
    logits_BTE, pred_BVC = model.apply({"params": params}, batch, x_t_BVC)

    losses = {"text": next_token_loss(logits_BTE, batch["text_tokens_BT"], batch["text_segment_ids_BT"])}

    sq_err_BVC = jnp.square(pred_BVC - target_BVC)
    channel_dims = {VIDEO: c.latent_patch_dim, ACTION: c.action_dim, SOUND: c.sound_dim}
    C = c.generator_in_dim
    for modality, dim in channel_dims.items():
        token_mask_BV1 = (batch["gen_noisy_BV"] & (batch["gen_modality_BV"] == modality))[..., None]
        mask_BVC = token_mask_BV1 & (jnp.arange(C) < dim)
        losses[MODALITY_NAMES[modality]] = token_mean(sq_err_BVC, mask_BVC)

    weights = {"text": c.text_loss_weight, "video": c.video_loss_weight,
               "action": c.action_loss_weight, "sound": c.sound_loss_weight}
    total = sum(weights[k] * v for k, v in losses.items())
    return total, {f"loss_{k}": v for k, v in losses.items()}
