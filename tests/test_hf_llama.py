"""Hugging Face Llama checkpoints in and out (`xlaopt.interop.hf_llama`) against transformers
itself, and xlaopt's safetensors reader and writer (`xlaopt.interop.safetensors_io`) against
the `safetensors` library; bad configs, files and indexes refused in one line naming the culprit.

Tolerance (float32 on both sides): max |ours - transformers| <= 1e-5 x max |transformers'
logits|, the float32 rule of `xlaopt.interop.parity`. Both compute the same function in fp32 and
differ only in summation order (matmuls of 64-128 terms, softmax over <= 16 keys, 2 layers) and
in their exp / rsqrt / cos / pow: a few ulps (2^-23 = 1.2e-7) each, a few-fold amplified, so
~1e-6 relative is expected (measured: 3.8e-6 on logits of std 1.0, max 3.6, i.e. 1.0e-6
relative). A wiring mistake is orders above it: dropping the llama3 RoPE scaling alone moves
these logits by 3.4, a swapped norm or a mis-split head by O(1).
"""
import dataclasses
import json
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the parity extra")
transformers = pytest.importorskip("transformers", reason="the parity extra")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the parity extra")

from xlaopt.errors import UserError  # noqa: E402
from xlaopt.interop import hf_llama  # noqa: E402
from xlaopt.interop.safetensors_io import (  # noqa: E402
    SafetensorsCheckpoint,
    SafetensorsError,
    SafetensorsFile,
    write_safetensors,
)
from xlaopt.models.decoder import Decoder  # noqa: E402

RTOL_OF_MAX = 1e-5
# Llama 3.1 RoPE scaling with an original context of 16 tokens: at head_dim 16 and theta 1e4 one
# frequency is interpolated and six are divided by 8, so 16-token rows see the scaling. An init
# scale of 0.125 gives logits of std ~1 and attention that is far from uniform.
HF_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5,
                 rope_theta=10000.0, initializer_range=0.125,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16})
TOKENS_BT = np.random.default_rng(0).integers(0, HF_CONFIG["vocab_size"], (2, 16))


def reference(tie: bool = False, seed: int = 0):
    """A random float32 `LlamaForCausalLM`, its norm scales random too (ones would hide a
    swapped or missing norm)."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG, tie_word_embeddings=tie)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(TOKENS_BT)).logits.float().numpy()


_FORWARDS: dict = {}


def our_logits(config, params) -> np.ndarray:
    """xlaopt's decoder in float32 on the same rows: one document per row, positions 0..15."""
    if config not in _FORWARDS:
        model = Decoder(config, jnp.float32)
        _FORWARDS[config] = jax.jit(lambda p, b: model.apply({"params": p}, b))
    batch = {"tokens_BT": jnp.asarray(TOKENS_BT, jnp.int32), "segment_ids_BT": jnp.ones(TOKENS_BT.shape, jnp.int32),
             "positions_BT": jnp.broadcast_to(jnp.arange(TOKENS_BT.shape[1], dtype=jnp.int32), TOKENS_BT.shape)}
    return np.asarray(_FORWARDS[config](params, batch))


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert scale > 1, "logits this small would make the tolerance meaningless"
    assert err <= RTOL_OF_MAX * scale, f"max |diff| {err:.3g} over {RTOL_OF_MAX} x {scale:.3g}"


def assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = reference()
    directory = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(directory, safe_serialization=True)
    return model, directory


@pytest.fixture(scope="module")
def imported(checkpoint):
    return hf_llama.load(checkpoint[1])


def test_import_matches_transformers_logits(checkpoint, imported):
    model, _ = checkpoint
    config, params = imported
    assert (config.d_model, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim,
            config.mlp_dim, config.vocab_size, config.norm_eps, config.tie_embeddings) == (64, 2, 4, 2, 16, 128, 256,
                                                                                         1e-5, False)
    assert (config.rope_scaling_factor, config.rope_original_max_positions) == (8.0, 16)
    assert params["layers"]["block"]["q_proj_DHK"].shape == (2, 64, 4, 16)  # stacked for the layer scan
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    want = torch_logits(model)
    assert_close(our_logits(config, params), want)
    # The RoPE scaling is exercised: without it the same weights give other logits.
    unscaled = our_logits(dataclasses.replace(config, rope_scaling_factor=1.0), params)
    assert np.abs(unscaled - want).max() > 100 * RTOL_OF_MAX * np.abs(want).max()


def test_export_loads_in_transformers_with_the_same_weights(checkpoint, imported, tmp_path):
    model, _ = checkpoint
    config, params = imported
    written = hf_llama.save(tmp_path / "out", config, params, max_position_embeddings=256)
    assert sorted(written) == ["config.json", "model.safetensors"]
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    rope = getattr(back.config, "rope_parameters", None) or back.config.rope_scaling  # transformers 5.x or 4.x
    assert rope["rope_type"] == "llama3" and back.config.max_position_embeddings == 256
    assert_same_weights(back, model)  # every tensor bit for bit: the transposes and head splits invert
    assert_close(torch_logits(back), torch_logits(model))
    _, again = hf_llama.load(tmp_path / "out")
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_bfloat16_export_and_sharded_export(checkpoint, imported, tmp_path):
    """bf16 on the way out rounds as torch does, and widens back exactly; shards past the
    size limit get transformers' names and index, which from_pretrained follows."""
    model, _ = checkpoint
    config, params = imported
    hf_llama.save(tmp_path / "bf16", config, params, dtype="bfloat16")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16").float()
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(torch.bfloat16).float()), k
    _, widened = hf_llama.load(tmp_path / "bf16")
    rounded = jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32), params)
    jax.tree.map(np.testing.assert_array_equal, widened, rounded)

    written = hf_llama.save(tmp_path / "sharded", config, params, max_shard_bytes=40_000)
    assert "model.safetensors.index.json" in written and "model-00001-of-" in written[0]
    assert_same_weights(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "sharded"), model)


def test_tied_embeddings_round_trip(tmp_path):
    model = reference(tie=True, seed=1)
    model.save_pretrained(tmp_path / "tied", safe_serialization=True)
    config, params = hf_llama.load(tmp_path / "tied")
    assert config.tie_embeddings and "lm_head_DE" not in params
    assert_close(our_logits(config, params), torch_logits(model))
    hf_llama.save(tmp_path / "out", config, params)
    assert "lm_head.weight" not in SafetensorsFile(tmp_path / "out" / "model.safetensors").tensors
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert back.config.tie_word_embeddings
    assert_same_weights(back, model)


def test_sharded_checkpoint_reads_like_the_single_file(checkpoint, imported, tmp_path):
    model, single = checkpoint
    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    with SafetensorsCheckpoint(tmp_path / "sharded", "model.safetensors", "model.safetensors.index.json") as many, \
            SafetensorsCheckpoint(single, "model.safetensors", "model.safetensors.index.json") as one:
        assert many.tensors.keys() == one.tensors.keys() and len({i.file for i in many.tensors.values()}) == len(shards)
        for name in one.tensors:
            np.testing.assert_array_equal(many.array(name), one.array(name))
    _, params = hf_llama.load(tmp_path / "sharded")
    jax.tree.map(np.testing.assert_array_equal, params, imported[1])


def test_reader_and_writer_agree_with_the_safetensors_library(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=gen), "bf16": torch.randn(4, 7, generator=gen).bfloat16(),
               "i64": torch.arange(-6, 6, dtype=torch.int64).reshape(3, 4) * (1 << 40),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    bits = lambda t: (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()  # noqa: E731
    safetensors_torch.save_file(tensors, tmp_path / "lib.safetensors", metadata={"format": "pt", "note": "x"})
    ours = SafetensorsFile(tmp_path / "lib.safetensors")
    assert ours.metadata == {"format": "pt", "note": "x"} and ours.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        a = ours.array(name)
        assert a.shape == tuple(t.shape) and not a.flags.writeable
        got = a.view(np.int16) if a.dtype == ml_dtypes.bfloat16 else a
        np.testing.assert_array_equal(got, bits(t), strict=True)
    # ...and what we write, the library reads back bit for bit.
    write_safetensors(tmp_path / "ours.safetensors", {k: ours.array(k) for k in tensors}, {"format": "pt"})
    for name, t in safetensors_torch.load_file(tmp_path / "ours.safetensors").items():
        assert t.dtype == tensors[name].dtype
        np.testing.assert_array_equal(bits(t), bits(tensors[name]), strict=True)


# ---------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------

def _config_json(**changes) -> dict:
    return {**transformers.LlamaConfig(**HF_CONFIG).to_dict(), **changes}


@pytest.mark.parametrize("changes, named", [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "low_freq_factor=None"),
    ({"sliding_window": 4096}, "unknown keys ['sliding_window']"),
    ({"num_attention_heads": 3}, "num_heads=3"),
])
def test_unsupported_config_is_refused_naming_the_key(changes, named):
    assert hf_llama.config_from_hf(_config_json()).rope_scaling_factor == 8.0  # the base config maps
    with pytest.raises(UserError) as e:
        hf_llama.config_from_hf(_config_json(**changes))
    assert named in str(e.value) and "\n" not in str(e.value)


def test_legacy_rope_keys_map_like_rope_parameters():
    legacy = {k: v for k, v in _config_json().items() if k != "rope_parameters"}
    legacy.update(rope_theta=10000.0, rope_scaling={**HF_CONFIG["rope_scaling"], "type": "llama3"})
    assert hf_llama.config_from_hf(legacy) == hf_llama.config_from_hf(_config_json())


def test_truncated_file_is_refused_naming_it(checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint[1], broken)
    path = broken / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(UserError, match="truncated") as e:
        hf_llama.load(broken)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def _raw_file(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("header, data, problem", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "overlaps"),
    ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "unknown dtype 'Q4'"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "12 bytes"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(16), "8 bytes after the last tensor"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "unindexed bytes"),
])
def test_bad_header_is_refused_naming_the_file(tmp_path, header, data, problem):
    path = tmp_path / "bad.safetensors"
    _raw_file(path, header, data)
    with pytest.raises(SafetensorsError, match=problem) as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value) and isinstance(e.value, UserError)


@pytest.mark.parametrize("name", ["../x.safetensors", "/tmp/x.safetensors", "sub/../../x.safetensors"])
def test_index_may_not_name_files_outside_its_directory(checkpoint, tmp_path, name):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    shutil.copy(checkpoint[1] / "config.json", directory)
    shutil.copy(checkpoint[1] / "model.safetensors", tmp_path / "x.safetensors")  # a real file out there
    names = SafetensorsFile(tmp_path / "x.safetensors").tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, name)}))
    with pytest.raises(UserError, match="outside") as e:
        hf_llama.load(directory)
    assert "model.safetensors.index.json" in str(e.value) and "\n" not in str(e.value)


def test_import_weights_then_generate_picks_transformers_tokens_and_exports_back(checkpoint, tmp_path, capsys):
    """`xlaopt import-weights --from hf-llama` writes a checkpoint (placed on tensor=2) that
    `xlaopt generate --ckpt` serves: greedy decoding picks the tokens transformers' own greedy
    `generate` picks after the same prompt; `xlaopt export-weights` writes it back."""
    from xlaopt.cli import main

    model, directory = checkpoint
    ckpt, out = tmp_path / "ckpt", tmp_path / "gen.json"
    assert main(["import-weights", "--from", "hf-llama", str(directory), "--out", str(ckpt), "--mesh", "tensor=2"]) == 0
    prompt = TOKENS_BT[0].tolist()
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", ",".join(map(str, prompt)), "--new-tokens", "6",
                 "--json", str(out)]) == 0
    served = json.loads(out.read_text())
    assert served["model"] == "hf-llama" and served["params_from"]["step"] == 0
    with torch.no_grad():
        want = model.generate(torch.as_tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert served["tokens"][0] == want[0, len(prompt):].tolist()
    # And back out: `export-weights` writes what transformers loads as the original, bit for bit,
    # the source's context length kept.
    assert main(["export-weights", "--ckpt", str(ckpt), "--to", "hf-llama", str(tmp_path / "back")]) == 0
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert_same_weights(back, model)
    assert back.config.max_position_embeddings == model.config.max_position_embeddings
    assert main(["export-weights", "--ckpt", str(ckpt), "--to", "onnx", str(tmp_path / "x")]) == 2
    assert "the formats are hf-llama, diffusers" in capsys.readouterr().err
