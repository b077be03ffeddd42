"""Model FLOPs of the Cosmos 3 MoT, counted per sample as in the architecture note.

Per tower and layer the weights are P_L = 2*d*H*dh + 2*d*N*dh + 3*d*F (SwiGLU; 2*d*F for
relu^2). Each token passes through exactly one tower, and attention is counted per
sample with the two-way mask honestly: generator queries see all N_r + N_g tokens of
their sample, reasoner queries see a causal half of N_r:

  forward = 2*L*P_L*(N_r + N_g) + L*(4*H*dh*N_g*(N_r + N_g) + 2*H*dh*N_r^2)
            + 2*d*E*N_r (LM head) + generator input/output projections and timestep MLP.

Training counts 3x forward (MaxText's convention: recomputation under remat is not model
work). Padding is not model work either, so a batch's FLOPs follow its real samples. With the
reasoner frozen (`TrainSettings.trainable="generator"`) nothing upstream of a reasoner token is
trained, so its backward is not model work: the step is the whole forward plus twice the
generator's part of it.
"""
from __future__ import annotations

import numpy as np

from xlaopt.models.cosmos3_config import Cosmos3Config


def layer_weights_per_tower(c: Cosmos3Config) -> int:
    attn = 2 * c.d_model * c.num_heads * c.head_dim + 2 * c.d_model * c.num_kv_heads * c.head_dim
    mlp = (3 if c.mlp_activation == "swiglu" else 2) * c.d_model * c.mlp_dim
    return attn + mlp


def forward_flops(c: Cosmos3Config, n_reasoner: np.ndarray, n_generator: np.ndarray,
                  n_noisy: np.ndarray | None = None, generator_width: np.ndarray | None = None) -> np.ndarray:
    """Forward FLOPs of samples with the given token counts (arrays broadcast elementwise).

    `generator_width` is the raw channel count of each sample's generator modality
    (default: the video patch width); `n_noisy` defaults to all generator tokens.
    """
    return sum(forward_flops_by_tower(c, n_reasoner, n_generator, n_noisy, generator_width))


def forward_flops_by_tower(c: Cosmos3Config, n_reasoner, n_generator, n_noisy=None,
                           generator_width=None) -> tuple[np.ndarray, np.ndarray]:
    """`forward_flops` as (the reasoner's part, the generator's part): each tower's linears, the
    attention its queries run, and its inputs and outputs (the LM head; the generator's IO)."""
    n_r = np.asarray(n_reasoner, np.float64)
    n_g = np.asarray(n_generator, np.float64)
    n_noisy = n_g if n_noisy is None else np.asarray(n_noisy, np.float64)
    width = c.latent_patch_dim if generator_width is None else np.asarray(generator_width, np.float64)
    L, H, dh, d = c.num_layers, c.num_heads, c.head_dim, c.d_model
    per_token = 2 * L * layer_weights_per_tower(c)
    reasoner = per_token * n_r + L * 2 * H * dh * n_r**2 + 2 * d * c.vocab_size * n_r
    generator = (per_token * n_g + L * 4 * H * dh * n_g * (n_r + n_g) + 4 * d * width * n_g
                 + 2 * (c.timestep_freq_dim * d + d * d) * n_noisy)
    return reasoner, generator


def train_flops(c: Cosmos3Config, n_reasoner, n_generator, trainable: str = "all", **kw) -> np.ndarray:
    reasoner, generator = forward_flops_by_tower(c, n_reasoner, n_generator, **kw)
    if trainable == "all":
        return 3.0 * (reasoner + generator)
    if trainable == "generator":
        return reasoner + 3.0 * generator
    raise ValueError(f"trainable={trainable!r}: Cosmos 3 trains all or generator")


def batch_train_flops(c: Cosmos3Config, batch: dict[str, np.ndarray], trainable: str = "all") -> float:
    """Model FLOPs of one training step on a packed batch (padding excluded)."""
    from xlaopt.models.cosmos3 import ACTION, SOUND, VIDEO

    widths = np.zeros(4)
    widths[[VIDEO, ACTION, SOUND]] = (c.latent_patch_dim, c.action_dim, c.sound_dim)
    text_seg, gen_seg = batch["text_segment_ids_BT"], batch["gen_segment_ids_BV"]
    total = 0.0
    for row in range(text_seg.shape[0]):
        n = int(max(text_seg[row].max(), gen_seg[row].max())) + 1
        n_r = np.bincount(text_seg[row], minlength=n)[1:]
        n_g = np.bincount(gen_seg[row], minlength=n)[1:]
        n_noisy = np.bincount(gen_seg[row], weights=batch["gen_noisy_BV"][row], minlength=n)[1:]
        width_sum = np.bincount(gen_seg[row], weights=widths[batch["gen_modality_BV"][row]], minlength=n)[1:]
        width = np.divide(width_sum, n_g, out=np.zeros_like(width_sum), where=n_g > 0)
        total += float(np.sum(train_flops(c, n_r, n_g, trainable, n_noisy=n_noisy, generator_width=width)))
    return total
