"""Parity with NVIDIA's reference: the same sample through diffusers' `Cosmos3OmniTransformer`
(torch, CPU, float32) and through xlaopt's model with the imported weights; predictions
compared per modality.

`max_abs_diff` is the largest elementwise difference; `max_rel_diff` divides it by the
largest magnitude of the reference's prediction for that modality (elementwise ratios blow
up on near-zero outputs and say nothing). Tolerances:
  float32: 1e-5. Both sides compute the same function in fp32 and differ only in the order
    of their sums (matmuls of 16-256 terms, attention over tens of keys, 1-3 layers) and in
    exp / rsqrt / cos implementations: each is a few ulps (fp32 ulp = 1.2e-7), amplified
    by <= 10x through a few layers, so ~1e-6 is expected and 1e-5 leaves headroom while a
    real mistake (a swapped head, a missing norm, a wrong mask, a transposed weight, a 1-ulp
    change of one rotary frequency at positions ~15000) shows as 1e-4 to 1.
  bfloat16: 5e-2 (xlaopt computes in bf16 with fp32 softmax, norms and master weights; the
    reference stays fp32). One bf16 rounding is 2^-9 = 0.2% relative; inputs, weights and
    activations are rounded at every matmul of every layer, so errors of a few tenths of a
    percent up to ~2% are normal here, while a wiring mistake is still >= 10% or larger.
The rotary frequencies: by default xlaopt uses the reference's own fp32 table (read from
the torch module), because torch's fp32 `pow` is not correctly rounded and xlaopt's table
(correctly rounded) differs from it by one ulp in a few frequencies, which at the
generator's temporal offset (~15000) moves angles by up to ~1e-3 rad; `rope_table="xlaopt"`
measures that effect instead (on the tiny random test models: up to 2.4e-6 relative, inside
the fp32 tolerance; with trained weights and long clips it can be larger).
"""
from __future__ import annotations

import pathlib
import tempfile

import numpy as np

from xlaopt.errors import UserError
from xlaopt.interop import reference_forward as rf
from xlaopt.interop.diffusers_weights import import_params

TOLERANCES = {"float32": 1e-5, "bfloat16": 5e-2}
MODALITIES = ("vision", "sound", "action")


def _require_reference():
    try:
        import torch  # noqa: F401
        from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
    except ImportError as e:
        raise UserError(f"parity needs torch and diffusers (pip install -e '.[parity]'): {e}") from e
    return Cosmos3OmniTransformer


def random_reference(config: dict, seed: int, directory):
    """A reference model of `config` (a config.json dict) with every parameter random (norm
    scales and modality embeddings too, so none can hide as ones or zeros), saved to
    `directory` in the diffusers layout; returns the torch module."""
    import torch

    cls = _require_reference()
    torch.manual_seed(seed)
    model = cls(**{k: v for k, v in config.items() if not k.startswith("_")}).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "norm_" in name or name.endswith("layernorm.weight") \
                    or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / max(p.shape[-1], 1) ** 0.5
                                                               if p.ndim > 1 else 0.1))
    model.save_pretrained(str(directory))
    return model


def _to_torch(kw: dict) -> dict:
    import torch

    def conv(k, v):
        if v is None:
            return None
        if k in rf.INT_KWARGS:
            return int(v)
        if k.endswith("_shapes"):
            return [tuple(int(x) for x in s) for s in v]
        if isinstance(v, list):
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in v]
        return torch.from_numpy(np.ascontiguousarray(v))
    return {k: conv(k, v) for k, v in kw.items()}


def run_reference(model, kw: dict) -> dict:
    import torch

    with torch.no_grad():
        vision, sound, action = model(**_to_torch(kw), return_dict=False)
    as_np = lambda xs: None if xs is None else [x.float().numpy() for x in xs]
    return {"vision": as_np(vision), "sound": as_np(sound), "action": as_np(action)}


def compare(ours: dict, ref: dict, tolerance: float) -> dict:
    out = {}
    for m in MODALITIES:
        if ref.get(m) is None and ours.get(m) is None:
            continue
        if (ref.get(m) is None) != (ours.get(m) is None) or len(ref[m]) != len(ours[m]):
            out[m] = {"ok": False, "error": "one side predicted this modality and the other did not"}
            continue
        if any(a.shape != b.shape for a, b in zip(ours[m], ref[m])):
            out[m] = {"ok": False, "error": f"shapes {[a.shape for a in ours[m]]} vs {[b.shape for b in ref[m]]}"}
            continue
        a = np.concatenate([x.ravel() for x in ours[m]]).astype(np.float64)
        b = np.concatenate([x.ravel() for x in ref[m]]).astype(np.float64)
        abs_diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        rel = abs_diff / scale if scale > 0 else abs_diff
        out[m] = {"max_abs_diff": abs_diff, "max_rel_diff": rel, "ref_max_abs": scale,
                  "elements": int(a.size), "ok": bool(rel <= tolerance)}
    return out


def run_parity(diffusers_dir=None, config: dict | None = None, seed: int = 0, inputs_npz=None, dump=None,
               dtype: str = "float32", rope_table: str = "reference", sample_args: dict | None = None) -> dict:
    """Run the reference and xlaopt on one sample and compare. Either `diffusers_dir` (a
    saved `Cosmos3OmniTransformer`) or `config` (a config.json dict: a random model of it is
    built from `seed`, saved and imported). The sample is `inputs_npz` or one built from
    `seed` covering every modality the model has."""
    if dtype not in TOLERANCES:
        raise UserError(f"dtype {dtype!r}; use one of {', '.join(TOLERANCES)}")
    if rope_table not in ("reference", "xlaopt"):
        raise UserError(f"rope_table {rope_table!r}; use reference or xlaopt")
    if (diffusers_dir is None) == (config is None):
        raise UserError("give a diffusers directory or a reference config, not both or neither")
    cls = _require_reference()
    with tempfile.TemporaryDirectory(prefix="xlaopt-parity-") as tmp:
        if diffusers_dir is None:
            diffusers_dir = pathlib.Path(tmp) / "reference"
            reference = random_reference(config, seed, diffusers_dir)
        else:
            import torch
            reference = cls.from_pretrained(str(diffusers_dir), torch_dtype=torch.float32).eval()
        our_config, settings, params = import_params(diffusers_dir)
    kw = rf.load_sample(inputs_npz) if inputs_npz is not None else rf.make_sample(
        our_config, settings, seed, **(sample_args or {}))
    ref = run_reference(reference, kw)
    inv_freq = (tuple(float(x) for x in reference.rotary_emb.inv_freq.float().numpy())
                if rope_table == "reference" else None)
    ours = rf.forward(params, our_config, settings, kw, dtype, inv_freq)
    if dump is not None:
        np.savez(dump, **{f"{m}_{i}": a for m in MODALITIES if ours.get(m) is not None
                          for i, a in enumerate(ours[m])})
    tolerance = TOLERANCES[dtype]
    per = compare(ours, ref, tolerance)
    return {"dtype": dtype, "tolerance": tolerance, "rope_table": rope_table, "seed": seed,
            "inputs": str(inputs_npz) if inputs_npz is not None else None,
            "config": {"num_layers": our_config.num_layers, "d_model": our_config.d_model,
                       "num_heads": our_config.num_heads, "num_kv_heads": our_config.num_kv_heads,
                       "head_dim": our_config.head_dim, "mrope_sections": list(our_config.mrope_sections),
                       "mlp_activation": our_config.mlp_activation, "sound": settings.sound_gen,
                       "action": settings.action_gen},
            "modalities": per, "ok": all(v["ok"] for v in per.values())}


def format_parity(result: dict) -> str:
    lines = [f"parity ({result['dtype']}, tolerance {result['tolerance']:g} relative to the reference's max |value|):"]
    for m, r in result["modalities"].items():
        if "error" in r:
            lines.append(f"  {m:7s} MISMATCH: {r['error']}")
        else:
            lines.append(f"  {m:7s} max_abs_diff {r['max_abs_diff']:.3g}  max_rel_diff {r['max_rel_diff']:.3g}  "
                         f"{'ok' if r['ok'] else 'MISMATCH'}")
    lines.append("ok" if result["ok"] else "MISMATCH")
    return "\n".join(lines)
