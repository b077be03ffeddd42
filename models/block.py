"""The pre-norm transformer block shared by the model families."""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from xlaopt.models import remat
from xlaopt.models.fp8 import project_all
from xlaopt.models.layers import (
    RESIDUAL_BLD,
    Mlp,
    RMSNorm,
    constrain,
    gathered,
    gathered_gradient,
    onto_residual_shards,
    param,
    reduce_matmul,
)
from xlaopt.models.mrope import apply_rope


class TransformerBlock(nn.Module):
    """One pre-norm transformer block's weights: norms, GQA projections (optionally with
    per-head QK RMSNorm), MLP. A Cosmos 3 layer holds two (one per tower); a decoder LLM one.
    `side_key_norm`: a second key norm, for keys another tower's queries read (Cosmos 3 Edge)."""
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    mlp_activation: str
    norm_eps: float
    dtype: jnp.dtype
    qk_norm: bool = True
    side_key_norm: bool = False

    def setup(self):
        D, H, N, K = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
        self.attn_norm = RMSNorm(D, "embed", self.norm_eps)
        self.q_proj_DHK = param(self, "q_proj_DHK", (D, H, K), ("embed", "heads", "head_dim"))
        self.k_proj_DNK = param(self, "k_proj_DNK", (D, N, K), ("embed", "kv_heads", "head_dim"))
        self.v_proj_DNK = param(self, "v_proj_DNK", (D, N, K), ("embed", "kv_heads", "head_dim"))
        self.o_proj_HKD = param(self, "o_proj_HKD", (H, K, D), ("heads", "head_dim", "embed"), fan_in_axes=(0, 1))
        if self.qk_norm:
            self.q_norm = RMSNorm(K, "head_dim", self.norm_eps)
            self.k_norm = RMSNorm(K, "head_dim", self.norm_eps)
        if self.side_key_norm:
            self.side_k_norm = RMSNorm(K, "head_dim", self.norm_eps)
        self.mlp_norm = RMSNorm(D, "embed", self.norm_eps)
        self.mlp = Mlp(D, self.mlp_dim, self.mlp_activation, self.dtype, onto_residual_shards)

    def qkv(self, x_BLD, cos_BLK=None, sin_BLK=None):
        """Rotated queries and keys (unrotated without a rotary table: models with learned
        positions), values; plus the side keys (`side_key_norm`) or the keys again."""
        h_BLD = checkpoint_name(gathered(self.attn_norm(x_BLD)), remat.ATTENTION_NORM)
        q_BLHK, raw_k_BLNK, v_BLNK = project_all(
            ("bld,dhk->blhk", "bld,dnk->blnk", "bld,dnk->blnk"), h_BLD,
            tuple(w.astype(self.dtype) for w in (self.q_proj_DHK, self.k_proj_DNK, self.v_proj_DNK)), onto_residual_shards)
        q_BLHK, raw_k_BLNK, v_BLNK = (checkpoint_name(y, name) for y, name in
                                      ((q_BLHK, remat.QUERY), (raw_k_BLNK, remat.KEY), (v_BLNK, remat.VALUE)))
        k_BLNK = raw_k_BLNK
        if self.qk_norm:
            q_BLHK, k_BLNK = self.q_norm(q_BLHK), self.k_norm(raw_k_BLNK)
        kv_axes = ("batch", "seq", "act_kv_heads", "head_dim")
        rotate = (lambda x: x) if cos_BLK is None else (lambda x: apply_rope(x, cos_BLK, sin_BLK))
        q_BLHK = constrain(rotate(q_BLHK), ("batch", "seq", "act_heads", "head_dim"))
        k_BLNK = constrain(rotate(k_BLNK), kv_axes)
        side_k_BLNK = constrain(rotate(self.side_k_norm(raw_k_BLNK)), kv_axes) if self.side_key_norm else k_BLNK
        return q_BLHK, k_BLNK, constrain(v_BLNK, kv_axes), side_k_BLNK

    def finish(self, x_BLD, attn_BLHK):
        """Output projection and MLP, each with its residual."""
        attn_BLHK = checkpoint_name(attn_BLHK, remat.CONTEXT)
        out_BLD = reduce_matmul("blhk,hkd->bld", attn_BLHK, self.o_proj_HKD.astype(self.dtype), 2, 0)
        x_BLD = constrain(x_BLD + gathered_gradient(checkpoint_name(out_BLD, remat.OUT)), RESIDUAL_BLD)
        x_BLD = x_BLD + gathered_gradient(self.mlp(checkpoint_name(gathered(self.mlp_norm(x_BLD)), remat.MLP_NORM)))
        return constrain(x_BLD, RESIDUAL_BLD)
