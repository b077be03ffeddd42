"""Hugging Face `transformers` Llama checkpoints (`LlamaForCausalLM`: config.json and
model.safetensors, or model-0000K-of-0000N.safetensors shards with model.safetensors.index.json)
<-> xlaopt's decoder (`models.decoder.Decoder`, `DecoderConfig`).

The config: every config.json key is mapped, ignored as not the model's math (provenance,
generation defaults, token ids), or refused; anything xlaopt's decoder does not compute
(biases, another activation, a RoPE scaling other than Llama 3.1's, quantized weights, an
unknown key) is listed in one `HFLlamaError` before any weight is read.

The layout (transformers -> xlaopt, layer i of the stacked `layers/block`, [L, ...]):
  model.embed_tokens.weight [E, D]                -> embed_ED
  model.layers.{i}.self_attn.q_proj.weight [H*K, D] -> q_proj_DHK [L, D, H, K]
  ....k_proj / v_proj.weight [N*K, D]             -> k_proj_DNK / v_proj_DNK [L, D, N, K]
  ....o_proj.weight [D, H*K]                      -> o_proj_HKD [L, H, K, D]
  ....input_layernorm / post_attention_layernorm  -> attn_norm/scale, mlp_norm/scale [L, D]
  ....mlp.gate_proj / up_proj.weight [F, D]       -> mlp/gate_DF, mlp/up_DF [L, D, F]
  ....mlp.down_proj.weight [D, F]                 -> mlp/down_FD [L, F, D]
  model.norm.weight                               -> final_norm/scale
  lm_head.weight [E, D]                           -> lm_head_DE (absent when tied)
RoPE: transformers' Llama rotates the pairs (j, j + K/2) of each head (`rotate_half`), and so
does xlaopt (`models.mrope.apply_rope`, tables `cat(angles, angles)`), so q/k rows map as they
are. (Meta's original consolidated checkpoints rotate interleaved pairs (2j, 2j + 1);
transformers' converter already permuted their q/k rows, so an HF-layout file never needs it.)
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any, Callable

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np

from xlaopt.errors import UserError
from xlaopt.interop.safetensors_io import SafetensorsCheckpoint, write_safetensors
from xlaopt.models.decoder import DecoderConfig
from xlaopt.models.registry import ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
ARCHITECTURE = "LlamaForCausalLM"
# Keys of a config.json that do not change what the model computes: provenance, the
# `PretrainedConfig` switches for outputs and generation defaults, token ids, the init scale.
# pretraining_tp only split the projections into slices in old transformers (the same sums).
IGNORED = frozenset("""
    _name_or_path transformers_version torch_dtype dtype use_cache initializer_range pretraining_tp
    bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id return_dict
    output_hidden_states output_attentions output_scores return_dict_in_generate torchscript use_bfloat16
    id2label label2id problem_type finetuning_task tokenizer_class prefix task_specific_params
    chunk_size_feed_forward is_encoder_decoder is_decoder add_cross_attention cross_attention_hidden_size
    tie_encoder_decoder tf_legacy_loss pruned_heads max_length min_length do_sample early_stopping num_beams
    num_beam_groups diversity_penalty temperature top_k top_p typical_p repetition_penalty length_penalty
    no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids num_return_sequences
    forced_bos_token_id forced_eos_token_id remove_invalid_values exponential_decay_length_penalty
    suppress_tokens begin_suppress_tokens""".split())
# key -> (the value xlaopt computes, why another is refused); a missing or null key means this value.
FIXED = {
    "hidden_act": ("silu", "xlaopt's decoder MLP is SwiGLU (silu-gated)"),
    "attention_bias": (False, "xlaopt's q/k/v/o projections have no bias"),
    "mlp_bias": (False, "xlaopt's MLP projections have no bias"),
    "attention_dropout": (0.0, "xlaopt trains without attention dropout"),
    "model_type": ("llama", "only transformers' Llama maps here"),
    "architectures": ([ARCHITECTURE], f"only {ARCHITECTURE}'s tensors (with their LM head) map here"),
    "quantization_config": (None, "quantized weights are not imported"),
}
ALIASES = {"hidden_act": ("swish",)}  # transformers' ACT2FN: swish is silu


class HFLlamaError(UserError):
    """A Llama checkpoint xlaopt cannot represent, or params that cannot be written as one."""


def _number(d: dict, key: str, kind: type, problems: list[str], label: str = "", default=None):
    """`d.pop(key)` as a positive int or float (`default` if absent); else a problem, and None."""
    value = d.pop(key, default)
    ok = type(value) in ((int,) if kind is int else (int, float)) and value > 0  # NaN fails too
    if not ok:
        problems.append(f"{label}{key}={value!r} (expected a positive {'int' if kind is int else 'number'})")
        return None
    return kind(value)


def _rope(cfg: dict, problems: list[str]) -> dict[str, Any]:
    """The `DecoderConfig` RoPE fields of config.json's rope_theta and rope_scaling (transformers
    4.x) or rope_parameters (5.x, which holds rope_theta too); popped from `cfg`."""
    key, rope = "rope_scaling", {}
    for k in ("rope_scaling", "rope_parameters"):
        given = cfg.pop(k, None)
        if given is not None and not isinstance(given, dict):
            problems.append(f"{k}={given!r} (expected an object)")
        elif given:
            key, rope = k, {**rope, **given}
    top = "rope_theta" in cfg
    theta = _number(cfg, "rope_theta", float, problems, default=10000.0)  # transformers' default
    if "rope_theta" in rope:
        inner = _number(rope, "rope_theta", float, problems, f"{key}.")
        if top and theta != inner:
            problems.append(f"rope_theta={theta} differs from {key}.rope_theta={inner}")
        theta = inner
    kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    if rope.get("type", kind) != kind:
        problems.append(f"{key}.type={rope['type']!r} differs from its rope_type={kind!r}")
    rope.pop("type", None)
    if rope.pop("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"{key}.partial_rotary_factor != 1 (xlaopt rotates the whole head)")
    out: dict[str, Any] = {"rope_theta": theta}
    if kind == "llama3":
        # The same four numbers as `models.rope_scaling.llama3_inv_freq`'s, by the same formula.
        for ours, theirs, t in (("rope_scaling_factor", "factor", float), ("rope_low_freq_factor", "low_freq_factor", float),
                                ("rope_high_freq_factor", "high_freq_factor", float),
                                ("rope_original_max_positions", "original_max_position_embeddings", int)):
            out[ours] = _number(rope, theirs, t, problems, f"{key}.")
    elif kind != "default":
        problems.append(f"{key}.rope_type={kind!r} (xlaopt implements 'default' and 'llama3')")
        return out
    if rope:
        problems.append(f"{key} entries {rope} (not part of rope_type {kind!r})")
    return out


def config_from_hf(config_json: dict, name: str = "hf-llama") -> DecoderConfig:
    """A transformers Llama config.json (as a dict) as a `DecoderConfig` named `name`; raises
    `HFLlamaError` listing every key whose value xlaopt's decoder does not compute."""
    if not isinstance(config_json, dict):
        raise HFLlamaError(f"{ARCHITECTURE} config: a {type(config_json).__name__}, not a JSON object")
    cfg, problems = dict(config_json), []
    for key in [k for k in cfg if k in IGNORED or k.startswith("_")]:  # `_`: transformers' private keys
        cfg.pop(key)
    for key, (want, why) in FIXED.items():
        value = cfg.pop(key, None)
        if value is not None and value != want and value not in ALIASES.get(key, ()):
            problems.append(f"{key}={value!r} ({why})")
    ints = dict(d_model="hidden_size", mlp_dim="intermediate_size", num_layers="num_hidden_layers",
                num_heads="num_attention_heads", vocab_size="vocab_size")
    fields: dict[str, Any] = {ours: _number(cfg, theirs, int, problems) for ours, theirs in ints.items()}
    # transformers' defaults where a key may be absent: one kv head per head, head_dim D / H.
    for ours, theirs in (("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim")):
        fields[ours] = _number(cfg, theirs, int, problems) if cfg.get(theirs) is not None else cfg.pop(theirs, None)
    fields["num_kv_heads"] = fields["num_kv_heads"] or fields["num_heads"]
    fields["norm_eps"] = _number(cfg, "rms_norm_eps", float, problems, default=1e-6)
    tie = cfg.pop("tie_word_embeddings", False)
    if type(tie) is not bool:
        problems.append(f"tie_word_embeddings={tie!r} (expected true or false)")
    fields["tie_embeddings"] = tie is True
    fields.update(_rope(cfg, problems))
    # Only transformers' dynamic RoPE types read it; xlaopt's rotary tables have no length limit.
    _number(cfg, "max_position_embeddings", int, problems, default=1)
    if cfg:
        problems.insert(0, f"unknown keys {sorted(cfg)}")
    if problems:
        raise HFLlamaError(f"{ARCHITECTURE} config cannot be imported: " + "; ".join(problems))
    try:
        return DecoderConfig(name=name, **fields)
    except ConfigError as e:
        raise HFLlamaError(f"{ARCHITECTURE} config maps to an invalid xlaopt config: {e}") from None


def hf_config(config: DecoderConfig, dtype: str = "float32", max_position_embeddings: int | None = None) -> dict:
    """The config.json (as a dict) of `LlamaForCausalLM` with `config`'s shapes. Written in
    transformers 4.x's keys (rope_theta, rope_scaling), which 5.x reads too."""
    if not isinstance(config, DecoderConfig):
        raise HFLlamaError(f"{config.name} is a {config.family} model; only the decoder family maps to {ARCHITECTURE}")
    problems = [f"{k}={v!r} (transformers' Llama has {w!r})" for k, v, w in
                (("qk_norm", config.qk_norm, False),
                 ("mlp_activation", config.mlp_activation, "swiglu")) if v != w]
    if problems:
        raise HFLlamaError(f"{config.name} cannot be written as {ARCHITECTURE}: " + "; ".join(problems))
    scaled = config.rope_scaling_factor != 1
    rope_scaling = {"rope_type": "llama3", "factor": config.rope_scaling_factor,
                    "low_freq_factor": config.rope_low_freq_factor, "high_freq_factor": config.rope_high_freq_factor,
                    "original_max_position_embeddings": config.rope_original_max_positions} if scaled else None
    if max_position_embeddings is None:  # the source's value is not part of DecoderConfig
        max_position_embeddings = int(config.rope_original_max_positions * (config.rope_scaling_factor if scaled else 1))
    return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": config.d_model,
            "intermediate_size": config.mlp_dim, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim, "vocab_size": config.vocab_size, "rms_norm_eps": config.norm_eps,
            "rope_theta": config.rope_theta, "rope_scaling": rope_scaling,
            "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": config.tie_embeddings,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "torch_dtype": dtype}


def read_config(directory) -> dict:
    path = pathlib.Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFLlamaError(f"{directory}: no {CONFIG_FILE} (a transformers model directory holds {CONFIG_FILE} "
                           f"and model*.safetensors)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise HFLlamaError(f"{path}: unreadable: {e}") from None
    if not isinstance(raw, dict):
        raise HFLlamaError(f"{path}: a JSON {type(raw).__name__}, not an object")
    return raw


# ---------------------------------------------------------------------------------------
# The tensor mapping
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Entry:
    """xlaopt parameter `path` <- tensor `source` ([L, ...] from `{i}`-templated sources when
    `stacked`) of HF shape `shape`; `to_ours` / `from_ours` are numpy views, no copies."""
    path: tuple[str, ...]
    source: str
    shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    from_ours: Callable[[np.ndarray], np.ndarray]
    stacked: bool = True


def _same(path, source, shape, stacked=True) -> Entry:
    return Entry(path, source, shape, lambda a: a, lambda a: a, stacked)


def _linear(path, source, shape, stacked=True) -> Entry:
    """torch's Linear stores [out, in]; xlaopt contracts its first axis with the input."""
    return Entry(path, source, shape, lambda a: a.T, lambda a: a.T, stacked)


def mapping(config: DecoderConfig) -> list[Entry]:
    D, H, N, K, F, E = (config.d_model, config.num_heads, config.num_kv_heads, config.head_dim, config.mlp_dim,
                        config.vocab_size)
    at, block = "model.layers.{i}.", ("layers", "block")
    heads_out = lambda n: (lambda a: a.T.reshape(D, n, K), lambda a: a.reshape(D, n * K).T)  # noqa: E731
    out = [
        _same(("embed_ED",), "model.embed_tokens.weight", (E, D), stacked=False),
        _same(("final_norm", "scale"), "model.norm.weight", (D,), stacked=False),
        Entry(block + ("q_proj_DHK",), at + "self_attn.q_proj.weight", (H * K, D), *heads_out(H)),
        Entry(block + ("k_proj_DNK",), at + "self_attn.k_proj.weight", (N * K, D), *heads_out(N)),
        Entry(block + ("v_proj_DNK",), at + "self_attn.v_proj.weight", (N * K, D), *heads_out(N)),
        Entry(block + ("o_proj_HKD",), at + "self_attn.o_proj.weight", (D, H * K),
              lambda a: a.T.reshape(H, K, D), lambda a: a.reshape(H * K, D).T),
        _same(block + ("attn_norm", "scale"), at + "input_layernorm.weight", (D,)),
        _same(block + ("mlp_norm", "scale"), at + "post_attention_layernorm.weight", (D,)),
        _linear(block + ("mlp", "gate_DF"), at + "mlp.gate_proj.weight", (F, D)),
        _linear(block + ("mlp", "up_DF"), at + "mlp.up_proj.weight", (F, D)),
        _linear(block + ("mlp", "down_FD"), at + "mlp.down_proj.weight", (D, F)),
    ]
    if not config.tie_embeddings:
        out.append(_linear(("lm_head_DE",), "lm_head.weight", (E, D), stacked=False))
    return out


def _sources(e: Entry, config: DecoderConfig) -> list[str]:
    return [e.source.format(i=i) for i in range(config.num_layers)] if e.stacked else [e.source]


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


def _optional(name: str, config: DecoderConfig) -> bool:
    """Tensors transformers itself skips on load: old rotary buffers (derived from the config)
    and, under tied embeddings, an LM head saved beside the embedding it is tied to."""
    return name.endswith(".rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight")


def check_tensors(files: SafetensorsCheckpoint, config: DecoderConfig) -> None:
    """One `HFLlamaError` listing every missing, misshapen, non-float or unexpected tensor."""
    expected = {s: e.shape for e in mapping(config) for s in _sources(e, config)}
    have = files.tensors
    missing = sorted(set(expected) - set(have))
    unexpected = sorted(k for k in set(have) - set(expected) if not _optional(k, config))
    wrong = sorted(f"{k} {have[k].shape} (expected {expected[k]})" for k in set(expected) & set(have)
                   if have[k].shape != expected[k])
    dtypes = sorted(f"{k} {have[k].dtype}" for k in set(expected) & set(have) if have[k].dtype not in FLOAT_DTYPES)
    problems = [f"{label} ({len(items)}): {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}"
                for label, items in (("missing tensors", missing), ("wrong shapes", wrong),
                                     ("unexpected tensors", unexpected), ("not floating point", dtypes)) if items]
    if problems:
        raise HFLlamaError(f"{files.directory}: tensors do not match the config ({config.num_layers} layers, "
                           f"d_model {config.d_model}, tie_word_embeddings={config.tie_embeddings}): "
                           + "; ".join(problems))


# ---------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------

def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _reader(e: Entry, files: SafetensorsCheckpoint, config: DecoderConfig):
    """index (slices of our global shape) -> that block in fp32, read from the memory maps:
    only the pages the block covers are read, and `np.array` copies, so no jax array aliases
    a file mapping."""
    def block(source: str, index) -> np.ndarray:
        return np.array(e.to_ours(files.array(source))[index], np.float32)

    def read(index):
        if not e.stacked:
            return block(e.source, index)
        shape = np.broadcast_to(np.float32(0), _our_shape(e, config))[index].shape
        out = np.empty(shape, np.float32)
        for j, i in enumerate(range(config.num_layers)[index[0]]):
            out[j] = block(e.source.format(i=i), index[1:])
        return out
    return read


def _our_shape(e: Entry, config: DecoderConfig) -> tuple[int, ...]:
    shape = e.to_ours(np.broadcast_to(np.float32(0), e.shape)).shape
    return ((config.num_layers,) if e.stacked else ()) + shape


def _matching(given: DecoderConfig, own: DecoderConfig) -> None:
    a, b = dataclasses.asdict(given), dataclasses.asdict(own)
    diff = [f"{k}={a[k]!r} vs {b[k]!r}" for k in a if k != "name" and a[k] != b.get(k)]
    if diff or type(given) is not type(own):
        raise HFLlamaError(f"{given.name} does not match the checkpoint's config.json: {'; '.join(diff)}")


def load(directory, config: DecoderConfig | None = None, shardings=None, name: str = "hf-llama"):
    """(config, params) of a transformers Llama directory; params are the tree `Decoder.apply`
    takes, each leaf built on its sharding in `shardings` (a tree like the params; default: the
    first device) block by block from the memory-mapped files. With `config` (a registered
    model, say) the checkpoint's config.json, if there is one, must map to the same model.

    The parameters are float32 whatever the file holds: xlaopt keeps fp32 master weights
    (`models.layers.param`) and casts to the compute dtype where it multiplies; bf16 and fp16
    widen to fp32 exactly, so `save(..., dtype="bfloat16")` writes back the same bits."""
    directory = pathlib.Path(directory)
    if config is None or (directory / CONFIG_FILE).exists():
        own = config_from_hf(read_config(directory), name)
        if config is not None:
            _matching(config, own)
        config = config or own
    if not any((directory / n).is_file() for n in (WEIGHTS_NAME, INDEX_NAME)) and any(directory.glob("*.bin")):
        raise HFLlamaError(f"{directory}: only pickled *.bin weights, which xlaopt never unpickles; convert them to "
                           f"safetensors (transformers: save_pretrained(..., safe_serialization=True))")
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: dict = {}
    with SafetensorsCheckpoint(directory, WEIGHTS_NAME, INDEX_NAME) as files:
        check_tensors(files, config)
        # In file order, so consecutive reads stream through one shard after another.
        for e in sorted(mapping(config), key=lambda e: str(files.tensors[e.source.format(i=0)].file)):
            sharding = default if shardings is None else _get(shardings, e.path)
            _set(params, e.path, jax.make_array_from_callback(_our_shape(e, config), sharding,
                                                              _reader(e, files, config)))
    return config, params


# ---------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------

SAVE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
               "float16": np.dtype(np.float16)}


def _host(a) -> np.ndarray:
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils
        a = multihost_utils.process_allgather(a, tiled=True)
    return np.asarray(jax.device_get(a), np.float32)


def export_tensors(params, config: DecoderConfig, dtype=np.float32):
    """(transformers name, array) of every tensor, one xlaopt leaf brought to the host at a time."""
    params = nn.meta.unbox(params)
    for e in mapping(config):
        leaf = _host(_get(params, e.path))
        if leaf.shape != _our_shape(e, config):
            raise HFLlamaError(f"params/{'/'.join(e.path)} has shape {leaf.shape}; {config.name} needs "
                               f"{_our_shape(e, config)}")
        for i, source in enumerate(_sources(e, config)):
            yield source, np.ascontiguousarray(e.from_ours(leaf[i] if e.stacked else leaf)).astype(dtype)


def _write_shards(tmp: pathlib.Path, tensors, max_shard_bytes: int) -> list[str]:
    """Shards written as they fill (one shard in host memory at most), renamed to transformers'
    model-0000K-of-0000N.safetensors with an index when there are several."""
    shards: list[list[str]] = []
    pending: dict[str, np.ndarray] = {}
    size = 0

    def flush():
        write_safetensors(tmp / f"part-{len(shards)}", pending, {"format": "pt"})
        shards.append(list(pending))

    for name, a in tensors:
        if pending and size + a.nbytes > max_shard_bytes:
            flush()
            pending, size = {}, 0
        pending[name], size = a, size + a.nbytes
    flush()
    if len(shards) == 1:
        (tmp / "part-0").rename(tmp / WEIGHTS_NAME)
        return [WEIGHTS_NAME]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for k, final in enumerate(names):
        (tmp / f"part-{k}").rename(tmp / final)
    total = sum((tmp / f).stat().st_size for f in names)
    weight_map = {t: names[k] for k, shard in enumerate(shards) for t in shard}
    (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    return names + [INDEX_NAME]


def save(directory, config: DecoderConfig, params, dtype: str = "float32", max_position_embeddings: int | None = None,
         max_shard_bytes: int = 5 << 30) -> list[str]:
    """Write config.json and model.safetensors (shards and an index past `max_shard_bytes`) that
    `LlamaForCausalLM.from_pretrained` loads, into `directory`, which must not exist yet: built
    in a temporary sibling and renamed into place only when whole. Returns the files written.
    `max_position_embeddings`: the source checkpoint's, which `DecoderConfig` does not keep."""
    if dtype not in SAVE_DTYPES:
        raise HFLlamaError(f"dtype {dtype!r}; use one of {', '.join(SAVE_DTYPES)}")
    out = pathlib.Path(directory)
    if out.exists():
        raise HFLlamaError(f"{out}: already exists; save writes a new directory")
    config_json = hf_config(config, dtype, max_position_embeddings)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        written = _write_shards(tmp, export_tensors(params, config, SAVE_DTYPES[dtype]), max_shard_bytes)
        (tmp / CONFIG_FILE).write_text(json.dumps(config_json, indent=2, sort_keys=True))
        os.chmod(tmp, 0o755)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written + [CONFIG_FILE]
