"""`xlaopt generate --ckpt DIR`: sampling from a trained checkpoint's parameters, the model the
checkpoint was saved from. A llama-tiny trained a few steps decodes other tokens than its random
init does, the same tokens on every run, and the same on a mesh as on one device (parameters read
straight into the serving layout); a checkpoint of another model, or a step it lacks, is refused.
Cosmos 3 from `import-weights` output is tests/test_interop.py's."""
import json

import pytest

from xlaopt.cli import main

from conftest import needs_devices

TINY = ["--set", "num_layers=1", "--set", "d_model=64", "--set", "mlp_dim=128", "--set", "vocab_size=256"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("trained") / "ckpt"
    # A high learning rate, so that 12 steps move the parameters far from their init.
    assert main(["train", "--model", "llama-tiny", *TINY, "--dtype", "float32", "--batch-size", "4",
                 "--text-len", "32", "--steps", "12", "--learning-rate", "0.01", "--ckpt", str(ckpt),
                 "--no-progress"]) == 0
    return ckpt


def _tokens(tmp_path, *args) -> dict:
    out = tmp_path / "out.json"
    assert main(["generate", *args, "--new-tokens", "8", "--batch-size", "2", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_generate_samples_the_checkpoint_deterministically(trained, tmp_path):
    served = _tokens(tmp_path, "--ckpt", str(trained))
    assert served["params_from"] == {"ckpt": str(trained), "step": 12} and served["model"] == "llama-tiny"
    assert _tokens(tmp_path, "--ckpt", str(trained))["tokens"] == served["tokens"]
    # The same model and seed from its own init: the checkpoint is what changed the tokens.
    init = _tokens(tmp_path, "--model", "llama-tiny", *TINY)
    assert init["params_from"] == {"init_seed": 0} and init["tokens"] != served["tokens"]
    # --model with the checkpoint's own fields is accepted, and serves the same parameters.
    assert _tokens(tmp_path, "--ckpt", str(trained), "--model", "llama-tiny", *TINY)["tokens"] == served["tokens"]


@needs_devices(2)
def test_a_checkpoint_is_served_on_a_mesh_as_on_one_device(trained, tmp_path):
    one = _tokens(tmp_path, "--ckpt", str(trained))
    assert _tokens(tmp_path, "--ckpt", str(trained), "--mesh", "tensor=2")["tokens"] == one["tokens"]


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-tiny"], "differs from --model llama-tiny: d_model: saved 64, now 256"),
    (["--ckpt-step", "5"], "--ckpt-step 5: "),
])
def test_another_model_or_a_missing_step_is_refused(trained, capsys, args, message):
    assert main(["generate", "--ckpt", str(trained), *args]) == 2
    assert message in capsys.readouterr().err
