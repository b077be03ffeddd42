"""The training objective: rectified-flow velocity MSE on noisy generator tokens plus
next-token cross-entropy on reasoner text, combined as a weighted sum of per-modality means
(as NVIDIA's trainer does; each mean is over that modality's noisy elements only)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xlaopt.models.cosmos3 import ACTION, MODALITY_NAMES, SOUND, VIDEO, Cosmos3
from xlaopt.models.cosmos3_config import Cosmos3Config
from xlaopt.models.layers import next_tokens, one_hot_nll, token_count, token_nll


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
    """Total loss and per-modality terms; the batch holds its draws (`draws`). Where the model's
    layer stack runs the loss inside it (a 1F1B pipeline), `terms` is its tail's objective."""
    del key  # drawn from already
    c: Cosmos3Config = model.config
    x_t_BVC, target_BVC = noised_inputs(batch, batch["gen_noise_BVC"])
    targets_BT, has_next_BT = next_tokens(batch["text_tokens_BT"], batch["text_segment_ids_BT"])
    data = (targets_BT, has_next_BT, target_BVC, batch["gen_noisy_BV"])
    counts = _counts(c, has_next_BT, batch["gen_noisy_BV"], batch["gen_modality_BV"])
    if model.stack.loss_inside:
        total, losses = model.apply({"params": params}, batch, x_t_BVC,
                                    objective=(functools.partial(terms, c, one_hot_nll), data, counts))
    else:
        logits_BTE, pred_BVC = model.apply({"params": params}, batch, x_t_BVC)
        total, losses = terms(c, token_nll, logits_BTE, pred_BVC, batch["gen_modality_BV"], data, counts)
    return total, {f"loss_{k}": v for k, v in losses.items()}


_CHANNELS = {VIDEO: "latent_patch_dim", ACTION: "action_dim", SOUND: "sound_dim"}


def _modality_mask_BVC(c: Cosmos3Config, noisy_BV, modality_BV, modality: int) -> jax.Array:
    """The elements a modality's mean covers: its noisy tokens' channels that modality has."""
    token_mask_BV1 = (noisy_BV & (modality_BV == modality))[..., None]
    return token_mask_BV1 & (jnp.arange(c.generator_in_dim) < getattr(c, _CHANNELS[modality]))


def _counts(c: Cosmos3Config, has_next_BT, noisy_BV, modality_BV) -> dict:
    """Each term's element count over the whole batch (under manual axes, every device's:
    `token_mean`'s count)."""
    masks = {"text": has_next_BT} | {MODALITY_NAMES[m]: _modality_mask_BVC(c, noisy_BV, modality_BV, m)
                                      for m in _CHANNELS}
    return token_count(masks)


def terms(c: Cosmos3Config, nll, logits_BTE, pred_BVC, modality_BV, data: tuple, counts: dict):
    """(weighted total, {term: value}) of these rows: each term their masked sum over the whole
    batch's count, so a micro-batch's terms sum to the batch's (`token_mean`). `nll(logits,
    targets)`: each token's cross-entropy (`token_nll`; `one_hot_nll` inside a pipeline)."""
    targets_BT, has_next_BT, target_BVC, noisy_BV = data
    share = lambda values, mask, name: jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(counts[name], 1)  # noqa: E731
    losses = {"text": share(nll(logits_BTE, targets_BT), has_next_BT, "text")}
    sq_err_BVC = jnp.square(pred_BVC - target_BVC)
    for modality, name in MODALITY_NAMES.items():
        losses[name] = share(sq_err_BVC, _modality_mask_BVC(c, noisy_BV, modality_BV, modality), name)
    weights = {"text": c.text_loss_weight, "video": c.video_loss_weight,
               "action": c.action_loss_weight, "sound": c.sound_loss_weight}
    return sum(weights[k] * v for k, v in losses.items()), losses
