"""The command line: the main training job, listings, and one-line errors for bad input."""
import json
import os
import subprocess
import sys

import pytest

from xlaopt.cli import main

QUICK_START = ["train", "--model", "cosmos3-tiny", "--mesh", "data=2,fsdp=2,tensor=2", "--steps", "40"]


def test_train_tiny_on_data2_fsdp2_tensor2_lowers_loss(tmp_path):
    """The README's quick-start run as a user runs it: a process of its own, compiled as a user's
    is (the suite's -O0 would run its 40 steps 2.5x slower)."""
    out = tmp_path / "train.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-m", "xlaopt.cli", *QUICK_START, "--json", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert {"model", "param_count", "mesh", "steps", "tokens_per_s", "data_wait_fraction",
            "model_flops_per_step", "mfu"} <= set(result)
    assert [s["step"] for s in result["steps"]] == list(range(40))
    assert all({"step", "loss", "step_time_s", "data_wait_s"} <= set(s) for s in result["steps"])
    assert result["mesh"] == {"stage": 1, "data": 2, "fsdp": 2, "tensor": 2, "context": 1}
    # The loss falls clearly: the last five steps average under two thirds of the first five.
    assert result["loss_last5_mean"] < (2 / 3) * result["loss_first5_mean"], result["loss_last5_mean"]
    assert 0 < result["mfu"] < 1 and result["model_flops_per_step"] > 0
    assert "MFU" in done.stdout


def test_models_lists_registered_sizes(tmp_path, capsys):
    out = tmp_path / "models.json"
    assert main(["models", "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["models"]}
    assert set(rows) >= {"cosmos3-tiny", "cosmos3-nano", "cosmos3-super"}
    assert "15.17B" in capsys.readouterr().out


def test_passes_lists_the_pipeline(capsys):
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    assert "mesh-layout" in out and "options (--pass-option mesh-layout.FIELD=VALUE): constrain_activations=True" in out


@pytest.mark.parametrize("args, message", [
    (["train", "--model", "cosmos3-tny"], "unknown model 'cosmos3-tny'; did you mean 'cosmos3-tiny'?"),
    (["train", "--model", "cosmos3-tiny", "--set", "d_modle=8"], "unknown config field 'd_modle'"),
    (["train", "--model", "cosmos3-tiny", "--mesh", "pipe=2"], "unknown axis 'pipe'"),
    (["train", "--model", "llama-tiny", "--exec", "remat=sometimes"],
     "execution setting remat='sometimes'; use one of none, full, dots, dots_no_batch"),
    (["train", "--model", "llama-tiny", "--exec", "layer_stak=scan"],
     "unknown execution setting 'layer_stak' (did you mean 'layer_stack'?); valid: compute_dtype"),
    (["train", "--model", "llama-tiny", "--exec", "attention=io_only"], "attention=io_only is a pricing stand-in"),
    (["verify", "--model", "llama-tiny", "--xla-option", "xla_gpu_enable_latency_hiding_scheduler=true"],
     "xla_gpu_enable_latency_hiding_scheduler is for XLA's GPU compiler; this program compiles for cpu"),
    (["verify", "--model", "llama-tiny", "--xla-option", "xla_backend_optimization_level=1",
      "--xla-option", "xla_backend_optimization_level=2"], "given twice, as 1 and 2; keep one"),
    (["verify", "--model", "llama-tiny", "--pass-option", "mesh-layout.rules=x"],
     "unknown mesh-layout option 'rules'; valid: constrain_activations"),
    (["verify", "--model", "llama-tiny", "--passes", "overlap"], "unknown pass 'overlap'; passes are: layout-plan, mesh-layout"),
    (["train", "--model", "cosmos3-tiny", "--mesh", "tensor=8"], "tensor=8 does not divide dimension 2 (kv_heads, size 4)"),
    (["train", "--model", "cosmos3-tiny", "--mesh", "data=3"], "data=3 does not divide dimension 0 (batch, size 8)"),
    (["train", "--model", "cosmos3-tiny", "--mesh", "data=16"], "needs 16 devices but cpu has 8"),
    (["train", "--model", "cosmos3-tiny", "--mesh", "data=1024"], "at most 512 simulated CPU devices"),
    (["verify", "--model", "cosmos3-tiny", "--disable", "nope"], "unknown pass 'nope'"),
    (["train", "--model", "cosmos3-tiny", "--coordinator", "127.0.0.1:1234"], "needs --coordinator HOST:PORT, "
     "--num-processes N and --process-id I together"),
    (["train", "--model", "cosmos3-tiny", "--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0"],
     "expected HOST:PORT"),
    (["train", "--model", "cosmos3-tiny", "--mesh", "data=3", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
      "--process-id", "0"], "a mesh of 3 devices does not split over 2 processes"),
])
def test_bad_input_is_one_clear_line(args, message, capsys):
    assert main(args + ["--steps", "1"] if args[0] == "train" else args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_console_script_runs_in_a_fresh_process():
    done = subprocess.run([sys.executable, "-m", "xlaopt.cli", "train", "--model", "nope"],
                          capture_output=True, text=True, timeout=120)
    # With the gpu-aot extra installed, jaxlib's C++ logging prints "cudart_stub ... Could not find
    # cuda drivers" lines while `import jax` runs (no setting of ours reaches them); all else is ours.
    ours = [line for line in done.stderr.splitlines()
            if not line.startswith(("WARNING: All log messages before absl::InitializeLog()", "I0000 "))]
    assert done.returncode == 2 and ours[0].startswith("xlaopt train: error: unknown model 'nope'"), done.stderr


def test_cpu_command_prints_no_cuda_plugin_traceback():
    """With the gpu-aot extra installed and no GPU, JAX's CUDA plugin must not report a failed
    initialisation: the CLI chooses the CPU platform before JAX starts its backends."""
    pytest.importorskip("jax_cuda12_plugin", reason="the CUDA plugin (xlaopt[gpu-aot]) is not installed")
    from xlaopt.cli import _NVIDIA_DEVICE_NODES

    if any(os.path.exists(node) for node in _NVIDIA_DEVICE_NODES):
        pytest.skip("an NVIDIA GPU is visible: the CLI leaves the platform to JAX")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # the CLI's own choice
    done = subprocess.run([sys.executable, "-m", "xlaopt.cli", "verify", "--model", "cosmos3-tiny", "--set",
                           "num_layers=1", "--mesh", "data=2"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "plugin configuration error" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-4000:]
