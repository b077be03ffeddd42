"""The ViT family: published sizes, patches, `verify` on two meshes, a falling loss, bad sizes."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt import api
from xlaopt.cli import main
from xlaopt.models.registry import ConfigError, get_config
from xlaopt.models.vit import ViT, forward_flops, patchify
from xlaopt.step import param_count

from conftest import needs_devices

VIT = ["--model", "vit-tiny", "--set", "num_layers=2"]


@pytest.mark.parametrize("name, published", [("vit-b16", 86.57e6), ("vit-l16", 304.33e6)])
def test_published_vit_sizes(name, published):
    """Table 1 of the ViT paper with the ImageNet-1k head (timm's vit_base_patch16_224: 86,567,656)."""
    assert abs(param_count(api.build_program(name)) - published) / published < 0.02


def test_patches_are_row_major_tiles():
    images = jnp.arange(2 * 4 * 6 * 3, dtype=jnp.float32).reshape(2, 4, 6, 3)
    patches = np.asarray(patchify(images, 2))
    assert patches.shape == (2, 6, 12)
    np.testing.assert_array_equal(patches[1, 4], np.asarray(images[1, 2:4, 2:4]).reshape(-1))  # 2nd row, 2nd tile


def test_every_token_sees_its_whole_image_and_nothing_else():
    """Bidirectional attention and mean pooling: changing the last patch changes the logits of
    its image and of no other."""
    config = get_config("vit-tiny", {"num_layers": 1})
    program = api.build_program(config, batch=(2, config.tokens, 0))
    from xlaopt.families import family_of

    batch = jax.tree.map(jnp.asarray, family_of(config).synthetic(config, program.settings.batch, 0).batch(0))
    model = ViT(config, jnp.float32)
    params = model.init(jax.random.key(0), batch)["params"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(0, 0.05, p.shape), p.dtype), params)  # the head is 0 at init
    logits = model.apply({"params": params}, batch)
    changed = dict(batch, images_BHWC=batch["images_BHWC"].at[0, -4:, -4:].add(1.0))
    logits2 = model.apply({"params": params}, changed)
    assert np.abs(logits2[0] - logits[0]).max() > 1e-4
    np.testing.assert_array_equal(logits2[1], logits[1])


def test_vit_flops_by_hand():
    c = get_config("vit-b16")
    T, D = 196, 768
    layer = 2 * T * (4 * D * D + 2 * D * 3072) + 4 * D * T * T
    assert forward_flops(c) == pytest.approx(2 * T * 768 * 768 + 12 * layer + 2 * D * 1000)


@needs_devices(8)
@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,tensor=2", "fsdp=4,context=2"])
def test_cli_verify_vit(mesh, tmp_path):
    out = tmp_path / "verify.json"
    rc = main(["verify", *VIT, "--mesh", mesh, "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["ok"], result


@needs_devices(4)
def test_vit_training_lowers_loss(tmp_path):
    out = tmp_path / "train.json"
    rc = main(["train", *VIT, "--mesh", "data=2,fsdp=2", "--steps", "30", "--json", str(out), "--no-progress"])
    result = json.loads(out.read_text())
    assert rc == 0 and result["param_count"] > 0 and result["model_flops_per_step"] > 0
    assert result["loss_last5_mean"] < (2 / 3) * result["loss_first5_mean"], result


def test_patch_size_must_divide_the_image():
    with pytest.raises(ConfigError, match="patch_size=5 does not divide image_size=32"):
        get_config("vit-tiny", {"patch_size": 5})


def test_a_row_length_other_than_the_images_is_refused(capsys):
    assert main(["verify", *VIT, "--text-len", "48"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "64 tokens (4 x 4 patches)" in err[0]
