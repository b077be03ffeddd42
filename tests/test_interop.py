"""Reference (diffusers) weights in and out of xlaopt: config mapping, import onto a sharded
mesh as a checkpoint, one train step, export, reload in diffusers; bad imports list every
problem and leave nothing behind."""
import json

import jax
import numpy as np
import pytest

from xlaopt.errors import UserError
from xlaopt.interop.diffusers_config import DiffusersConfigError, cosmos3_from_diffusers, diffusers_from_cosmos3
from xlaopt.interop.diffusers_weights import (
    SafetensorsDir,
    WeightsError,
    export_diffusers,
    import_params,
    write_safetensors,
)

from conftest import needs_devices

torch = pytest.importorskip("torch", reason="reference models need torch (pip install -e '.[parity]')")
pytest.importorskip("diffusers.models.transformers.transformer_cosmos3",
                    reason="needs diffusers with Cosmos3OmniTransformer (pip install -e '.[parity]')")
pytest.importorskip("accelerate", reason="diffusers' from_pretrained of Cosmos3OmniTransformer needs accelerate")

from xlaopt.interop.checkpoint import export_checkpoint, import_to_checkpoint  # noqa: E402
from xlaopt.interop.parity import random_reference  # noqa: E402

CFG = dict(vocab_size=96, latent_channel=4, patch_latent_dim=16, hidden_size=64, intermediate_size=128, head_dim=16,
           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, rope_axes_dim=[4, 2, 2],
           action_gen=True, action_dim=6, num_embodiment_domains=4, sound_gen=True, sound_dim=5)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("reference") / "model"
    random_reference(CFG, 7, d)
    return d


def _tensors(d):
    files = SafetensorsDir(d)
    try:
        return {k: np.array(files.array(k), np.float32) for k in files.tensors}
    finally:
        files.close()


def _load_reference(d):
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer

    return Cosmos3OmniTransformer.from_pretrained(str(d), torch_dtype=torch.float32, output_loading_info=True)


def test_config_maps_both_ways(reference_dir):
    raw = json.loads((reference_dir / "config.json").read_text())
    config, settings = cosmos3_from_diffusers(raw)
    assert (config.d_model, config.num_heads, config.num_kv_heads, config.head_dim, config.mlp_dim) == (64, 4, 2, 16, 128)
    assert config.mrope_sections == (4, 2, 2) and config.latent_patch_dim == 16 and config.timestep_freq_dim == 256
    assert settings.action_gen and settings.sound_gen and config.num_action_domains == 4
    back = diffusers_from_cosmos3(config, settings)
    assert {k: v for k, v in raw.items() if not k.startswith("_diffusers")} == back


def test_unknown_and_unsupported_config_fields_are_listed():
    raw = dict(CFG, frobnicate=1, another_new_field=True, attention_bias=True, hidden_act="gelu",
               unified_3d_mrope_reset_spatial_ids=False)
    with pytest.raises(DiffusersConfigError) as e:
        cosmos3_from_diffusers(raw)
    msg = str(e.value)
    for word in ("another_new_field", "frobnicate", "attention_bias", "hidden_act='gelu'",
                 "unified_3d_mrope_reset_spatial_ids"):
        assert word in msg, (word, msg)
    assert isinstance(e.value, UserError)


def test_round_trip_without_training_is_bit_exact(reference_dir, tmp_path):
    config, settings, params = import_params(reference_dir)
    export_diffusers(params, config, settings, tmp_path / "out", max_shard_bytes=64 << 10)  # several shards
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    a, b = _tensors(reference_dir), _tensors(tmp_path / "out")
    assert set(a) == set(b)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_edge_variant_round_trip_keeps_its_norms(tmp_path):
    """Edge: no reasoner QK norm, a separate norm on reasoner keys for generator queries."""
    edge = dict(CFG, hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True)
    random_reference(edge, 3, tmp_path / "ref")
    config, settings, params = import_params(tmp_path / "ref")
    assert not config.reasoner_qk_norm and config.reasoner_key_norm_for_generator
    reasoner = params["layers"]["reasoner"]
    assert "q_norm" not in reasoner and "k_norm" not in reasoner and reasoner["side_k_norm"]["scale"].shape == (2, 16)
    export_diffusers(params, config, settings, tmp_path / "out")
    a, b = _tensors(tmp_path / "ref"), _tensors(tmp_path / "out")
    assert "layers.1.self_attn.k_norm_und_for_gen.weight" in a and "layers.0.self_attn.norm_q.weight" not in a
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_und_k_norm_for_gen"] is True


@needs_devices(8)
def test_import_train_export_reload(reference_dir, tmp_path):
    """Import onto data=2,fsdp=2,tensor=2 as a checkpoint, restore it, train one step, save,
    export, reload in diffusers: no missing or unexpected keys, and the trained weights."""
    from xlaopt.checkpoint import CheckpointManager
    from xlaopt.compile import CompiledProgram
    from xlaopt.data.batch import BatchShape
    from xlaopt.data.synthetic_cosmos import SyntheticCosmos
    from xlaopt.mesh import MeshSpec
    from xlaopt.program import TrainSettings

    mesh = MeshSpec.parse("data=2,fsdp=2,tensor=2")
    settings = TrainSettings(batch=BatchShape(8, 16, 32), warmup_steps=1)
    info = import_to_checkpoint(reference_dir, tmp_path / "ckpt", mesh, settings=settings)
    config, program = info["config"], info["program"]
    compiled = CompiledProgram(program)
    manager = CheckpointManager(tmp_path / "ckpt")
    state, meta, _ = manager.restore(compiled.abstract_state)
    q = state.params["layers"]["generator"]["q_proj_DHK"]
    assert len(q.sharding.device_set) == 8 and not q.sharding.is_fully_replicated
    ref = _tensors(reference_dir)
    # Placed straight from the file, shard by shard: equal to the reference tensor.
    np.testing.assert_array_equal(np.asarray(q)[1], ref["layers.1.self_attn.add_q_proj.weight"].T.reshape(64, 4, 16))

    batch = SyntheticCosmos(config, program.settings.batch, seed=0).batch(0)
    for _ in range(2):  # the learning rate warms up from 0 at step 0
        state, metrics = compiled.train_step(state, compiled.put_batch(batch), jax.random.key(0))
        assert np.isfinite(float(metrics["loss"]))
    manager.save(2, state, meta)
    manager.close()

    written = export_checkpoint(tmp_path / "ckpt", tmp_path / "exported")
    assert "config.json" in written
    model, loading = _load_reference(tmp_path / "exported")
    assert loading["missing_keys"] == [] and loading["unexpected_keys"] == []
    assert loading["mismatched_keys"] == [] and loading["error_msgs"] == []
    trained = np.asarray(state.params["layers"]["generator"]["q_proj_DHK"])[1]
    got = model.layers[1].self_attn.add_q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(got, trained.reshape(64, 64).T)
    assert not np.array_equal(got, ref["layers.1.self_attn.add_q_proj.weight"])  # the step changed it

    # `generate --ckpt` serves either step, as the model the import named (no --model): the
    # trained step samples other latents than the imported one, and the same ones again.
    from xlaopt.runtime.generate import GenerateRequest, generate

    sample = lambda step: generate(GenerateRequest(model=None, ckpt=str(tmp_path / "ckpt"), ckpt_step=step,
                                                   steps=2, gen_len=16))
    imported, stepped = sample(0), sample(2)
    assert imported["model"] == stepped["model"] == config.name and stepped["params_from"]["step"] == 2
    assert imported["latents_mean"] != stepped["latents_mean"]
    assert sample(2)["latents_mean"] == stepped["latents_mean"]


def _broken_copy(src, dst, drop=(), reshape=None, extra=None):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = _tensors(src)
    for k in drop:
        del tensors[k]
    for k, shape in (reshape or {}).items():
        tensors[k] = np.zeros(shape, np.float32)
    tensors.update(extra or {})
    write_safetensors(dst / "diffusion_pytorch_model.safetensors", tensors)
    return dst


def test_bad_weights_list_every_problem_and_write_nothing(reference_dir, tmp_path):
    bad = _broken_copy(reference_dir, tmp_path / "bad",
                       drop=["layers.0.mlp.up_proj.weight", "norm_moe_gen.weight"],
                       reshape={"proj_in.weight": (64, 15)},
                       extra={"layers.0.self_attn.to_q.bias": np.zeros(64, np.float32)})
    out = tmp_path / "ckpt"
    with pytest.raises(WeightsError) as e:
        import_to_checkpoint(bad, out)
    msg = str(e.value)
    for word in ("missing tensors (2)", "layers.0.mlp.up_proj.weight", "norm_moe_gen.weight",
                 "wrong shapes (1)", "proj_in.weight: (64, 15) (expected (64, 16))",
                 "unexpected tensors (1)", "layers.0.self_attn.to_q.bias"):
        assert word in msg, (word, msg)
    assert not out.exists()


def test_unknown_config_field_in_directory_writes_nothing(reference_dir, tmp_path):
    bad = _broken_copy(reference_dir, tmp_path / "bad")
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(raw, use_magic=True)))
    with pytest.raises(DiffusersConfigError, match="unknown fields \\['use_magic'\\]"):
        import_to_checkpoint(bad, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_failure_while_writing_leaves_nothing(reference_dir, tmp_path, monkeypatch):
    from xlaopt.checkpoint import manager as manager_mod

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(manager_mod, "write_leaves", boom)
    with pytest.raises(Exception, match="disk full"):
        import_to_checkpoint(reference_dir, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    # An export into an existing directory is refused; a failed export leaves no temporary.
    (tmp_path / "exists").mkdir()
    config, settings, params = import_params(reference_dir)
    with pytest.raises(WeightsError, match="already exists"):
        export_diffusers(params, config, settings, tmp_path / "exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


@needs_devices(2)
def test_parity_and_import_weights_on_the_command_line(reference_dir, tmp_path, capsys):
    from xlaopt.cli import main

    out = tmp_path / "parity.json"
    dump = tmp_path / "pred.npz"
    assert main(["parity", "--diffusers", str(reference_dir), "--seed", "3", "--json", str(out),
                 "--dump", str(dump)]) == 0
    result = json.loads(out.read_text())
    assert result["ok"] and {"vision", "sound", "action"} <= set(result["modalities"])
    with np.load(dump) as predictions:
        assert any(name.startswith("vision_") for name in predictions.files)
    assert main(["import-weights", "--from", "diffusers", str(reference_dir), "--out", str(tmp_path / "ckpt"),
                 "--mesh", "fsdp=2"]) == 0
    assert main(["ckpt", "verify", str(tmp_path / "ckpt")]) == 0
    assert main(["import-weights", "--from", "hf", str(reference_dir), "--out", str(tmp_path / "x")]) == 2
    assert "the formats are diffusers, hf-llama" in capsys.readouterr().err


def test_an_index_naming_a_file_outside_the_directory_is_refused(reference_dir, tmp_path):
    """The weight map's file names come from disk: one that leaves the directory is refused (it
    once was read, as `SafetensorsDir` joined the name to the directory unchecked)."""
    import json

    outside = tmp_path / "x.safetensors"
    write_safetensors(outside, {"w": np.zeros(2, np.float32)})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((reference_dir / "config.json").read_text())
    (bad / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "../x.safetensors"}}))
    with pytest.raises(WeightsError, match=r"\.\./x\.safetensors"):
        SafetensorsDir(bad)
