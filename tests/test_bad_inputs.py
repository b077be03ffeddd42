"""Bad inputs, one table: each is refused with exit 2 and one line naming the problem, no
traceback, and nothing is lost (BAD_INPUTS.md is this table, for people).

Every row runs the command line in-process on a scratch directory and then checks:
  - exit code 2;
  - stderr is one line `xlaopt CMD: error: ...` holding the row's phrase. argparse's own errors
    (unknown command, a value of the wrong type or not among the choices) print argparse's usage
    lines first and the one error line last: counted as one-line errors, since the usage is
    argparse's fixed preamble, the error is still a single line and the exit code is 2;
  - no "Traceback" on stdout or stderr;
  - nothing lost: every file of the scratch directory (and of the module's pristine checkpoint
    and store) byte-identical afterwards and none added, so no damaged input was "repaired" by
    deleting it and no partial output was left; for a damaged checkpoint, its intact step still
    reads back bit-identical to the original (`ckpt diff --step 1` exits 0); for a refusal
    before work (a count out of range, an output that cannot be written), the command itself
    never started.

Fast by construction: no row compiles or trains; the two stores and checkpoints are made once.
Regenerate BAD_INPUTS.md's table after changing a row: `.venv/bin/python tests/test_bad_inputs.py`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import pathlib
import re
import shutil
import socket
import tempfile
import time
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from xlaopt import cli
from xlaopt.models.registry import get_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "BAD_INPUTS.md"
# In a run of the whole suite the process has 8 simulated devices already (conftest.py).
LLAMA = ["--model", "llama-tiny"]
# A transformers LlamaConfig's config.json, small (for `import-weights --from hf-llama` rows).
HF_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64, "hidden_act": "silu",
            "tie_word_embeddings": False}


def plan(topology: str = "h100:1x8", model: str = "llama-tiny") -> list[str]:
    return ["plan", "--model", model, "--top", "0", "--rows", "0", "--topology", topology]  # analytic only


PLAN = plan()
VIDEO = ["plan", "--model", "cosmos3-tiny", "--topology", "h100:1x8", "--serve", "video"]
GOODPUT = ["goodput", "plan", "--gpus", "1024", "--step-s", "1", "--save-s", "30", "--restore-s", "60", "--startup-s", "90",
           "--gap-s", "30", "--seeds", "2"]
ANALYZE = ["analyze", *LLAMA, "--topology", "h100:1x8"]


def run(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `xlaopt ARGV`, argparse's exits included."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse
            code = e.code
    return code, out.getvalue(), err.getvalue()


_ERROR_LINE = re.compile(r"^xlaopt( [\w-]+)*: error: \S")


def error_line(code: int, out: str, err: str) -> str:
    """The one error line of a refusal, after checking its shape; argparse's usage lines may
    come before it, nothing else."""
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in out + err, err[-4000:]
    lines = err.strip().splitlines()
    assert lines and _ERROR_LINE.match(lines[-1]), err
    preamble = lines[:-1]
    assert not preamble or (preamble[0].startswith("usage: xlaopt")
                            and all(line.startswith(" ") for line in preamble[1:])), err
    return lines[-1]


# --- the scratch world: a checkpoint and a sample store, made once, copied per row ----------

def _snapshot(*roots: pathlib.Path) -> dict[str, str]:
    files = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            files[str(p)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return files


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    from xlaopt.checkpoint import CheckpointManager

    base = tmp_path_factory.mktemp("pristine")
    manager = CheckpointManager(base / "ckpt")
    for step in (1, 2):  # step 2 is the one the rows damage; step 1 must survive it
        manager.save(step, {"w": np.arange(64, dtype=np.float32).reshape(8, 8) * step,
                            "b": np.full(3, step, np.float32)},
                     {"model": "llama-tiny", "config": dataclasses.asdict(get_config("llama-tiny")),
                      "data": {"cursor": step}})
        manager.wait()
    code, _, err = run(["data", "make", str(base / "store"), "--samples", "24", "--shard-mb", "0.01"])
    assert code == 0, err
    assert len(json.loads((base / "store" / "manifest.json").read_text())["shards"]) >= 2
    return base


_HELD: list = []  # sockets held by World.held_port, closed after each row


@pytest.fixture(autouse=True)
def _release_held_ports():
    yield
    while _HELD:
        _HELD.pop().close()


@dataclasses.dataclass
class World:
    tmp: pathlib.Path
    pristine: pathlib.Path

    def held_port(self) -> int:
        """A loopback port another socket listens on for the rest of the test."""
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        _HELD.append(held)
        return held.getsockname()[1]

    def ckpt(self, damage: Callable[[pathlib.Path], None] | None = None) -> str:
        root = self.tmp / "ckpt"
        shutil.copytree(self.pristine / "ckpt", root)
        if damage:
            damage(root)
        return str(root)

    def store(self, damage: Callable[[pathlib.Path], None] | None = None) -> str:
        root = self.tmp / "store"
        shutil.copytree(self.pristine / "store", root)
        if damage:
            damage(root)
        return str(root)

    def file(self, name: str, content: str | bytes = "keep me\n") -> str:
        path = self.tmp / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return str(path)

    def topology(self, **change) -> str:
        """A valid two-node topology file with `change` applied (dotted keys reach one level in)."""
        data = {"name": "lab", "nodes": 2, "devices_per_node": 4,
                "device": {"name": "X", "peak_flops": {"bfloat16": 1e15}, "hbm_bytes": 96e9, "hbm_bytes_per_s": 4e12},
                "levels": [{"name": "nvl", "bytes_per_s": 4e11, "latency_s": 2e-6},
                           {"name": "ib", "bytes_per_s": 5e10, "latency_s": 1e-5}]}
        for key, value in change.items():
            outer, _, inner = key.partition("__")
            if inner:
                data[outer][inner] = value
            else:
                data[outer] = value
        return self.file("topology.json", json.dumps(data))


def _edit(path: pathlib.Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _manifest(root: pathlib.Path) -> pathlib.Path:
    return root / "step_00000002" / "manifest.json"


def _chunk(root: pathlib.Path) -> pathlib.Path:
    return next(p for p in sorted((root / "step_00000002" / "arrays" / "w").rglob("*")) if p.is_file()
                and p.name != "zarr.json")


def _flip(path: pathlib.Path, at: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _index(root: pathlib.Path, shard: int = 0) -> pathlib.Path:
    return next(p for p in (root / f"shard-{shard:05d}" / "index" / "c").rglob("*") if p.is_file())


def _set_leaf(key: str, value):
    return lambda root: _edit(_manifest(root), lambda m: m["leaves"][0].__setitem__(key, value))


def _set_shard(key: str, value):
    return lambda root: _edit(root / "manifest.json", lambda m: m["shards"][0].__setitem__(key, value))


# --- the table -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    category: str
    what: str  # the input, for BAD_INPUTS.md
    argv: Callable[[World], list[str]]
    message: str  # a phrase of the error line
    lost: str  # what "nothing lost" means here, for BAD_INPUTS.md
    before_work: bool = False  # refused in `xlaopt.cli.main`, before the command starts
    intact_step: bool = False  # a checkpoint whose step 1 must still read back bit-identical


ARGS, RANGE, TOPO, LAYOUT = "malformed argument", "size or count out of range", "topology", "layout file"
CKPT, PATHS, STORE, OUT = "checkpoint", "manifest path", "data store / shard", "output path"
PROC = "process count / coordinator"
UNCHANGED = "no file changed or added"
CKPT_KEPT = "step 1 still reads back bit-identical; no file changed or removed"
STORE_KEPT = "the store's files unchanged; nothing removed"
REFUSED = "refused before the command starts; nothing written"

ROWS = [
    # Malformed arguments: argparse's (usage + one error line) and the values the commands parse.
    Row("steps-not-a-number", ARGS, "`train --steps ten`", lambda w: ["train", *LLAMA, "--steps", "ten"],
        "argument --steps: invalid int value: 'ten'", UNCHANGED),
    Row("unknown-command", ARGS, "`xlaopt frobnicate`", lambda w: ["frobnicate"],
        "argument command: invalid choice: 'frobnicate'", UNCHANGED),
    Row("target-not-a-choice", ARGS, "`plan --target tpu`", lambda w: [*PLAN, "--target", "tpu"],
        "argument --target: invalid choice: 'tpu'", UNCHANGED),
    Row("mesh-size-not-a-number", ARGS, "`train --mesh data=two`", lambda w: ["train", *LLAMA, "--mesh", "data=two"],
        "size of 'data' must be a positive integer, got 'two'", UNCHANGED),
    Row("sequence-parallel-without-tensor", ARGS, "`verify --mesh data=2 --sequence-parallel`",
        lambda w: ["verify", *LLAMA, "--mesh", "data=2", "--sequence-parallel"],
        "mesh data=2 has none; add tensor=N (N > 1) or drop --sequence-parallel", UNCHANGED),
    Row("calibrate-target-without-compiled", ARGS, "`calibrate --target gpu` (analytic method)",
        lambda w: ["calibrate", "--target", "gpu"],
        "--target gpu is what --method compiled compiles for; add --method compiled", UNCHANGED),
    Row("plan-unknown-remat-policy", ARGS, "`plan --remat fullest`", lambda w: [*PLAN, "--remat", "fullest"],
        "--remat 'fullest': fullest is not a recomputation policy; policies: none, full, dots", UNCHANGED),
    Row("fp8-on-cpu-train", ARGS, "`train --exec matmuls=fp8`",
        lambda w: ["train", *LLAMA, "--exec", "matmuls=fp8", "--steps", "1"],
        "matmuls=fp8: fp8 matmuls run on Hopper GPUs", UNCHANGED),
    Row("fp8-on-a100", ARGS, "`analyze --exec matmuls=fp8 --topology a100:1x8`",
        lambda w: ["analyze", *LLAMA, "--exec", "matmuls=fp8", "--topology", "a100:1x8"],
        "has no fp8 matmuls; they run on Hopper GPUs (h100, h200 topologies)", UNCHANGED),
    Row("trainable-set-the-family-lacks", ARGS, "`train --model llama-tiny --trainable generator`",
        lambda w: ["train", *LLAMA, "--trainable", "generator", "--steps", "1"],
        "trainable='generator': the decoder family's parameter sets are all", UNCHANGED),
    Row("plan-trainable-set-unknown", ARGS, "`plan --model cosmos3-tiny --trainable reasoner`",
        lambda w: ["plan", "--model", "cosmos3-tiny", "--topology", "cpu:1x8", "--trainable", "reasoner"],
        "trainable='reasoner': the cosmos3 family's parameter sets are all, generator", UNCHANGED),
    Row("serve-with-training-flags", ARGS, "`analyze --serve decode --xla-option K=V`",
        lambda w: ["analyze", *LLAMA, "--serve", "decode", "--topology", "h100:1x8", "--xla-option",
                   "xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"],
        "--xla-option with --serve: a serving step compiles as it is served", UNCHANGED),
    Row("set-value-of-wrong-type", ARGS, "`plan --set num_layers=abc`",
        lambda w: [*PLAN, "--set", "num_layers=abc"], "--set num_layers='abc': not a valid int", UNCHANGED),
    Row("exec-without-value", ARGS, "`inspect --exec remat`", lambda w: ["inspect", *LLAMA, "--exec", "remat"],
        "--exec 'remat': expected key=value", UNCHANGED),
    # Sizes and counts out of range.
    Row("steps-zero", RANGE, "`train --steps 0`", lambda w: ["train", *LLAMA, "--steps", "0"],
        "--steps 0: need at least 1 step", UNCHANGED),
    Row("keep-zero", RANGE, "`train --ckpt DIR --keep 0` (was refused only once training started, as keep_last=0)",
        lambda w: ["train", *LLAMA, "--ckpt", str(w.tmp / "new"), "--keep", "0"], "--keep 0: must be at least 1",
        REFUSED + "; DIR not created", before_work=True),
    Row("seed-negative", RANGE, "`train --seed -1` (was a numpy traceback after the compile)",
        lambda w: ["train", *LLAMA, "--seed", "-1"], "--seed -1: must be in [0, 4294967295]", REFUSED,
        before_work=True),
    Row("top-negative", RANGE, "`plan --top -1` (was taken as 0)", lambda w: [*PLAN, "--top", "-1"],
        "--top -1: must be at least 0", REFUSED, before_work=True),
    Row("serve-rows-zero", RANGE, "`plan --serve decode --global-batch 0` (was the default 8 rows)",
        lambda w: ["plan", *LLAMA, "--topology", "h100:1x8", "--serve", "decode", "--global-batch", "0"],
        "--global-batch 0: must be at least 1", REFUSED, before_work=True),
    Row("serve-context-zero", RANGE, "`analyze --serve decode --context 0` (was a JAX traceback)",
        lambda w: [*ANALYZE, "--serve", "decode", "--context", "0"], "--context 0: must be at least 1", REFUSED,
        before_work=True),
    Row("video-resolution-unknown", RANGE, "`plan --serve video --resolution 1080p` (a tier Cosmos 3 does not have)",
        lambda w: [*VIDEO, "--resolution", "1080p"], "--resolution '1080p': Cosmos 3 generates at 256p, 480p, 720p",
        UNCHANGED),
    Row("video-frames-not-4k-plus-1", RANGE, "`plan --serve video --frames 190` (the VAE's temporal factor is 4)",
        lambda w: [*VIDEO, "--frames", "190"], "needs 4k+1 frames (the first frame stands alone); e.g. 189 or 193",
        UNCHANGED),
    Row("video-frames-over-tier", RANGE, "`plan --serve video --resolution 720p --frames 401`",
        lambda w: [*VIDEO, "--frames", "401"], "--frames 401: the 720p tier takes at most 200 frames", UNCHANGED),
    Row("video-without-generator", ARGS, "`plan --serve video --model llama-tiny`",
        lambda w: ["plan", *LLAMA, "--topology", "h100:1x8", "--serve", "video"],
        "llama-tiny has no generator (serve it with --serve decode)", UNCHANGED),
    Row("video-global-batch", ARGS, "`plan --serve video --global-batch 4` (a request is one clip)",
        lambda w: [*VIDEO, "--global-batch", "4"], "--global-batch with --serve video: a request is one clip",
        UNCHANGED),
    Row("video-mesh-fsdp", LAYOUT, "`plan --serve video --mesh fsdp=8` (a training layout)",
        lambda w: [*VIDEO, "--mesh", "fsdp=8"], "fsdp and stage are training layouts", UNCHANGED),
    Row("bench-size-negative", RANGE, "`bench checkpoint --size-gb -1` (ran, and reported)",
        lambda w: ["bench", "checkpoint", "--size-gb", "-1", "--dir", str(w.tmp)],
        "--size-gb -1: must be a finite number > 0", REFUSED, before_work=True),
    Row("shard-size-zero", RANGE, "`data make DIR --shard-mb 0` (wrote one shard per sample, minutes)",
        lambda w: ["data", "make", str(w.tmp / "new"), "--shard-mb", "0"], "--shard-mb 0: must be a finite number > 0",
        REFUSED + "; DIR not created", before_work=True),
    Row("new-tokens-zero", RANGE, "`generate --new-tokens 0` (refused after the model was built)",
        lambda w: ["generate", *LLAMA, "--new-tokens", "0"], "--new-tokens 0: must be at least 1", REFUSED,
        before_work=True),
    Row("batch-size-zero", RANGE, "`train --batch-size 0`", lambda w: ["train", *LLAMA, "--batch-size", "0"],
        "batch_size and text_len must be positive", UNCHANGED),
    Row("samples-zero", RANGE, "`data make DIR --samples 0`",
        lambda w: ["data", "make", str(w.tmp / "new"), "--samples", "0"], "--samples 0: need at least one sample",
        UNCHANGED + "; DIR not created"),
    Row("goodput-mtbf-zero", RANGE, "`goodput plan --mtbf 0`", lambda w: [*GOODPUT, "--mtbf", "0"],
        "--mtbf 0: an MTBF per GPU must be between 10 and 1e+08 hours", UNCHANGED),
    Row("goodput-mtbf-negative", RANGE, "`goodput plan --mtbf -5`", lambda w: [*GOODPUT, "--mtbf=-5"],
        "--mtbf -5: an MTBF per GPU must be between 10 and 1e+08 hours", UNCHANGED),
    Row("goodput-mtbf-absurd", RANGE, "`goodput plan --mtbf 1e12` (hours per GPU)", lambda w: [*GOODPUT, "--mtbf", "1e12"],
        "give hours per GPU, not per job", UNCHANGED),
    Row("train-mtbf-zero", RANGE, "`train --ckpt DIR --ckpt-every auto --mtbf 0`",
        lambda w: ["train", *LLAMA, "--ckpt", str(w.tmp / "ckpt"), "--ckpt-every", "auto", "--mtbf", "0"],
        "--mtbf 0: an MTBF per GPU must be between 10 and 1e+08 hours", UNCHANGED),
    Row("train-ckpt-every-not-a-count", ARGS, "`train --ckpt DIR --ckpt-every soon`",
        lambda w: ["train", *LLAMA, "--ckpt", str(w.tmp / "ckpt"), "--ckpt-every", "soon"],
        "--ckpt-every 'soon': give a number of steps or `auto`", UNCHANGED),
    Row("goodput-interval-shorter-than-save", RANGE, "`goodput plan --step-s 1 --save-s 30 --every 20`",
        lambda w: [*GOODPUT, "--every", "20"],
        "--every 20: 20 steps take 20 s, not more than one save (30 s, with its write); give at least 31 steps", UNCHANGED),
    Row("plan-stages-not-dividing-devices", RANGE, "`plan --stages 3 --topology h100:1x8`",
        lambda w: [*PLAN, "--stages", "3"],
        "pipeline stages 3: a stage count must divide the 8 devices of h100:1x8 (1, 2, 4, 8 do)", UNCHANGED),
    Row("plan-stages-not-a-number", RANGE, "`plan --stages two`", lambda w: [*PLAN, "--stages", "two"],
        "--stages 'two': give positive stage counts separated by commas, e.g. --stages 1,2,4", UNCHANGED),
    Row("pipeline-schedule-not-built", RANGE, "`verify --mesh stage=2 --exec pipeline_schedule=zero-bubble`",
        lambda w: ["verify", *LLAMA, "--mesh", "stage=2", "--exec", "layer_stack=pipeline",
                   "--exec", "pipeline_schedule=zero-bubble"],
        "pipeline schedule 'zero-bubble' (split backward passes) is not built yet; xlaopt's pipeline runs gpipe, "
        "1f1b", UNCHANGED),
    Row("pipeline-schedule-unknown", RANGE, "`verify --exec pipeline_schedule=circular`",
        lambda w: ["verify", *LLAMA, "--exec", "pipeline_schedule=circular"],
        "pipeline schedule 'circular'; use one of gpipe, 1f1b (not built yet: zero-bubble)", UNCHANGED),
    Row("pipeline-schedule-interleaved", RANGE, "`verify --mesh stage=2 --exec pipeline_schedule=interleaved`",
        lambda w: ["verify", *LLAMA, "--mesh", "stage=2", "--exec", "layer_stack=pipeline",
                   "--exec", "pipeline_schedule=interleaved"],
        "pipeline schedule 'interleaved': set pipeline_schedule=1f1b with pipeline_virtual_stages=2 or more "
        "(interleaved 1F1B)", UNCHANGED),
    Row("pipeline-1f1b-loss-outside-the-stack", RANGE, "`verify --model vit-tiny --exec pipeline_schedule=1f1b`",
        lambda w: ["verify", "--model", "vit-tiny", "--mesh", "stage=2", "--exec", "layer_stack=pipeline",
                   "--exec", "pipeline_schedule=1f1b"],
        "pipeline_schedule=1f1b runs the loss inside the layer stack, which the vit family does not do yet (the "
        "cosmos3 and decoder families do); use pipeline_schedule=gpipe", UNCHANGED),
    Row("grad-accumulate-dtype-without-micro-batches", RANGE, "`verify --exec grad_accumulate_dtype=bfloat16`",
        lambda w: ["verify", *LLAMA, "--mesh", "data=2", "--exec", "grad_accumulate_dtype=bfloat16"],
        "grad_accumulate_dtype=bfloat16: one micro-batch a step sums no gradients; leave it at float32", UNCHANGED),
    Row("stages-without-pipeline", RANGE, "`verify --mesh stage=2` (the layers scanned, not pipelined)",
        lambda w: ["verify", *LLAMA, "--mesh", "stage=2"],
        "cuts the layers into 2 pipeline stages, which only a pipeline runs; add --exec layer_stack=pipeline",
        UNCHANGED),
    Row("stages-do-not-divide-layers", RANGE, "`verify --mesh stage=3 --exec layer_stack=pipeline` (4 layers)",
        lambda w: ["verify", *LLAMA, "--mesh", "stage=3", "--exec", "layer_stack=pipeline"],
        "3 pipeline stages do not divide the model's 4 layers", UNCHANGED),
    Row("pipeline-virtual-stages-do-not-divide", RANGE,
        "`verify --mesh stage=2 --exec pipeline_virtual_stages=3` (4 layers)",
        lambda w: ["verify", *LLAMA, "--mesh", "stage=2", "--exec", "layer_stack=pipeline",
                   "--exec", "pipeline_virtual_stages=3"],
        "pipeline_virtual_stages=3: 3 virtual stages do not divide each of the 2 stages' 2 layers into equal chunks; "
        "use 1, 2", UNCHANGED),
    Row("pipeline-microbatches-not-a-multiple", RANGE, "`verify --mesh stage=2 --exec pipeline_microbatches=3`",
        lambda w: ["verify", *LLAMA, "--mesh", "stage=2", "--exec", "layer_stack=pipeline",
                   "--exec", "pipeline_microbatches=3"],
        "pipeline_microbatches=3 is not a multiple of the 2 pipeline stages", UNCHANGED),
    Row("pipeline-bfloat16-on-cpu", RANGE, "`train --mesh stage=2 --exec layer_stack=pipeline` (bfloat16 on the CPU)",
        lambda w: ["train", *LLAMA, "--mesh", "stage=2", "--exec", "layer_stack=pipeline"],
        "on the cpu target use --dtype float32 or float16", UNCHANGED),
    # Topologies.
    Row("topology-zero-nodes", TOPO, "`--topology h100:0x8` (was h100:1x8)", lambda w: plan("h100:0x8"),
        "topology h100:0x8: nodes and devices per node must be at least 1", UNCHANGED),
    Row("topology-cpu-zero-devices", TOPO, "`--topology cpu:1x0` (was cpu:1x8)", lambda w: plan("cpu:1x0"),
        "topology cpu:1x0: nodes and devices per node must be at least 1", UNCHANGED),
    Row("topology-too-many-devices", TOPO, "`--topology h100:99999999x8` (was a MemoryError traceback)",
        lambda w: plan("h100:99999999x8"), "799999992 devices; at most 131072", UNCHANGED),
    Row("topology-file-zero-bandwidth", TOPO, "topology file, a link of 0 bytes/s (was a ZeroDivisionError)",
        lambda w: plan(w.topology(levels=[{"name": "nvl", "bytes_per_s": 0, "latency_s": 1e-6}])),
        "levels[0].bytes_per_s = 0 must be a finite number > 0", UNCHANGED),
    Row("topology-file-no-bf16-peak", TOPO, "topology file, peak_flops without bfloat16 (was a KeyError)",
        lambda w: plan(w.topology(device__peak_flops={"float32": 1e14})),
        "device.peak_flops must be a table of dtype = FLOP/s with a bfloat16 entry", UNCHANGED),
    Row("topology-file-fractional-nodes", TOPO, "topology file, `nodes = 1.5` (was truncated to 1)",
        lambda w: plan(w.topology(nodes=1.5)), "nodes = 1.5 must be a whole number >= 1", UNCHANGED),
    Row("topology-file-not-utf8", TOPO, "topology file of binary bytes (was a UnicodeDecodeError)",
        lambda w: plan(w.file("t.toml", b"\xff\xfe\x00nodes")), "cannot parse", UNCHANGED),
    # Layout files.
    Row("layout-is-a-directory", LAYOUT, "`--layout DIR` (was \"does not exist\")",
        lambda w: [*ANALYZE, "--layout", str(w.tmp)], "is a directory; give the file", UNCHANGED),
    Row("layout-truncated", LAYOUT, "layout JSON cut short", lambda w: [*ANALYZE, "--layout", w.file("l.json", '{"mesh"')],
        "not JSON", UNCHANGED),
    Row("layout-not-utf8", LAYOUT, "layout TOML of binary bytes",
        lambda w: [*ANALYZE, "--layout", w.file("l.toml", b"\xff\xfe")], "not TOML", UNCHANGED),
    Row("layout-mesh-size-zero", LAYOUT, "layout `mesh = { data = 0 }`",
        lambda w: [*ANALYZE, "--layout", w.file("l.json", '{"mesh": {"data": 0}}')],
        "size of 'data' must be a positive integer", UNCHANGED),
    Row("layout-micro-batches-zero", LAYOUT, "layout `execution = { micro_batches = 0 }`",
        lambda w: [*ANALYZE, "--layout", w.file("l.json", '{"mesh": {"data": 2}, "execution": {"micro_batches": 0}}')],
        "micro_batches=0 must be at least 1", UNCHANGED),
    # Corrupted and truncated checkpoints (step 2 of two damaged, read by `xlaopt ckpt`).
    Row("import-hf-llama-unsupported-feature", PATHS, "`import-weights --from hf-llama DIR` whose config.json has "
        "`attention_bias: true`",
        lambda w: ["import-weights", "--from", "hf-llama", str(pathlib.Path(w.file("config.json", json.dumps(
            {**HF_LLAMA, "attention_bias": True}))).parent), "--out", str(w.tmp / "out")],
        "attention_bias", UNCHANGED),
    Row("generate-ckpt-of-another-model", CKPT, "`generate --ckpt DIR --model M` where DIR holds another config",
        lambda w: ["generate", "--ckpt", w.ckpt(), "--model", "llama-tiny", "--set", "num_layers=1"],
        "differs from --model llama-tiny: num_layers: saved 4, now 1", CKPT_KEPT, intact_step=True),
    Row("generate-ckpt-not-the-models-arrays", CKPT, "`generate --ckpt DIR` whose arrays are not its model's",
        lambda w: ["generate", "--ckpt", w.ckpt()], "llama-tiny parameters (params/embed_ED", CKPT_KEPT,
        intact_step=True),
    Row("generate-ckpt-damaged", CKPT, "`generate --ckpt DIR` with the newest step's manifest cut short",
        lambda w: ["generate", "--ckpt", w.ckpt(lambda r: _truncate(_manifest(r), 50))], "unreadable manifest",
        CKPT_KEPT, intact_step=True),
    Row("ckpt-manifest-truncated", CKPT, "step manifest cut short",
        lambda w: ["ckpt", "inspect", w.ckpt(lambda r: _truncate(_manifest(r), 50))], "unreadable manifest", CKPT_KEPT,
        intact_step=True),
    Row("ckpt-manifest-not-an-object", CKPT, "step manifest `[]` (was an AttributeError)",
        lambda w: ["ckpt", "ls", w.ckpt(lambda r: _manifest(r).write_text("[]"))],
        "not a manifest (a JSON object)", CKPT_KEPT, intact_step=True),
    Row("ckpt-leaf-fields-missing", CKPT, "a manifest leaf `{}` (was a KeyError)",
        lambda w: ["ckpt", "diff", str(w.pristine / "ckpt"),
                   w.ckpt(lambda r: _edit(_manifest(r), lambda m: m["leaves"].__setitem__(0, {})))],
        "leaves[0] lacks name, shape, dtype, chunk, sharding", CKPT_KEPT, intact_step=True),
    Row("ckpt-leaf-shape-not-a-list", CKPT, "a leaf's `shape = \"big\"` (was listed as sound)",
        lambda w: ["ckpt", "inspect", w.ckpt(_set_leaf("shape", "big"))], "shape 'big' and chunk", CKPT_KEPT,
        intact_step=True),
    Row("ckpt-leaf-dtype-unknown", CKPT, "a leaf's `dtype = \"banana\"` (was a TypeError in a restore)",
        lambda w: ["ckpt", "ls", w.ckpt(_set_leaf("dtype", "banana"))], "dtype 'banana' is not an array dtype",
        CKPT_KEPT, intact_step=True),
    Row("ckpt-files-not-a-table", CKPT, "manifest `files = [...]` (was an AttributeError)",
        lambda w: ["ckpt", "inspect", w.ckpt(lambda r: _edit(_manifest(r), lambda m: m.__setitem__("files", ["x"])))],
        "files is not a table of file sizes", CKPT_KEPT, intact_step=True),
    Row("ckpt-root-marker-damaged", CKPT, "root marker `[1]` (was an AttributeError)",
        lambda w: ["ckpt", "ls", w.ckpt(lambda r: (r / "xlaopt-checkpoints.json").write_text("[1]"))],
        "not a checkpoint root marker", UNCHANGED + "; no step removed"),
    Row("ckpt-chunk-byte-flipped", CKPT, "a flipped byte in a chunk file",
        lambda w: ["ckpt", "diff", str(w.pristine / "ckpt"), w.ckpt(lambda r: _flip(_chunk(r)))],
        "Digest mismatch", CKPT_KEPT, intact_step=True),
    Row("ckpt-chunk-truncated", CKPT, "a chunk file cut to 20 bytes",
        lambda w: ["ckpt", "diff", str(w.pristine / "ckpt"), w.ckpt(lambda r: _truncate(_chunk(r), 20))],
        "Not enough data", CKPT_KEPT, intact_step=True),
    Row("ckpt-array-metadata-damaged", CKPT, "an array's zarr.json cut short",
        lambda w: ["ckpt", "diff", str(w.pristine / "ckpt"),
                   w.ckpt(lambda r: _truncate(r / "step_00000002" / "arrays" / "w" / "zarr.json", 5))],
        "Invalid JSON", CKPT_KEPT, intact_step=True),
    Row("ckpt-step-dir-as-root", CKPT, "`ckpt ls ROOT/step_00000001` (a step, not a root)",
        lambda w: ["ckpt", "ls", str(pathlib.Path(w.ckpt()) / "step_00000001")],
        "is not an xlaopt checkpoint directory (it holds arrays, manifest.json)", CKPT_KEPT, intact_step=True),
    Row("ckpt-step-not-saved", CKPT, "`ckpt inspect --step 7`", lambda w: ["ckpt", "inspect", w.ckpt(), "--step", "7"],
        "no committed step 7; have [1, 2]", CKPT_KEPT, intact_step=True),
    # Manifests naming paths outside their directory.
    Row("ckpt-leaf-name-dotdot", PATHS, "a checkpoint leaf named `../../../etc` (was listed and inspected)",
        lambda w: ["ckpt", "inspect", w.ckpt(_set_leaf("name", "../../../etc"))],
        "'arrays/../../../etc' in the manifest is not a plain relative path", CKPT_KEPT, intact_step=True),
    Row("ckpt-file-path-absolute", PATHS, "a checkpoint file entry `/etc/passwd` (was listed and diffed)",
        lambda w: ["ckpt", "ls", w.ckpt(lambda r: _edit(_manifest(r), lambda m: m.__setitem__("files",
                                                                                               {"/etc/passwd": 10})))],
        "'/etc/passwd' in the manifest is not a plain relative path", CKPT_KEPT, intact_step=True),
    Row("store-shard-name-dotdot", PATHS, "a store shard named `shard-../../etc`",
        lambda w: ["data", "stats", w.store(_set_shard("name", "shard-../../etc"))],
        "shard name 'shard-../../etc' is not a shard of this directory", STORE_KEPT),
    Row("store-shard-name-absolute", PATHS, "a store shard named `/etc`",
        lambda w: ["data", "stats", w.store(_set_shard("name", "/etc"))],
        "shard name '/etc' is not a shard of this directory", STORE_KEPT),
    # Corrupted stores and shards (`data stats` reads the manifest; `plan --data` every shard's index).
    Row("store-manifest-not-an-object", STORE, "store manifest `[]` (was an AttributeError)",
        lambda w: ["data", "stats", w.store(lambda r: (r / "manifest.json").write_text("[]"))],
        "not a manifest (a JSON object)", STORE_KEPT),
    Row("store-count-not-a-number", STORE, "a shard's `num_samples = \"x\"` (was a ValueError)",
        lambda w: ["data", "stats", w.store(_set_shard("num_samples", "x"))], "num_samples = 'x' is not a count",
        STORE_KEPT),
    Row("store-unknown-modality", STORE, "store widths `{smell: 3}` (was a KeyError)",
        lambda w: ["data", "stats", w.store(lambda r: _edit(r / "manifest.json",
                                                            lambda m: m.__setitem__("widths", {"smell": 3})))],
        "widths = {'smell': 3} must map modalities", STORE_KEPT),
    Row("store-no-manifest", STORE, "a store directory without its manifest (an interrupted write)",
        lambda w: ["data", "stats", w.store(lambda r: (r / "manifest.json").unlink())],
        "no manifest.json: not a sample store, or an interrupted write", STORE_KEPT),
    Row("store-index-truncated", STORE, "a shard's index file cut to 30 bytes",
        lambda w: [*plan(model="cosmos3-tiny"), "--data", w.store(lambda r: _truncate(_index(r), 30))],
        "cannot read shard-00000/index", STORE_KEPT),
    Row("store-index-byte-flipped", STORE, "a flipped byte in a shard's index file",
        lambda w: [*plan(model="cosmos3-tiny"), "--data", w.store(lambda r: _flip(_index(r), 5))],
        "Digest mismatch", STORE_KEPT),
    Row("store-shard-missing", STORE, "a shard's index array deleted",
        lambda w: ["plan", "--model", "cosmos3-tiny", *PLAN[3:], "--data",
                   w.store(lambda r: shutil.rmtree(r / "shard-00001" / "index"))],
        "array shard-00001/index is missing", STORE_KEPT),
    # Outputs that cannot be written: refused before any work, so no finished run loses its results.
    Row("json-in-missing-directory", OUT, "`train --json DIR/none/out.json`",
        lambda w: ["train", *LLAMA, "--json", str(w.tmp / "none" / "out.json")], "does not exist; create it",
        REFUSED + "; no directory made", before_work=True),
    Row("json-is-a-directory", OUT, "`models --json DIR`", lambda w: ["models", "--json", str(w.tmp)],
        "is a directory; give a file name", REFUSED, before_work=True),
    Row("trace-under-a-file", OUT, "`analyze --trace FILE/trace.json`",
        lambda w: [*ANALYZE, "--trace", str(pathlib.Path(w.file("f")) / "trace.json")], "is not a directory",
        REFUSED + "; FILE unchanged", before_work=True),
    Row("out-on-read-only-fs", OUT, "`plan --out /proc/layout.toml`", lambda w: [*PLAN, "--out", "/proc/layout.toml"],
        "cannot write in /proc", REFUSED, before_work=True),
    Row("ckpt-dir-is-a-file", OUT, "`train --ckpt FILE`", lambda w: ["train", *LLAMA, "--ckpt", w.file("f")],
        "is a file, not a directory", REFUSED + "; FILE unchanged", before_work=True),
    Row("store-dir-is-a-file", OUT, "`data make FILE` (was a FileExistsError)",
        lambda w: ["data", "make", w.file("f"), "--samples", "5"], "is a file, not a directory",
        REFUSED + "; FILE unchanged", before_work=True),
    Row("compile-cache-under-a-file", OUT, "`train --compile-cache FILE/jax`",
        lambda w: ["train", *LLAMA, "--compile-cache", str(pathlib.Path(w.file("f")) / "jax")],
        "cannot write there", REFUSED + "; FILE unchanged", before_work=True),
    Row("local-tier-under-a-file", OUT, "`train --ckpt DIR --local-ckpt FILE/local`",
        lambda w: ["train", *LLAMA, "--ckpt", str(w.tmp / "ckpt"), "--local-ckpt",
                   str(pathlib.Path(w.file("f")) / "local")],
        "cannot write there", UNCHANGED + "; FILE unchanged"),
    Row("local-tier-inside-persistent", OUT, "`train --ckpt DIR --local-ckpt DIR/local` (not node-local)",
        lambda w: ["train", *LLAMA, "--ckpt", str(w.tmp / "ckpt"), "--local-ckpt", str(w.tmp / "ckpt" / "local")],
        "it is, or overlaps, the persistent --ckpt", UNCHANGED),
    Row("local-tier-without-persistent", OUT, "`train --local-ckpt DIR` without `--ckpt`",
        lambda w: ["train", *LLAMA, "--local-ckpt", str(w.tmp / "local")],
        "--local-ckpt needs --ckpt DIR", UNCHANGED),
    Row("local-peers-alone", PROC, "`train --local-peers 1` in a job of one process",
        lambda w: ["train", *LLAMA, "--ckpt", str(w.tmp / "ckpt"), "--local-ckpt", str(w.tmp / "local"),
                   "--local-peers", "1"],
        "--local-peers 1: a job of one process has no peer", UNCHANGED),
    Row("local-peers-too-many", PROC, "`train --processes 2 --local-peers 2`",
        lambda w: ["train", *LLAMA, "--mesh", "data=2", "--processes", "2", "--ckpt", str(w.tmp / "ckpt"),
                   "--local-ckpt", str(w.tmp / "local"), "--local-peers", "2"],
        "--local-peers 2: the job has 2 processes, so at most 1 other(s) can hold a copy", UNCHANGED),
    Row("dump-hlo-under-a-file", OUT, "`verify --dump-hlo FILE/hlo`",
        lambda w: ["verify", *LLAMA, "--dump-hlo", str(pathlib.Path(w.file("f")) / "hlo")],
        "is a file, so the directory cannot be made", REFUSED + "; FILE unchanged", before_work=True),
    # Process counts and the coordinator's port.
    Row("processes-zero", PROC, "`train --processes 0`", lambda w: ["train", *LLAMA, "--processes", "0"],
        "--processes 0: need at least 1 process", UNCHANGED),
    Row("restarts-negative", PROC, "`train --processes 2 --restarts -1`",
        lambda w: ["train", *LLAMA, "--mesh", "data=2", "--processes", "2", "--ckpt", str(w.tmp / "ckpt"),
                   "--restarts", "-1"],
        "--restarts -1: give how many times a failed job may start again", UNCHANGED),
    Row("restarts-without-a-launcher", PROC, "`train --restarts 3` without `--processes`",
        lambda w: ["train", *LLAMA, "--ckpt", str(w.tmp / "ckpt"), "--restarts", "3"],
        "--restarts needs --processes N", UNCHANGED),
    Row("restarts-without-a-checkpoint", PROC, "`train --processes 2 --restarts 3` without `--ckpt`",
        lambda w: ["train", *LLAMA, "--mesh", "data=2", "--processes", "2", "--restarts", "3"],
        "--restarts needs --ckpt DIR", UNCHANGED),
    Row("processes-do-not-divide-the-mesh", PROC, "`train --mesh data=2 --processes 3`",
        lambda w: ["train", *LLAMA, "--mesh", "data=2", "--processes", "3"],
        "the mesh's 2 devices do not split over 3 processes", UNCHANGED),
    Row("processes-and-coordinator", PROC, "`train --processes 2 --coordinator HOST:PORT ...`",
        lambda w: ["train", *LLAMA, "--mesh", "data=2", "--processes", "2", "--coordinator", "127.0.0.1:1234",
                   "--num-processes", "2", "--process-id", "0"],
        "--processes starts a local job and picks its own coordinator", UNCHANGED),
    Row("process-id-out-of-range", PROC, "`train --num-processes 2 --process-id 5`",
        lambda w: ["train", *LLAMA, "--mesh", "data=2", "--coordinator", "127.0.0.1:1234", "--num-processes", "2",
                   "--process-id", "5"], "need 0 <= id < N", UNCHANGED),
    Row("coordinator-port-in-use", PROC, "`train --coordinator 127.0.0.1:PORT` with PORT held by another program",
        lambda w: ["train", *LLAMA, "--mesh", "data=2", "--coordinator", f"127.0.0.1:{w.held_port()}",
                   "--num-processes", "2", "--process-id", "0"],
        "process 0 cannot listen there (Address already in use)", UNCHANGED),
    Row("peer-timeout-zero", PROC, "`train --peer-timeout 0`", lambda w: ["train", *LLAMA, "--peer-timeout", "0"],
        "--peer-timeout 0: need seconds in (0, 86400]", UNCHANGED),
]


def test_the_table_covers_every_kind_of_bad_input():
    assert len(ROWS) >= 30 and len({r.id for r in ROWS}) == len(ROWS)
    assert {r.category for r in ROWS} == {ARGS, RANGE, TOPO, LAYOUT, CKPT, PATHS, STORE, OUT, PROC}


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_one_line_and_nothing_is_lost(row, pristine, tmp_path, monkeypatch):
    world = World(tmp_path, pristine)
    argv = row.argv(world)
    if row.before_work:
        def started(args):
            raise AssertionError(f"xlaopt {args.command} started; its input should have been refused first")
        monkeypatch.setitem(cli._COMMANDS, argv[0], started)
    before = _snapshot(tmp_path, pristine)
    line = error_line(*run(argv))
    assert row.message in line, line
    assert _snapshot(tmp_path, pristine) == before
    if row.intact_step:
        code, out, err = run(["ckpt", "diff", str(pristine / "ckpt"), str(tmp_path / "ckpt"), "--step", "1"])
        assert code == 0 and "identical" in out, err


def test_an_unwritable_output_is_refused_in_far_less_than_a_compile(tmp_path):
    """The real command, not stubbed: a compile of the smallest model takes seconds here."""
    start = time.perf_counter()
    line = error_line(*run(["train", *LLAMA, "--steps", "1", "--json", str(tmp_path / "none" / "out.json")]))
    assert "--json" in line and time.perf_counter() - start < 1.0
    assert list(tmp_path.iterdir()) == []


def doc_table() -> str:
    lines = ["| id | input | error (excerpt) | nothing lost |", "|---|---|---|---|"]
    for r in ROWS:
        lines.append(f"| `{r.id}` | {r.what} | `{r.message}` | {r.lost} |")
    return "\n".join(lines)


def test_bad_inputs_md_is_this_table():
    assert doc_table() in DOC.read_text(), "regenerate: .venv/bin/python tests/test_bad_inputs.py"


# --- fuzzing: malformed values of the flags of commands that cannot start a long job ----------

_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
_INT = st.one_of(st.integers(-(10**20), 10**20), st.sampled_from([0, -1, 1, 2**31, 2**63]))
_NUMBER = st.one_of(_INT.map(str), st.sampled_from(["nan", "inf", "-inf", "1e400", "0x10", "1_0", " 3", "", "٣"]))
_VALUE = st.one_of(_TEXT, _NUMBER)


def _pairs(keys):
    key = st.one_of(st.sampled_from(keys), _TEXT)
    return st.lists(st.tuples(key, st.sampled_from(["=", "", "=="]), _VALUE), max_size=3).map(
        lambda items: ",".join(f"{k}{sep}{v}" for k, sep, v in items))


_MESH = _pairs(["data", "fsdp", "tensor", "context", "pipe"])
_SET = st.tuples(st.sampled_from(["num_layers", "d_model", "num_heads", "vocab_size", "qk_norm", "nope"]),
                 _VALUE).map(lambda kv: f"{kv[0]}={kv[1]}")
_EXEC = st.tuples(st.sampled_from(["remat", "attention", "attention_block", "micro_batches", "layer_stack",
                                   "compute_dtype", "loss_scale_init", "nope"]), _VALUE).map(lambda kv: f"{kv[0]}={kv[1]}")
_TOPOLOGY = st.one_of(_TEXT, st.tuples(st.sampled_from(["h100", "a100", "gb200", "cpu", "tpu"]), _NUMBER, _NUMBER).map(
    lambda t: f"{t[0]}:{t[1]}x{t[2]}"))
# An unknown pass is refused after every other argument is parsed and checked, before any
# compile: so a fuzzed value that happens to be valid still ends fast, with exit 2.
_VALIDATE_ONLY = ["--passes", "no-such-pass"]
_FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


def _never_a_traceback(argv: list[str], codes=(0, 2)) -> None:
    code, out, err = run(argv)
    assert code in codes, (argv, code, err[-2000:])
    if code == 2:
        error_line(code, out, err)
    assert "Traceback" not in out + err


@_FUZZ
@given(flags=st.lists(st.one_of(st.tuples(st.just("--mesh"), _MESH), st.tuples(st.just("--set"), _SET),
                                st.tuples(st.just("--exec"), _EXEC), st.tuples(st.just("--topology"), _TOPOLOGY),
                                st.tuples(st.sampled_from(["--batch-size", "--text-len", "--seed"]), _NUMBER)),
                      min_size=1, max_size=3))
def test_fuzzed_program_flags_are_refused_in_one_line(flags):
    _never_a_traceback(["inspect", *LLAMA, *_VALIDATE_ONLY, *(f"{k}={v}" for k, v in flags)], codes=(2,))


@_FUZZ
@given(flags=st.lists(st.tuples(st.sampled_from(["--steps", "--keep", "--keep-every", "--ckpt-every", "--seed"]),
                                _NUMBER), min_size=1, max_size=3))
def test_fuzzed_train_counts_are_refused_in_one_line(flags):
    _never_a_traceback(["train", *LLAMA, *_VALIDATE_ONLY, *(f"{k}={v}" for k, v in flags)], codes=(2,))


@_FUZZ
@given(flags=st.lists(st.one_of(st.tuples(st.sampled_from(["--global-batch", "--context"]),
                                          st.one_of(st.integers(-(10**20), 4096).map(str), _TEXT)),
                                st.tuples(st.just("--set"), _SET), st.tuples(st.just("--topology"), _TOPOLOGY)),
                      min_size=1, max_size=3))
def test_fuzzed_serving_plan_flags_exit_0_or_one_line(flags):
    """`plan --serve` is analytic: a valid draw prices in milliseconds (exit 0), any other is refused."""
    argv = ["plan", *LLAMA, "--serve", "decode", "--topology", "h100:1x8", *(f"{k}={v}" for k, v in flags)]
    _never_a_traceback(argv)


_JSON = st.recursive(st.one_of(st.none(), st.booleans(), _INT, st.floats(allow_nan=True), _TEXT),
                     lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_TEXT, inner, max_size=3)),
                     max_leaves=8)


def _near(valid):
    """Documents shaped like `valid`: each value kept (two times in three) or fuzzed, all the way down."""
    if isinstance(valid, dict):
        shaped = st.fixed_dictionaries({k: _near(v) for k, v in valid.items()})
    elif isinstance(valid, list):
        shaped = st.lists(_near(valid[0]), min_size=1, max_size=2) if valid else st.just(valid)
    else:
        shaped = st.just(valid)
    return st.one_of(shaped, shaped, _JSON)


_LAYOUT_DOC = _near({"mesh": {"data": 2}, "order": ["data", "fsdp", "tensor", "context"],
                     "rules": [["batch", ["data"]]], "batch": {"batch_size": 8, "text_len": 16, "gen_len": 0},
                     "execution": {"remat": "full", "micro_batches": 1}, "model": "llama-tiny"})
_TOPOLOGY_DOC = _near({"name": "lab", "nodes": 1, "devices_per_node": 8,
                       "device": {"name": "X", "peak_flops": {"bfloat16": 1e15}, "hbm_bytes": 8e10,
                                  "hbm_bytes_per_s": 3e12},
                       "levels": [{"name": "nvl", "bytes_per_s": 4e11, "latency_s": 2e-6}]})


@_FUZZ
@given(layout=_LAYOUT_DOC, topology=_TOPOLOGY_DOC)
def test_fuzzed_layout_and_topology_files_are_refused_in_one_line(layout, topology):
    """The files `analyze` reads, fuzzed near valid ones; every check runs (`--passes` is refused
    last, before the compile)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: pathlib.Path(tmp) / f"{name}.json" for name in ("layout", "topology")}
        paths["layout"].write_text(json.dumps(layout))
        paths["topology"].write_text(json.dumps(topology))
        _never_a_traceback([*ANALYZE, *_VALIDATE_ONLY, "--layout", str(paths["layout"])], codes=(2,))
        _never_a_traceback(["analyze", *LLAMA, *_VALIDATE_ONLY, "--mesh", "data=2", "--topology",
                            str(paths["topology"])], codes=(2,))


@settings(_FUZZ, max_examples=20)  # four commands an example, one a full read
@given(data=st.data())
def test_fuzzed_checkpoint_and_store_manifests_are_refused_in_one_line(data, pristine):
    """Manifests fuzzed near the real ones: read by `ckpt ls`, `inspect`, `diff` and `data stats`,
    each either works (exit 0: the draw kept them valid) or refuses in one line."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, store = pathlib.Path(tmp) / "ckpt", pathlib.Path(tmp) / "store"
        shutil.copytree(pristine / "ckpt", ckpt)
        shutil.copytree(pristine / "store", store, ignore=shutil.ignore_patterns("shard-*"))
        for path in (_manifest(ckpt), store / "manifest.json"):
            path.write_text(json.dumps(data.draw(_near(json.loads(path.read_text())), label=path.name)))
        for argv in (["ckpt", "ls", str(ckpt)], ["ckpt", "inspect", str(ckpt)],
                     ["ckpt", "diff", str(pristine / "ckpt"), str(ckpt)], ["data", "stats", str(store)]):
            _never_a_traceback(argv, codes=(0, 1, 2) if argv[1] == "diff" else (0, 2))


if __name__ == "__main__":
    print(doc_table())
