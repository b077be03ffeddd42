"""A diffusers `Cosmos3OmniTransformer` config.json <-> xlaopt's `Cosmos3Config`.

Every field of the reference config is either mapped to a `Cosmos3Config` field, kept as a
`ReferenceSettings` field (things the reference's pipeline or forward call reads that are
not model weights: which generator heads exist, the timestep scale), or rejected. The fps
modulation of mRoPE positions is model config: xlaopt's packer builds positions by it. Unknown fields and unsupported values are all listed in one
`UserError`, never silently dropped.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from xlaopt.errors import UserError
from xlaopt.models.cosmos3_config import Cosmos3Config
from xlaopt.models.registry import ConfigError

CLASS_NAME = "Cosmos3OmniTransformer"
CONFIG_FILE = "config.json"
TIMESTEP_CHANNELS = 256  # diffusers `Timesteps(num_channels=256)`, fixed in the reference
# The reference's timestep embedding reads timestep * timestep_scale; its pipeline passes
# timestep = sigma * num_train_timesteps (1000), xlaopt's model reads sigma itself.
NUM_TRAIN_TIMESTEPS = 1000
ACTIVATIONS = {"silu": "swiglu", "relu2": "relu2"}
# The one placeholder width of a generator head the reference config does not have.
ABSENT_DIM = 1


class DiffusersConfigError(UserError):
    """A config.json xlaopt cannot represent; the message lists every offending field."""


@dataclasses.dataclass(frozen=True)
class ReferenceSettings:
    """What the reference config says beyond xlaopt's model config. Kept alongside the
    parameters (checkpoint metadata) so an export writes the same config.json back."""
    action_gen: bool = False
    sound_gen: bool = False
    # As written; it only has an effect without qk_norm_for_text (see the config's
    # reasoner_key_norm_for_generator), so it is kept to write the same config back.
    use_und_k_norm_for_gen: bool = False
    timestep_scale: float = 0.001
    rope_scaling: dict | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ReferenceSettings":
        return cls(**d)


def _check(ok: bool, problems: list[str], message: str) -> None:
    if not ok:
        problems.append(message)


def cosmos3_from_diffusers(raw: dict[str, Any], name: str = "cosmos3-diffusers"
                           ) -> tuple[Cosmos3Config, ReferenceSettings]:
    """Map a config.json dict; raises `DiffusersConfigError` listing every unknown field and
    every unsupported value at once."""
    problems: list[str] = []
    cfg = dict(raw)
    cls_name = cfg.pop("_class_name", CLASS_NAME)
    _check(cls_name == CLASS_NAME, problems, f"_class_name={cls_name!r} (expected {CLASS_NAME!r})")
    for key in [k for k in cfg if k.startswith("_")]:  # _diffusers_version, _name_or_path: provenance
        cfg.pop(key)
    cfg.pop("dtype", None)  # a load-time hint of the reference (ignore_for_config), not architecture

    get = lambda key, default: cfg.pop(key, default)
    d = dict(
        head_dim=get("head_dim", 128), d_model=get("hidden_size", 4096), mlp_dim=get("intermediate_size", 12288),
        num_heads=get("num_attention_heads", 32), num_layers=get("num_hidden_layers", 36),
        num_kv_heads=get("num_key_value_heads", 8), norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=float(get("rope_theta", 5e6)), vocab_size=get("vocab_size", 151936),
        latent_channels=get("latent_channel", 48), patch_size=get("latent_patch_size", 2),
        temporal_margin=get("unified_3d_mrope_temporal_modality_margin", 15000),
        fps_modulation=bool(get("enable_fps_modulation", True)), base_fps=get("base_fps", 24),
        sound_latent_fps=float(get("sound_latent_fps", 25.0)),
        timestep_freq_dim=TIMESTEP_CHANNELS,
    )
    act = get("hidden_act", "silu")
    _check(act in ACTIVATIONS, problems, f"hidden_act={act!r} (supported: {', '.join(ACTIVATIONS)})")
    d["mlp_activation"] = ACTIVATIONS.get(act, "swiglu")

    patch_latent_dim = get("patch_latent_dim", 192)
    _check(patch_latent_dim == d["latent_channels"] * d["patch_size"] ** 2, problems,
           f"patch_latent_dim={patch_latent_dim} != latent_channel*latent_patch_size^2="
           f"{d['latent_channels'] * d['patch_size'] ** 2} (xlaopt patchifies the latent exactly)")

    d["mrope_sections"], rope_scaling = _mrope(get, problems)

    _check(not get("attention_bias", False), problems,
           "attention_bias=True (xlaopt's Q/K/V/O projections have no bias)")
    _check(float(get("attention_dropout", 0.0)) == 0.0, problems, "attention_dropout != 0 (not implemented)")
    _check(get("unified_3d_mrope_reset_spatial_ids", True) is True, problems,
           "unified_3d_mrope_reset_spatial_ids=False (xlaopt's packer restarts h, w at 0 per segment)")
    # The reference builds the separate key norm only for a reasoner without its own QK norm.
    d["reasoner_qk_norm"] = bool(get("qk_norm_for_text", True))
    und_k_for_gen = bool(get("use_und_k_norm_for_gen", False))
    d["reasoner_key_norm_for_generator"] = und_k_for_gen and not d["reasoner_qk_norm"]
    timestep_scale = float(get("timestep_scale", 0.001))
    _check(abs(timestep_scale * NUM_TRAIN_TIMESTEPS - 1.0) < 1e-12, problems,
           f"timestep_scale={timestep_scale} (xlaopt embeds sigma = timestep/{NUM_TRAIN_TIMESTEPS} directly; "
           f"only {1 / NUM_TRAIN_TIMESTEPS} maps)")

    action_gen = bool(get("action_gen", False))
    action_dim = get("action_dim", None)
    domains = get("num_embodiment_domains", 32)
    _check(not action_gen or (action_dim or 0) > 0, problems, "action_gen=True needs a positive action_dim")
    d["action_dim"] = int(action_dim) if action_gen else ABSENT_DIM
    d["num_action_domains"] = int(domains) if action_gen else ABSENT_DIM
    sound_gen = bool(get("sound_gen", False))
    sound_dim = get("sound_dim", None)
    _check(not sound_gen or (sound_dim or 0) > 0, problems, "sound_gen=True needs a positive sound_dim")
    d["sound_dim"] = int(sound_dim) if sound_gen else ABSENT_DIM

    settings = ReferenceSettings(
        action_gen=action_gen, sound_gen=sound_gen, use_und_k_norm_for_gen=und_k_for_gen, timestep_scale=timestep_scale, rope_scaling=rope_scaling)
    unknown = sorted(cfg)
    if unknown:
        problems.insert(0, f"unknown fields {unknown}")
    if problems:
        raise DiffusersConfigError(f"{CLASS_NAME} config cannot be imported: " + "; ".join(problems))
    try:
        config = Cosmos3Config(name=name, **d)
    except ConfigError as e:
        raise DiffusersConfigError(f"{CLASS_NAME} config maps to an invalid xlaopt config: {e}") from e
    return config, settings


def _mrope(get, problems: list[str]) -> tuple[tuple[int, ...], dict | None]:
    """(mRoPE sections, the rope_scaling entry as given): only interleaved mRoPE over the sections
    of rope_axes_dim maps."""
    rope_scaling = get("rope_scaling", None)
    axes = get("rope_axes_dim", None)
    if axes is None:
        axes = (rope_scaling or {}).get("mrope_section", [24, 20, 20])
    if rope_scaling is not None:
        bad = {k: v for k, v in rope_scaling.items()
               if not ((k == "mrope_section" and list(v) == list(axes))
                       or (k in ("type", "rope_type") and v in ("default", "mrope"))
                       or (k == "mrope_interleaved" and v is True))}
        _check(not bad, problems, f"rope_scaling entries {bad} (supported: interleaved mRoPE with "
                                  f"mrope_section equal to rope_axes_dim, rope_type default/mrope)")
    return tuple(int(a) for a in axes), rope_scaling


def diffusers_from_cosmos3(config: Cosmos3Config, settings: ReferenceSettings) -> dict[str, Any]:
    """The config.json (as a dict) of a reference model with `config`'s shapes."""
    if config.mlp_activation not in ACTIVATIONS.values():
        raise DiffusersConfigError(f"mlp_activation={config.mlp_activation!r} has no reference equivalent")
    if config.timestep_freq_dim != TIMESTEP_CHANNELS:
        raise DiffusersConfigError(f"timestep_freq_dim={config.timestep_freq_dim}: the reference embeds "
                                   f"{TIMESTEP_CHANNELS} sinusoidal channels")
    act = {v: k for k, v in ACTIVATIONS.items()}[config.mlp_activation]
    out = {
        "_class_name": CLASS_NAME,
        "action_dim": config.action_dim if settings.action_gen else None,
        "action_gen": settings.action_gen,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "base_fps": config.base_fps,
        "enable_fps_modulation": config.fps_modulation,
        "head_dim": config.head_dim,
        "hidden_act": act,
        "hidden_size": config.d_model,
        "intermediate_size": config.mlp_dim,
        "latent_channel": config.latent_channels,
        "latent_patch_size": config.patch_size,
        "num_attention_heads": config.num_heads,
        "num_embodiment_domains": config.num_action_domains if settings.action_gen else 32,
        "num_hidden_layers": config.num_layers,
        "num_key_value_heads": config.num_kv_heads,
        "patch_latent_dim": config.latent_patch_dim,
        "qk_norm_for_text": config.reasoner_qk_norm,
        "rms_norm_eps": config.norm_eps,
        "rope_axes_dim": list(config.mrope_sections),
        "rope_scaling": settings.rope_scaling,
        "rope_theta": config.rope_theta,
        "sound_dim": config.sound_dim if settings.sound_gen else None,
        "sound_gen": settings.sound_gen,
        "sound_latent_fps": config.sound_latent_fps,
        "timestep_scale": settings.timestep_scale,
        "unified_3d_mrope_reset_spatial_ids": True,
        "unified_3d_mrope_temporal_modality_margin": config.temporal_margin,
        "use_und_k_norm_for_gen": settings.use_und_k_norm_for_gen or config.reasoner_key_norm_for_generator,
        "vocab_size": config.vocab_size,
    }
    return out


def read_config(directory) -> dict[str, Any]:
    path = pathlib.Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise DiffusersConfigError(f"{directory}: no {CONFIG_FILE} (a diffusers model directory holds "
                                   f"{CONFIG_FILE} and diffusion_pytorch_model*.safetensors)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DiffusersConfigError(f"{path}: not JSON: {e}") from e


def load_config(directory, name: str = "cosmos3-diffusers") -> tuple[Cosmos3Config, ReferenceSettings]:
    return cosmos3_from_diffusers(read_config(directory), name)
