"""A Cosmos 3 style Mixture-of-Transformers: a reasoner tower and a generator tower
sharing one joint attention per layer.

Packed rows are laid out as [reasoner region (T tokens) | generator region (V tokens)]:
samples keep their segment ids and positions, so which region a token sits in is the
only thing that says which tower's weights it goes through. That keeps tower dispatch
static (a slice, not a gather) and every token passes through exactly one tower, as
the FLOP formula assumes. Reasoner queries attend over the reasoner region only (the
two-way mask forbids them generator keys anyway), so one-way flow is structural.

Batch contract (see `xlaopt.data` for the producer):
  text_tokens_BT, text_segment_ids_BT, text_positions_3BT               reasoner region
  gen_segment_ids_BV, gen_positions_3BV, gen_modality_BV,
  gen_action_domain_BV, gen_noisy_BV, gen_sigma_BV, gen_x0_BVC           generator region
Segment id 0 is padding. Modalities: 0 pad, 1 video, 2 action, 3 sound.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from xlaopt.models.attention import AttentionSpec
from xlaopt.models.block import TransformerBlock
from xlaopt.models.cosmos3_config import Cosmos3Config
from xlaopt.models.layers import (
    RESIDUAL_BLD,
    RMSNorm,
    constrain,
    embedding_lookup,
    gathered,
    head_logits,
    param,
    rms_norm,
)
from xlaopt.models.masks import Tokens
from xlaopt.models.mrope import rope_cos_sin
from xlaopt.models.stack import LayerStack, StackSpec

PAD, VIDEO, ACTION, SOUND = 0, 1, 2, 3
# What NVIDIA's vision fine-tuning trains (the reasoner frozen): the generator tower, its final
# norm, and its inputs and outputs (vae2llm, llm2vae, the time embedder, actions, sound).
GENERATOR_SET = ("generator_io/", "generator_final_norm/", "layers/generator/")
MODALITY_NAMES = {VIDEO: "video", ACTION: "action", SOUND: "sound"}


def joint_tokens(text_seg_BT, gen_seg_BV) -> Tokens:
    """The tokens of the joint sequence [reasoner region | generator region] the mask reads."""
    B, T = text_seg_BT.shape
    segment_BS = jnp.concatenate([text_seg_BT, gen_seg_BV], axis=1)
    is_gen_BS = jnp.concatenate([jnp.zeros((B, T), bool), jnp.ones((B, gen_seg_BV.shape[1]), bool)], axis=1)
    return Tokens.of(segment_BS, is_gen_BS)


def attention_calls(batch: dict) -> tuple[tuple[Tokens, Tokens], ...]:
    """(queries, keys) of each attention a layer computes: reasoner over reasoner, generator over
    the whole row (what `MoTLayer` attends with)."""
    tokens_S = joint_tokens(jnp.asarray(batch["text_segment_ids_BT"]), jnp.asarray(batch["gen_segment_ids_BV"]))
    T = batch["text_segment_ids_BT"].shape[1]
    tokens_T = tokens_S.slice(0, T)
    return (tokens_T, tokens_T), (tokens_S.slice(T, tokens_S.segment_BL.shape[1]), tokens_S)


def tower_fields(c: Cosmos3Config, dtype) -> dict:
    """The `TransformerBlock` fields both towers share."""
    return c.block_fields(dtype)


def reasoner_fields(c: Cosmos3Config, dtype) -> dict:
    """The reasoner block's fields as `MoTLayer` builds it: what text decoding
    (`xlaopt.inference.decode`) binds to the reasoner's parameters."""
    return dict(tower_fields(c, dtype), qk_norm=c.reasoner_qk_norm, side_key_norm=c.reasoner_key_norm_for_generator)


def rope_tables(c: Cosmos3Config, positions_3BL, inv_freq: tuple[float, ...] | None = None):
    """cos, sin [B, L, K] of (t, h, w) positions under the config's mRoPE sections."""
    return rope_cos_sin(positions_3BL, c.head_dim, c.mrope_sections, c.rope_theta, inv_freq)


def layer_fields(c: Cosmos3Config, dtype, attention: AttentionSpec) -> dict:
    """`MoTLayer`'s fields as `Cosmos3` builds its layers."""
    return dict(tower=tower_fields(c, dtype), attention=attention, reasoner_qk_norm=c.reasoner_qk_norm,
                reasoner_key_norm_for_generator=c.reasoner_key_norm_for_generator)


class MoTLayer(nn.Module):
    """One decoder layer: each token through its own tower, all tokens in one joint attention.

    The layer is its two halves in sequence: the reasoner's (which reads reasoner tokens only)
    and the generator's (which reads the reasoner's keys and values besides its own). Sampling
    calls them apart (`reasoner_half` once per prompt, `generator_half` every denoising step);
    training calls the layer, which is exactly the two in turn."""
    tower: dict  # TransformerBlock fields shared by both towers
    attention: AttentionSpec = AttentionSpec()
    reasoner_qk_norm: bool = True
    reasoner_key_norm_for_generator: bool = False

    def setup(self):
        self.reasoner = TransformerBlock(**self.tower, qk_norm=self.reasoner_qk_norm,
                                         side_key_norm=self.reasoner_key_norm_for_generator)
        self.generator = TransformerBlock(**self.tower)

    def __call__(self, carry, tokens_T, tokens_V, rope_T, rope_V):
        # Each tower's tokens apart, each input's sequence that of its own tower: a pipeline stage
        # may run on chunks of both sequences (`models.pipeline`), and the row's keys are then this
        # device's chunks of both, in the same order as their tokens.
        x_BTD, x_BVD = carry
        x_BTD, reasoner_kv = self.reasoner_half(x_BTD, tokens_T, rope_T)
        return x_BTD, self.generator_half(x_BVD, reasoner_kv, tokens_V, tokens_T.then(tokens_V), rope_V)

    def reasoner_half(self, x_BTD, tokens_T, rope_T):
        """The reasoner tokens' layer output, and (keys, values) [B, T, N, K] the generator's
        queries read of them: the keys through the side norm when the reasoner has one."""
        q_BTHK, k_BTNK, v_BTNK, k_for_gen_BTNK = self.reasoner.qkv(x_BTD, *rope_T)
        attn_BTHK = self.attention(q_BTHK, k_BTNK, v_BTNK, tokens_T, tokens_T)
        return self.reasoner.finish(x_BTD, attn_BTHK), (k_for_gen_BTNK, v_BTNK)

    def generator_half(self, x_BVD, reasoner_kv, tokens_V, tokens_S, rope_V):
        """The generator tokens' layer output: their queries over the row's keys, the reasoner's
        (`reasoner_kv`, from `reasoner_half`) then their own."""
        k_for_gen_BTNK, v_BTNK = reasoner_kv
        q_BVHK, k_BVNK, v_BVNK, _ = self.generator.qkv(x_BVD, *rope_V)
        k_BSNK = jnp.concatenate([k_for_gen_BTNK, k_BVNK], axis=1)
        v_BSNK = jnp.concatenate([v_BTNK, v_BVNK], axis=1)
        attn_BVHK = self.attention(q_BVHK, k_BSNK, v_BSNK, tokens_V, tokens_S)
        return self.generator.finish(x_BVD, attn_BVHK)


def timestep_features(sigma: jax.Array, dim: int) -> jax.Array:
    """Sinusoidal features of sigma in [0, 1], cos first (diffusers flip_sin_to_cos=True)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = sigma.astype(jnp.float32)[..., None] * freqs
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


class GeneratorIO(nn.Module):
    """Raw generator inputs in and predictions out: video (vae2llm / llm2vae), per-domain
    actions, sound; modality embeddings; the timestep embedding on noisy tokens only."""
    config: Cosmos3Config
    dtype: jnp.dtype

    def setup(self):
        c = self.config
        D, P, A, M, Z, Fq = c.d_model, c.latent_patch_dim, c.action_dim, c.num_action_domains, c.sound_dim, c.timestep_freq_dim
        zeros = nn.initializers.zeros
        self.vae2llm_PD = param(self, "vae2llm_PD", (P, D), ("latent", "embed"))
        self.vae2llm_bias_D = param(self, "vae2llm_bias_D", (D,), ("embed",), zeros)
        self.llm2vae_DP = param(self, "llm2vae_DP", (D, P), ("embed", "latent"))
        self.llm2vae_bias_P = param(self, "llm2vae_bias_P", (P,), ("latent",), zeros)
        self.action_in_MAD = param(self, "action_in_MAD", (M, A, D), ("domains", "action", "embed"),
                                   fan_in_axes=(1,), batch_axes=(0,))
        self.action_in_bias_MD = param(self, "action_in_bias_MD", (M, D), ("domains", "embed"), zeros)
        self.action_out_MDA = param(self, "action_out_MDA", (M, D, A), ("domains", "embed", "action"),
                                    fan_in_axes=(1,), batch_axes=(0,))
        self.action_out_bias_MA = param(self, "action_out_bias_MA", (M, A), ("domains", "action"), zeros)
        self.sound_in_ZD = param(self, "sound_in_ZD", (Z, D), ("sound", "embed"))
        self.sound_in_bias_D = param(self, "sound_in_bias_D", (D,), ("embed",), zeros)
        self.sound_out_DZ = param(self, "sound_out_DZ", (D, Z), ("embed", "sound"))
        self.sound_out_bias_Z = param(self, "sound_out_bias_Z", (Z,), ("sound",), zeros)
        # Rows: 0 unused (video tokens carry no modality embedding), 1 action, 2 sound.
        self.modality_embed_3D = param(self, "modality_embed_3D", (3, D), ("modality", "embed"), zeros)
        self.time_in_FD = param(self, "time_in_FD", (Fq, D), ("time_freq", "embed"))
        self.time_in_bias_D = param(self, "time_in_bias_D", (D,), ("embed",), zeros)
        self.time_out_DD = param(self, "time_out_DD", (D, D), ("time_hidden", "embed"))
        self.time_out_bias_D = param(self, "time_out_bias_D", (D,), ("embed",), zeros)

    def embed(self, x_BVC, modality_BV, domain_BV, noisy_BV, sigma_BV):
        c, dt = self.config, self.dtype
        P, A, M, Z = c.latent_patch_dim, c.action_dim, c.num_action_domains, c.sound_dim
        x_BVC = x_BVC.astype(dt)
        video_BVD = jnp.einsum("bvp,pd->bvd", x_BVC[..., :P], self.vae2llm_PD.astype(dt)) + self.vae2llm_bias_D.astype(dt)
        onehot_BVM = jax.nn.one_hot(domain_BV, M, dtype=dt)
        action_BVD = (jnp.einsum("bva,bvm,mad->bvd", x_BVC[..., :A], onehot_BVM, self.action_in_MAD.astype(dt))
                      + jnp.einsum("bvm,md->bvd", onehot_BVM, self.action_in_bias_MD.astype(dt)))
        sound_BVD = jnp.einsum("bvz,zd->bvd", x_BVC[..., :Z], self.sound_in_ZD.astype(dt)) + self.sound_in_bias_D.astype(dt)
        m = modality_BV[..., None]
        h_BVD = jnp.where(m == VIDEO, video_BVD, jnp.where(m == ACTION, action_BVD,
                                                            jnp.where(m == SOUND, sound_BVD, 0)))
        # Action and sound tokens carry a modality embedding, video tokens none (as in NVIDIA's
        # Cosmos3OmniTransformer); row 0 is never read, so it stays at its initial zeros.
        modality_BVD = embedding_lookup(self.modality_embed_3D, jnp.clip(modality_BV - 1, 0, 2), "modality").astype(dt)
        h_BVD = h_BVD + jnp.where((m == ACTION) | (m == SOUND), modality_BVD, 0)
        # Timestep embedding (fp32), added to noisy tokens only; clean conditioning gets nothing.
        t_BVD = nn.silu(timestep_features(sigma_BV, c.timestep_freq_dim) @ self.time_in_FD + self.time_in_bias_D)
        t_BVD = constrain(t_BVD, ("batch", "seq", "act_embed"))
        t_BVD = constrain(t_BVD @ self.time_out_DD + self.time_out_bias_D, ("batch", "seq", "act_embed"))
        h_BVD = h_BVD + constrain(jnp.where(noisy_BV[..., None], t_BVD, 0), ("batch", "seq", "act_embed")).astype(dt)
        return constrain(h_BVD, RESIDUAL_BLD)

    def predict(self, h_BVD, modality_BV, domain_BV):
        """Per-modality predictions in raw input space, zero-padded to C channels, fp32."""
        c = self.config
        M, C = c.num_action_domains, c.generator_in_dim
        h = h_BVD.astype(jnp.float32)
        video_BVP = h @ self.llm2vae_DP + self.llm2vae_bias_P
        onehot_BVM = jax.nn.one_hot(domain_BV, M, dtype=jnp.float32)
        action_BVA = (jnp.einsum("bvd,bvm,mda->bva", h, onehot_BVM, self.action_out_MDA)
                      + onehot_BVM @ self.action_out_bias_MA)
        sound_BVZ = h @ self.sound_out_DZ + self.sound_out_bias_Z
        pad = lambda y: jnp.pad(y, ((0, 0), (0, 0), (0, C - y.shape[-1])))
        m = modality_BV[..., None]
        return jnp.where(m == VIDEO, pad(video_BVP), jnp.where(m == ACTION, pad(action_BVA),
                                                              jnp.where(m == SOUND, pad(sound_BVZ), 0.0)))


class Cosmos3(nn.Module):
    config: Cosmos3Config
    dtype: jnp.dtype = jnp.bfloat16
    # How the layers run (chosen by the execution config, outside the model).
    stack: StackSpec = StackSpec()
    attention: AttentionSpec = AttentionSpec()
    # The rotary inverse frequencies, when they must equal another implementation's float32
    # table bit for bit (see `xlaopt.models.mrope.rope_cos_sin`); None: derived from the config.
    rope_inv_freq: tuple[float, ...] | None = None

    @nn.compact
    def __call__(self, batch: dict, gen_inputs_BVC: jax.Array | None = None, objective: tuple | None = None):
        """Returns (text logits [B,T,E] fp32, generator predictions [B,V,C] fp32).

        `gen_inputs_BVC` is what the generator reads: noised latents on noisy tokens,
        clean ones on conditioning tokens (default: the clean latents, e.g. at init).
        `objective` = (fn, data, counts), where the layer stack runs the loss inside it (a 1F1B
        pipeline): returns `fn(logits, predictions, gen_modality_BV, data, counts)`, (loss,
        terms), computed on the last stage one micro-batch at a time (`data` leads with rows).
        """
        if gen_inputs_BVC is None:
            gen_inputs_BVC = batch["gen_x0_BVC"]
        c, dt = self.config, self.dtype
        D, E = c.d_model, c.vocab_size
        text_seg_BT, gen_seg_BV = batch["text_segment_ids_BT"], batch["gen_segment_ids_BV"]

        embed_ED = param(self, "embed_ED", (E, D), ("vocab", "embed"), nn.initializers.normal(1.0))
        x_BTD = constrain(embedding_lookup(embed_ED, batch["text_tokens_BT"], "vocab").astype(dt),
                          RESIDUAL_BLD)
        io = GeneratorIO(c, dt, name="generator_io")
        x_BVD = io.embed(gen_inputs_BVC, batch["gen_modality_BV"], batch["gen_action_domain_BV"],
                         batch["gen_noisy_BV"], batch["gen_sigma_BV"])

        tokens_S, T = joint_tokens(text_seg_BT, gen_seg_BV), text_seg_BT.shape[1]
        rope = lambda pos: rope_tables(c, pos, self.rope_inv_freq)

        stack = LayerStack(MoTLayer, layer_fields(c, dt, self.attention), c.num_layers, self.stack, name="layers")
        args = (tokens_S.slice(0, T), tokens_S.slice(T, tokens_S.segment_BL.shape[1]),
                rope(batch["text_positions_3BT"]), rope(batch["gen_positions_3BV"]))
        reasoner_norm = RMSNorm(D, "embed", c.norm_eps, name="reasoner_final_norm")
        head_DE = param(self, "lm_head_DE", (D, E), ("embed", "vocab"))
        generator_norm = RMSNorm(D, "embed", c.norm_eps, name="generator_final_norm")
        modality_BV, domain_BV = batch["gen_modality_BV"], batch["gen_action_domain_BV"]
        if objective is not None and self.stack.loss_inside and not self.is_initializing():
            fn, data, counts = objective
            p = nn.meta.unbox(self.variables["params"])
            # The generator's output weights (a few D x channels) whole on every device: split as
            # their parameters are, the partitioner reshards them inside the tail's branch, a
            # collective-permute only the last stage's devices run, and XLA:CPU's permute waits
            # for every device of the program (cosmos3-tiny on stage=2,fsdp=2,tensor=2 hung).
            io = jax.tree.map(lambda w: constrain(w, (None,) * w.ndim), p["generator_io"])
            tail_params = {"reasoner_norm": p["reasoner_final_norm"]["scale"], "head_DE": head_DE,
                           "generator_norm": p["generator_final_norm"]["scale"], "io": io}

            def tail(tp, carry, rows, counts):
                modality_BV, domain_BV, data = rows
                logits_BTE, pred_BVC = _outputs(c, dt, tp, *carry, modality_BV, domain_BV)
                return fn(logits_BTE, pred_BVC, modality_BV, data, counts)

            return stack.loss((x_BTD, x_BVD), args, tail, tail_params, (modality_BV, domain_BV, data), counts)

        x_BTD, x_BVD = stack((x_BTD, x_BVD), *args)
        logits_BTE = head_logits(gathered(reasoner_norm(x_BTD)), head_DE.astype(dt))
        logits_BTE = constrain(logits_BTE, ("batch", "seq", "act_vocab"))
        pred_BVC = io.predict(gathered(generator_norm(x_BVD)), modality_BV, domain_BV)
        if objective is not None:
            fn, data, counts = objective
            return fn(logits_BTE, pred_BVC, modality_BV, data, counts)
        return logits_BTE, pred_BVC


def _outputs(c: Cosmos3Config, dt, tail_params: dict, x_BTD, x_BVD, modality_BV, domain_BV):
    """`Cosmos3.__call__`'s text logits and generator predictions from the stack's output, the
    final norms', head's and generator output's weights given (a 1F1B stack's tail)."""
    h_BTD = gathered(rms_norm(x_BTD, tail_params["reasoner_norm"], c.norm_eps))
    logits_BTE = constrain(head_logits(h_BTD, tail_params["head_DE"].astype(dt)), ("batch", "seq", "act_vocab"))
    h_BVD = gathered(rms_norm(x_BVD, tail_params["generator_norm"], c.norm_eps))
    pred_BVC = GeneratorIO(c, dt, parent=None).apply({"params": tail_params["io"]}, h_BVD, modality_BV, domain_BV,
                                        method=GeneratorIO.predict)
    return logits_BTE, pred_BVC


# ---- the two towers apart, for sampling: one-way flow (reasoner -> generator) means the
# reasoner's keys and values of a prompt do not depend on the generator tokens, so a sampler
# computes them once (`reasoner_kv`) and runs only the generator at each denoising step
# (`generator_given_kv`). Both bind the model's own `MoTLayer` halves to its trained parameters:
# `Cosmos3.__call__` computes the same two halves layer by layer.


def reasoner_kv(model: Cosmos3, params, batch: dict) -> tuple[jax.Array, jax.Array]:
    """The reasoner tower alone over the text region: per layer the keys the generator's queries
    read (side-normed in the Edge variant) and the values, each [L, B, T, N, K] in the compute
    dtype. Reads `text_tokens_BT`, `text_segment_ids_BT`, `text_positions_3BT` of `batch`."""
    c, dt = model.config, model.dtype
    text_seg_BT = batch["text_segment_ids_BT"]
    x_BTD = constrain(embedding_lookup(params["embed_ED"], batch["text_tokens_BT"], "vocab").astype(dt),
                      RESIDUAL_BLD)
    tokens_T = Tokens.of(text_seg_BT, jnp.zeros(text_seg_BT.shape, bool))  # = joint_tokens(...).slice(0, T)
    rope_T = rope_tables(c, batch["text_positions_3BT"], model.rope_inv_freq)
    layer = MoTLayer(**layer_fields(c, dt, model.attention))

    def body(x_BTD, params_i):
        return layer.apply({"params": params_i}, x_BTD, tokens_T, rope_T, method="reasoner_half")

    _, (k_LBTNK, v_LBTNK) = jax.lax.scan(body, x_BTD, {"reasoner": params["layers"]["reasoner"]})
    return k_LBTNK, v_LBTNK


def generator_given_kv(model: Cosmos3, params, batch: dict, gen_inputs_BVC: jax.Array, k_LBTNK: jax.Array,
                       v_LBTNK: jax.Array) -> jax.Array:
    """Generator predictions [B, V, C] (fp32), as `Cosmos3.__call__` returns them, from the
    reasoner's keys and values (`reasoner_kv`) instead of the text. Reads `text_segment_ids_BT`
    (whose sample each cached key belongs to) and the generator region's fields of `batch`; of
    `params`, only the generator's (the reasoner's weights and the embedding are not touched)."""
    c, dt = model.config, model.dtype
    io, io_params = GeneratorIO(c, dt), {"params": params["generator_io"]}
    x_BVD = io.apply(io_params, gen_inputs_BVC, batch["gen_modality_BV"], batch["gen_action_domain_BV"],
                     batch["gen_noisy_BV"], batch["gen_sigma_BV"], method="embed")
    tokens_S = joint_tokens(batch["text_segment_ids_BT"], batch["gen_segment_ids_BV"])
    tokens_V = tokens_S.slice(k_LBTNK.shape[2], tokens_S.segment_BL.shape[1])
    rope_V = rope_tables(c, batch["gen_positions_3BV"], model.rope_inv_freq)
    layer = MoTLayer(**layer_fields(c, dt, model.attention))

    def body(x_BVD, xs):
        params_i, k_BTNK, v_BTNK = xs
        return layer.apply({"params": params_i}, x_BVD, (k_BTNK, v_BTNK), tokens_V, tokens_S, rope_V,
                           method="generator_half"), None

    x_BVD, _ = jax.lax.scan(body, x_BVD, ({"generator": params["layers"]["generator"]}, k_LBTNK, v_LBTNK))
    h_BVD = RMSNorm(c.d_model, "embed", c.norm_eps).apply({"params": params["generator_final_norm"]}, x_BVD)
    return io.apply(io_params, h_BVD, batch["gen_modality_BV"], batch["gen_action_domain_BV"], method="predict")
