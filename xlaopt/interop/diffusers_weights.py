"""The reference's safetensors weights <-> xlaopt's Cosmos 3 parameter tree.

Import: every safetensors header of a diffusers directory is read first (JSON, no tensor
data) and checked against the tensors the config implies; any missing tensor, wrong shape,
unsupported dtype or unexpected tensor is reported in one `WeightsError` before anything is
placed or written. Then each parameter is built on its target sharding with
`jax.make_array_from_callback`: the callback reads, from memory-mapped files, only the
slice of each source tensor that the device's shard covers (transposes, head splits and
layer stacking are numpy views), so no full host copy of the model is ever made.

Export: parameter by parameter (one gathered leaf at a time) into safetensors shards, an
index when there is more than one, and config.json, written into a temporary directory that
is renamed into place only when complete.

The layout (diffusers -> xlaopt, per layer i of the scanned `layers`):
  layers.{i}.self_attn.to_q / add_q_proj .weight [H*K, D]  -> {reasoner,generator}/q_proj_DHK [L, D, H, K]
  ...to_k / add_k_proj, to_v / add_v_proj [N*K, D]           -> k_proj_DNK, v_proj_DNK [L, D, N, K]
  ...to_out / to_add_out .weight [D, H*K]                    -> o_proj_HKD [L, H, K, D]
  ...norm_q / norm_added_q, norm_k / norm_added_k .weight    -> q_norm/scale, k_norm/scale [L, K]
  ...self_attn.k_norm_und_for_gen.weight (Edge)                -> reasoner side_k_norm/scale [L, K]
  input_layernorm(_moe_gen), post_attention_layernorm(_moe_gen) -> attn_norm/scale, mlp_norm/scale
  mlp(_moe_gen).{gate,up}_proj [F, D], down_proj [D, F]      -> mlp/{gate,up}_DF, mlp/down_FD
and embed_tokens, lm_head, norm / norm_moe_gen, proj_in / proj_out (vae2llm / llm2vae),
time_embedder.linear_{1,2}, action_proj_{in,out}.{fc,bias} (per-domain [M, in*out] rows),
audio_proj_{in,out}, {action,audio}_modality_embed (rows 1, 2 of modality_embed_3D).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from typing import Callable

import jax
import ml_dtypes
import numpy as np

from xlaopt.errors import UserError
from xlaopt.interop import safetensors_io
from xlaopt.interop.diffusers_config import CONFIG_FILE, ReferenceSettings, diffusers_from_cosmos3, load_config
from xlaopt.interop.safetensors_io import SafetensorsCheckpoint, SafetensorsError
from xlaopt.models.cosmos3_config import Cosmos3Config

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
# The dtypes the reference's weights come in (and an export writes).
SUPPORTED_DTYPES = ("F32", "F16", "BF16")


class WeightsError(UserError):
    """Weights that do not fit the config; the message lists every problem."""


class SafetensorsDir(SafetensorsCheckpoint):
    """The tensors of a diffusers model directory (`diffusion_pytorch_model.safetensors`, or its
    shards and index), read through `xlaopt.interop.safetensors_io`: every header checked, the
    index's file names kept inside the directory, an array a view read when touched."""

    def __init__(self, directory):
        try:
            super().__init__(directory, WEIGHTS_NAME, INDEX_NAME)
        except SafetensorsError as e:
            raise WeightsError(str(e)) from None


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
    safetensors_io.write_safetensors(path, tensors, {"format": "pt"})


# ---------------------------------------------------------------------------------------
# The mapping: one entry per xlaopt parameter.
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Entry:
    """xlaopt parameter `path` from reference tensors `sources` (per layer, a `{i}` template
    when `stacked`): `to_ours(*arrays)` makes our layout (views), `from_ours(a)` the
    reference's tensors back (one per source), `shapes` the reference shapes expected."""
    path: tuple[str, ...]
    sources: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    to_ours: Callable
    from_ours: Callable
    stacked: bool = False


def _identity(name, shape, path, stacked=False):
    return Entry(path, (name,), (shape,), lambda a: a, lambda a: (a,), stacked)


def _transposed(name, shape, path, stacked=False):
    """nn.Linear weight [out, in] -> our [in, out]."""
    return Entry(path, (name,), (shape,), lambda a: a.T, lambda a: (a.T,), stacked)


def _split_out(name, shape, path, heads, head_dim, stacked=True):
    """Q/K/V [heads*head_dim, D] -> [D, heads, head_dim]."""
    D = shape[1]
    return Entry(path, (name,), (shape,), lambda a: a.T.reshape(D, heads, head_dim),
                 lambda a: (a.reshape(D, heads * head_dim).T,), stacked)


def _split_in(name, shape, path, heads, head_dim, stacked=True):
    """O [D, heads*head_dim] -> [heads, head_dim, D]."""
    D = shape[0]
    return Entry(path, (name,), (shape,), lambda a: a.T.reshape(heads, head_dim, D),
                 lambda a: (a.reshape(heads * head_dim, D).T,), stacked)


def _absent(path, shape):
    """A head the reference config does not have: zeros, nothing exported."""
    return Entry(path, (), (), lambda: np.zeros(shape, np.float32), lambda a: ())


TOWERS = {  # xlaopt tower -> reference module names (attention, norms, MLP)
    "reasoner": dict(q="to_q", k="to_k", v="to_v", o="to_out", qn="norm_q", kn="norm_k",
                     attn_norm="input_layernorm", mlp_norm="post_attention_layernorm", mlp="mlp"),
    "generator": dict(q="add_q_proj", k="add_k_proj", v="add_v_proj", o="to_add_out", qn="norm_added_q",
                      kn="norm_added_k", attn_norm="input_layernorm_moe_gen",
                      mlp_norm="post_attention_layernorm_moe_gen", mlp="mlp_moe_gen"),
}


def mapping(config: Cosmos3Config, settings: ReferenceSettings) -> list[Entry]:
    c = config
    D, H, N, K, F, E = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim, c.vocab_size
    P, A, M, Z, Fq = c.latent_patch_dim, c.action_dim, c.num_action_domains, c.sound_dim, c.timestep_freq_dim
    io = lambda name: ("generator_io", name)
    out = [
        _identity("embed_tokens.weight", (E, D), ("embed_ED",)),
        _transposed("lm_head.weight", (E, D), ("lm_head_DE",)),
        _identity("norm.weight", (D,), ("reasoner_final_norm", "scale")),
        _identity("norm_moe_gen.weight", (D,), ("generator_final_norm", "scale")),
        _transposed("proj_in.weight", (D, P), io("vae2llm_PD")),
        _identity("proj_in.bias", (D,), io("vae2llm_bias_D")),
        _transposed("proj_out.weight", (P, D), io("llm2vae_DP")),
        _identity("proj_out.bias", (P,), io("llm2vae_bias_P")),
        _transposed("time_embedder.linear_1.weight", (D, Fq), io("time_in_FD")),
        _identity("time_embedder.linear_1.bias", (D,), io("time_in_bias_D")),
        _transposed("time_embedder.linear_2.weight", (D, D), io("time_out_DD")),
        _identity("time_embedder.linear_2.bias", (D,), io("time_out_bias_D")),
    ]
    if settings.action_gen:
        out += [
            Entry(io("action_in_MAD"), ("action_proj_in.fc.weight",), ((M, A * D),),
                  lambda a: a.reshape(M, A, D), lambda a: (a.reshape(M, A * D),)),
            _identity("action_proj_in.bias.weight", (M, D), io("action_in_bias_MD")),
            Entry(io("action_out_MDA"), ("action_proj_out.fc.weight",), ((M, D * A),),
                  lambda a: a.reshape(M, D, A), lambda a: (a.reshape(M, D * A),)),
            _identity("action_proj_out.bias.weight", (M, A), io("action_out_bias_MA")),
        ]
    else:
        out += [_absent(io("action_in_MAD"), (M, A, D)), _absent(io("action_in_bias_MD"), (M, D)),
                _absent(io("action_out_MDA"), (M, D, A)), _absent(io("action_out_bias_MA"), (M, A))]
    if settings.sound_gen:
        out += [
            _transposed("audio_proj_in.weight", (D, Z), io("sound_in_ZD")),
            _identity("audio_proj_in.bias", (D,), io("sound_in_bias_D")),
            _transposed("audio_proj_out.weight", (Z, D), io("sound_out_DZ")),
            _identity("audio_proj_out.bias", (Z,), io("sound_out_bias_Z")),
        ]
    else:
        out += [_absent(io("sound_in_ZD"), (Z, D)), _absent(io("sound_in_bias_D"), (D,)),
                _absent(io("sound_out_DZ"), (D, Z)), _absent(io("sound_out_bias_Z"), (Z,))]
    # Modality embeddings: row 0 (video) has none in the reference; rows 1, 2 action, sound.
    names = [n for n, on in (("action_modality_embed", settings.action_gen),
                             ("audio_modality_embed", settings.sound_gen)) if on]
    rows = [1 + i for i, on in enumerate((settings.action_gen, settings.sound_gen)) if on]

    def modality_to_ours(*arrays):
        table = np.zeros((3, D), np.float32)
        for row, a in zip(rows, arrays):
            table[row] = a
        return table

    out.append(Entry(io("modality_embed_3D"), tuple(names), ((D,),) * len(names), modality_to_ours,
                     lambda a: tuple(a[r] for r in rows)))

    for tower, m in TOWERS.items():
        att = "layers.{i}.self_attn."
        lay = lambda *p, tower=tower: ("layers", tower) + p
        out += [
            _identity(f"layers.{{i}}.{m['attn_norm']}.weight", (D,), lay("attn_norm", "scale"), True),
            _split_out(att + m["q"] + ".weight", (H * K, D), lay("q_proj_DHK"), H, K),
            _split_out(att + m["k"] + ".weight", (N * K, D), lay("k_proj_DNK"), N, K),
            _split_out(att + m["v"] + ".weight", (N * K, D), lay("v_proj_DNK"), N, K),
            _split_in(att + m["o"] + ".weight", (D, H * K), lay("o_proj_HKD"), H, K),
        ]
        if tower == "generator" or c.reasoner_qk_norm:
            out += [_identity(att + m["qn"] + ".weight", (K,), lay("q_norm", "scale"), True),
                    _identity(att + m["kn"] + ".weight", (K,), lay("k_norm", "scale"), True)]
        if tower == "reasoner" and c.reasoner_key_norm_for_generator:
            out.append(_identity(att + "k_norm_und_for_gen.weight", (K,), lay("side_k_norm", "scale"), True))
        out += [
            _identity(f"layers.{{i}}.{m['mlp_norm']}.weight", (D,), lay("mlp_norm", "scale"), True),
            _transposed(f"layers.{{i}}.{m['mlp']}.up_proj.weight", (F, D), lay("mlp", "up_DF"), True),
            _transposed(f"layers.{{i}}.{m['mlp']}.down_proj.weight", (D, F), lay("mlp", "down_FD"), True),
        ]
        if c.mlp_activation == "swiglu":
            out.append(_transposed(f"layers.{{i}}.{m['mlp']}.gate_proj.weight", (F, D), lay("mlp", "gate_DF"), True))
    return out


def expected_tensors(config: Cosmos3Config, settings: ReferenceSettings) -> dict[str, tuple[int, ...]]:
    """Every reference tensor name the config implies, with its shape."""
    out = {}
    for e in mapping(config, settings):
        layers = range(config.num_layers) if e.stacked else [None]
        for src, shape in zip(e.sources, e.shapes):
            for i in layers:
                out[src.format(i=i) if e.stacked else src] = shape
    return out


def check_tensors(files: SafetensorsDir, config: Cosmos3Config, settings: ReferenceSettings) -> None:
    """Raise one `WeightsError` listing every missing, misshapen, mistyped or unexpected tensor."""
    expected = expected_tensors(config, settings)
    have = files.tensors
    missing = sorted(set(expected) - set(have))
    unexpected = sorted(set(have) - set(expected))
    wrong = sorted(f"{k}: {have[k].shape} (expected {expected[k]})" for k in set(expected) & set(have)
                   if tuple(have[k].shape) != tuple(expected[k]))
    dtypes = sorted(f"{k}: {v.dtype}" for k, v in have.items() if v.dtype not in SUPPORTED_DTYPES)
    problems = [f"{label} ({len(items)}): {', '.join(items)}" for label, items in
                (("missing tensors", missing), ("wrong shapes", wrong), ("unexpected tensors", unexpected),
                 (f"unsupported dtypes (supported: {', '.join(SUPPORTED_DTYPES)})", dtypes)) if items]
    if problems:
        raise WeightsError(f"{files.directory}: weights do not match the config ({config.num_layers} layers, "
                           f"d_model {config.d_model}): " + "; ".join(problems))


# ---------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------

def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _leaf_shape(e: Entry, config: Cosmos3Config) -> tuple[int, ...]:
    if not e.sources:
        return e.to_ours().shape
    probe = e.to_ours(*(np.broadcast_to(np.float32(0), s) for s in e.shapes))
    return ((config.num_layers,) if e.stacked else ()) + probe.shape


def _reader(e: Entry, files: SafetensorsDir, config: Cosmos3Config):
    """index (tuple of slices of our global shape) -> that block as fp32, read from the maps."""
    def read(index):
        if not e.sources:
            return np.ascontiguousarray(e.to_ours()[index], np.float32)
        if not e.stacked:
            return np.asarray(e.to_ours(*(files.array(s) for s in e.sources))[index], np.float32)
        layers = range(config.num_layers)[index[0]]
        blocks = [np.asarray(e.to_ours(*(files.array(s.format(i=i)) for s in e.sources))[index[1:]], np.float32)
                  for i in layers]
        return np.stack(blocks) if blocks else np.zeros((0,), np.float32)
    return read


def param_shardings(config: Cosmos3Config, mesh_spec=None, settings=None):
    """(our parameters' NamedShardings, the program) on `mesh_spec` after the pass pipeline
    (mesh layout), for training `settings` (default: `TrainSettings()`)."""
    from xlaopt.compile import compile_program
    from xlaopt.mesh import MeshSpec
    from xlaopt.pipeline import pipeline, run_pipeline
    from xlaopt.program import TrainProgram, TrainSettings

    program = TrainProgram(config, mesh_spec or MeshSpec(), settings=settings or TrainSettings())
    program, _ = run_pipeline(program, pipeline())
    return compile_program(program).state_shardings.params, program


def import_params(directory, shardings=None, name: str = "cosmos3-diffusers"):
    """(config, settings, params) from a diffusers directory; params (fp32) are placed on
    `shardings` (a tree like the params of NamedShardings; default: the first device)."""
    config, settings = load_config(directory, name)
    files = SafetensorsDir(directory)
    try:
        check_tensors(files, config, settings)
        params: dict = {}
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        # Source file order, so shards are streamed one after another.
        entries = sorted(mapping(config, settings), key=lambda e: str(
            files.tensors[e.sources[0].format(i=0)].file) if e.sources else "")
        for e in entries:
            sharding = default if shardings is None else _get(shardings, e.path)
            arr = jax.make_array_from_callback(_leaf_shape(e, config), sharding, _reader(e, files, config))
            _set(params, e.path, arr)
    finally:
        files.close()
    return config, settings, params


# ---------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------

def _host(a) -> np.ndarray:
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils
        a = multihost_utils.process_allgather(a, tiled=True)
    return np.asarray(jax.device_get(a), np.float32)


def export_tensors(params, config: Cosmos3Config, settings: ReferenceSettings, dtype=np.float32):
    """Yields (reference name, array) for every tensor, one xlaopt leaf gathered at a time."""
    for e in mapping(config, settings):
        if not e.sources:
            continue
        leaf = _host(_get(params, e.path))
        layers = range(config.num_layers) if e.stacked else [None]
        for i in layers:
            arrays = e.from_ours(leaf[i] if e.stacked else leaf)
            for src, a in zip(e.sources, arrays):
                yield (src.format(i=i) if e.stacked else src), np.ascontiguousarray(a).astype(dtype)


def export_diffusers(params, config: Cosmos3Config, settings: ReferenceSettings, out_dir,
                     dtype: str = "float32", max_shard_bytes: int = 5 << 30) -> list[str]:
    """Write config.json and safetensors shards (with an index when there are several) to
    `out_dir`, which must not exist yet; built in a temporary sibling and renamed when whole.
    Returns the files written."""
    out = pathlib.Path(out_dir)
    if out.exists():
        raise WeightsError(f"{out}: already exists; export writes a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    np_dtype = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}[dtype]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # Shards are written as they fill, so at most one shard is held in host memory.
        written: list[str] = []
        index: dict[str, str] = {}
        n = size = 0
        pending: dict[str, np.ndarray] = {}
        for name, a in export_tensors(params, config, settings, np_dtype):
            if pending and size + a.nbytes > max_shard_bytes:
                n += 1
                fname = f"part-{n:05d}.safetensors"
                write_safetensors(tmp / fname, pending)
                index.update(dict.fromkeys(pending, fname))
                pending, size = {}, 0
            pending[name] = a
            size += a.nbytes
        if n == 0:
            write_safetensors(tmp / WEIGHTS_NAME, pending)
            written.append(WEIGHTS_NAME)
        else:
            n += 1
            fname = f"part-{n:05d}.safetensors"
            write_safetensors(tmp / fname, pending)
            index.update(dict.fromkeys(pending, fname))
            renamed = {}
            for i in range(1, n + 1):  # diffusers' naming: ...-00001-of-00003.safetensors
                final = f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors"
                (tmp / f"part-{i:05d}.safetensors").rename(tmp / final)
                renamed[f"part-{i:05d}.safetensors"] = final
                written.append(final)
            total = sum((tmp / f).stat().st_size for f in written)
            (tmp / INDEX_NAME).write_text(json.dumps(
                {"metadata": {"total_size": total},
                 "weight_map": {k: renamed[v] for k, v in sorted(index.items())}}, indent=2))
            written.append(INDEX_NAME)
        (tmp / CONFIG_FILE).write_text(json.dumps(diffusers_from_cosmos3(config, settings), indent=2, sort_keys=True))
        written.append(CONFIG_FILE)
        os.chmod(tmp, 0o755)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written
