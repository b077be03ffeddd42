"""The local checkpoint tier: one process's shards as a self-checking blob, rebuilt bit for bit on
the layout they were saved on; the job's agreement on the newest step it holds whole; the
checks that keep it on a node's own disk; and, in a real two-process job, a killed process
restored from its peer's copy after its own was deleted, and a damaged tier falling back to
the persistent one, both ending bit-identical to an uninterrupted run."""
import json
import pathlib
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from xlaopt.checkpoint import CheckpointError, local, local_format
from xlaopt.cli import main
from xlaopt.errors import UserError
from xlaopt.io import node_local

from conftest import finish


def _tree():
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    w = jax.device_put(jnp.arange(64 * 6, dtype=jnp.bfloat16).reshape(64, 6), NamedSharding(mesh, P("data", "tensor")))
    b = jax.device_put(jnp.linspace(-1, 1, 6, dtype=jnp.float32), NamedSharding(mesh, P()))  # replicated
    return {"params": {"w": w, "b": b}, "step": np.int32(7)}


def test_a_blob_rebuilds_the_arrays_bit_for_bit_on_their_layout():
    tree = _tree()
    blob = local_format.pack(40, tree, {"data": {"pos": 3}}, 0, 1)
    header, payload = local_format.unpack(blob, "blob")
    assert header["step"] == 40 and header["meta"] == {"data": {"pos": 3}}
    # The replicated leaf once, not once per device; the split one as its 8 distinct shards.
    shards = {leaf["name"]: len(leaf["shards"]) for leaf in header["leaves"]}
    assert shards == {"params/b": 1, "params/w": 8, "step": 1}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                          if isinstance(x, jax.Array) else x, tree)
    back = local_format.assemble(header, payload, target, "blob")
    for name in ("w", "b"):
        a, b = tree["params"][name], back["params"][name]
        assert a.sharding == b.sharding and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert back["step"] == 7


def test_a_damaged_or_foreign_blob_is_refused_by_name():
    blob = bytearray(local_format.pack(1, _tree(), {}, 0, 1))
    with pytest.raises(CheckpointError, match="cut short"):
        local_format.unpack(bytes(blob[:-10]), "f.xlt")
    flipped = blob.copy()
    flipped[-3] ^= 0xFF
    with pytest.raises(CheckpointError, match="f.xlt: checksum mismatch"):
        local_format.unpack(bytes(flipped), "f.xlt")
    with pytest.raises(CheckpointError, match="not a local-tier file"):
        local_format.unpack(b"PK\x03\x04" + bytes(blob[4:]), "f.xlt")


def test_another_layout_is_refused_so_the_persistent_tier_serves_it():
    tree = _tree()
    header, payload = local_format.unpack(local_format.pack(1, tree, {}, 0, 1), "blob")
    mesh = jax.make_mesh((8,), ("data",))
    other = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
                         if isinstance(x, jax.Array) else x, tree)
    with pytest.raises(CheckpointError, match="another layout"):
        local_format.assemble(header, payload, other, "blob")


def test_the_job_restores_the_newest_step_every_process_can_get():
    # everyone[j][i]: the steps of process i's shards that process j holds; a peer holds its predecessor's.
    everyone = [{0: [40, 30], 2: [40, 30]}, {1: [30], 0: [40, 30]}, {2: [40, 30], 1: [40, 30]}]
    assert local.newest_complete(everyone, 3, peers=1) == 40  # process 1's own 40 is gone; process 2 has it
    assert local.source_of(everyone, 1, 40, 3, 1) == 1 and local.source_of(everyone, 0, 40, 3, 1) == 0
    assert local.newest_complete(everyone, 3, peers=0) == 30  # without peer copies, only 30 is whole
    everyone[2][1] = [30]
    assert local.newest_complete(everyone, 3, peers=1) == 30


def test_the_local_tier_must_be_local_writable_and_match_the_job(tmp_path):
    with pytest.raises(UserError, match="is, or overlaps, the persistent --ckpt"):
        node_local.check_local(tmp_path / "ckpt" / "local", tmp_path / "ckpt")
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(UserError, match="cannot write there"):
        node_local.check_local(blocked / "local", tmp_path / "ckpt")
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\nserver:/export /mnt/shared nfs4 rw 0 0\n")
    assert node_local.filesystem_type(pathlib.Path("/mnt/shared/job"), str(mounts)) == "nfs4"
    assert node_local.filesystem_type(pathlib.Path("/mnt/sharedx"), str(mounts)) == "ext4"
    for peers, processes, why in ((1, 1, "no peer"), (2, 2, r"at most 1 other\(s\)"), (-1, 2, "0 or more")):
        with pytest.raises(UserError, match=why):
            node_local.check_peers(peers, processes)
    node_local.check_peers(0, 1)
    node_local.check_peers(3, 4)


def test_verify_passes_over_a_save_a_stop_cut_short_but_not_over_damage(tmp_path, capsys):
    tree = _tree()

    def write(step, owner, holder=None):
        path = local.process_dir(tmp_path, owner if holder is None else holder) / local.file_name(step, owner)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(local_format.pack(step, tree, {}, owner, 2))
        return path

    for owner in (0, 1):
        write(30, owner)
    write(35, 0)  # killed between the two processes' saves of step 35
    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    assert "step 35: a save the job's stop interrupted" in capsys.readouterr().out
    assert local.verify_tier(tmp_path, 35)["ok"] is False  # asked for by name, it is not whole
    # A damaged file is damage, newest or not; and a step older than a whole one is not in progress.
    damaged = write(35, 1)
    damaged.write_bytes(damaged.read_bytes()[:-10])
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    damaged.unlink()
    for owner in (0, 1):
        write(40, owner)
    result = local.verify_tier(tmp_path)
    assert not result["ok"] and "in_progress" not in result and result["steps"][35]


TINY = ["--model", "llama-tiny", "--set", "num_layers=1", "--set", "d_model=64", "--set", "mlp_dim=128",
        "--set", "vocab_size=256", "--mesh", "data=2", "--dtype", "float32", "--batch-size", "4", "--text-len", "32",
        "--no-progress"]
STEPS, EVERY, LOCAL_EVERY = 60, 20, 5


def _ledger(ckpt: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / "goodput.jsonl").read_text().splitlines() if line.endswith("}")]


def _held(tier: pathlib.Path) -> dict[int, set[str]]:
    """Holder -> the names of the step files its directory holds (none where it is gone)."""
    dirs = {d: local.process_dir(tier, d) for d in (0, 1)}
    return {d: {p.name for p in path.iterdir()} if path.exists() else set() for d, path in dirs.items()}


def _restorable_steps(tier: pathlib.Path) -> list[int]:
    """Steps whose every process's shard some holder has (what a restore can rebuild, as
    `local.newest_complete` reads it), newest first. A kill between a step's own writes and its
    copies to the peer leaves it split over the holders and still restorable."""
    held = _held(tier)
    steps = {int(n[5:13]) for names in held.values() for n in names if n.endswith(".xlt")}
    return sorted((s for s in steps if all(any(local.file_name(s, o) in names for names in held.values())
                                           for o in (0, 1))), reverse=True)


@pytest.mark.slow  # four two-process jobs
def test_a_killed_job_restores_from_a_peer_then_falls_back_past_a_damaged_tier(tmp_path):
    from test_faults import _job, _kill, _wait_for_step, _xlaopt

    from xlaopt.checkpoint.layout import committed_steps

    ref, job, tier, ref_tier = tmp_path / "ref", tmp_path / "job", tmp_path / "local", tmp_path / "ref-local"
    common = [*TINY, "--steps", STEPS, "--ckpt-every", EVERY, "--peer-timeout", 5, "--local-every", LOCAL_EVERY]
    job_args = [*common, "--ckpt", job, "--local-ckpt", tier]
    # An earlier run's file, newer than any step of this one: a fresh run (no --resume) clears it.
    stale = local.process_dir(ref_tier, 0) / local.file_name(STEPS + 100, 0)
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an earlier run's step")
    reference = _xlaopt("train", *common, "--ckpt", ref, "--local-ckpt", ref_tier, "--processes", 2)

    # Killed past step 33, so past the local saves of 25 and 30 (a persistent one is due at 20);
    # then process 1's node loses its disk: its shards are in process 0's copy alone.
    procs = _job(job_args)
    _wait_for_step(job, 33, procs)
    procs[1].send_signal(signal.SIGKILL)
    _kill(procs)
    assert main(["ckpt", "verify", str(tier)]) == 0
    shutil.rmtree(local.process_dir(tier, 1))
    expected = _restorable_steps(tier)[0]
    procs = _job([*job_args, "--resume"])
    _wait_for_step(job, 47, procs)
    events = _ledger(job)
    assert [e["resumed_from"] for e in events if "resumed_from" in e][-1] == expected >= 30
    assert [e["local_from"] for e in events if "local_restore_s" in e][-1] == [0, 1]  # process 1's from its peer
    procs[1].send_signal(signal.SIGKILL)
    _kill(procs)

    # Every copy of process 0's shard of the newest restorable local step damaged: the restart
    # takes the next restorable local step or the persistent one, whichever is newer; a line names
    # each damaged file.
    newest = _restorable_steps(tier)[0]
    copies = [local.process_dir(tier, d) / local.file_name(newest, 0) for d, names in _held(tier).items()
              if local.file_name(newest, 0) in names]
    for path in copies:
        path.write_bytes(path.read_bytes()[:-100])
    older = [s for s in _restorable_steps(tier) if s < newest]
    expected = max(older[:1] + committed_steps(job)[-1:])
    final = _xlaopt("train", *job_args, "--resume", "--processes", 2, "--json", tmp_path / "job.json")
    _, err = final.communicate(timeout=300)
    finish([reference], 300)
    assert final.returncode == 0, err[-3000:]
    result = json.loads((tmp_path / "job.json").read_text())
    assert result["checkpoint"]["resumed_from"] == expected
    warned = [line for line in err.splitlines() if "local tier" in line]
    assert len(warned) == len(copies) and all(line.count("cut short") == 1 for line in warned), err[-3000:]
    assert main(["ckpt", "diff", str(ref), str(job), "--step", str(STEPS)]) == 0
    # The local tiers, read whole from each one's processes' copies, match the uninterrupted run's.
    assert main(["ckpt", "diff", str(tier), str(ref_tier), "--step", str(STEPS - LOCAL_EVERY)]) == 0
    assert not stale.exists()
