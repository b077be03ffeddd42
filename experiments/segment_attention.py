"""Dense masked attention against segment-aware attention (`--exec attention=segment`) on packed
rows, side by side in one run: cosmos3-tiny on rows of 2,048 tokens (384 text + 1,664 generator)
holding 16 samples each: 8 of 16 text tokens and a 120-token clip, 8 of 32 text tokens and an
88-token clip, in a different order in every row (so rows' sample boundaries differ, as packed
rows' do: each row is scheduled on its own).

    python experiments/segment_attention.py [--rounds 3] [--steps 5] [--json out/segment_attention.json]

Expected on a 2-core machine: ~4 minutes (one compile of each, then rounds that alternate which
contender goes first). A third contender, `io_only` (no attention at all, wrong values), is the
floor: what the rest of the step costs. Expected result: the same losses within float32 rounding and a
segment-aware step several times faster: of the row's (query block, key block) pairs it computes
only those in which some query may see some key, and with 16 samples per row that is a small
fraction of them. Writes medians, per-round times and the pair counts as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# (text tokens, latent grid) of the two sample kinds; 8 of each fill 384 text + 1,664 generator slots.
KINDS = ((16, (2, 4, 15)), (32, (2, 4, 11)))
SAMPLES_PER_ROW, TEXT_LEN, GEN_LEN = 16, 384, 1664


def packed_batch(config, shape, seed: int = 0) -> dict:
    import numpy as np

    from xlaopt.data.batch import cosmos3_batch_spec
    from xlaopt.data.packing import fill_row
    from xlaopt.data.sample import Sample
    from xlaopt.models.cosmos3 import VIDEO

    rng = np.random.default_rng(seed)
    out = {k: np.zeros(s, d) for k, (s, d, _) in cosmos3_batch_spec(config, shape).items()}
    for row in range(shape.batch_size):
        kinds = rng.permutation([0, 1] * (SAMPLES_PER_ROW // 2))
        samples = []
        for kind in kinds:
            n_text, grid = KINDS[kind]
            latents = rng.standard_normal((int(np.prod(grid)), config.latent_patch_dim)).astype(np.float32)
            samples.append(Sample(rng.integers(16, config.vocab_size, n_text).astype(np.int32), VIDEO, latents,
                                  grid, 0, 0, 24.0))
        fill_row(out, row, samples, rng.uniform(0.1, 0.9, SAMPLES_PER_ROW).tolist(), config)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per contender and round")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--json", default="out/segment_attention.json")
    args = parser.parse_args()

    import jax

    import xlaopt
    from xlaopt.families import family_of
    from xlaopt.models.segment_attention import pair_counts

    xlaopt.simulated_devices(1)
    shape = (args.batch_size, TEXT_LEN, GEN_LEN)
    contenders = {}
    # io_only computes no attention (wrong values, a floor): what the rest of the step costs.
    for attention in ("dense", "segment", "io_only"):
        program = xlaopt.build_program("cosmos3-tiny", batch=shape, execution={
            "attention": attention, "attention_block": args.block, "compute_dtype": "float32"})
        program, _ = xlaopt.optimize(program)
        compiled = xlaopt.compile_program(program)
        t0 = time.perf_counter()
        compiled.train_step  # noqa: B018 (compiled outside the timed steps)
        contenders[attention] = {"compiled": compiled, "compile_s": time.perf_counter() - t0,
                                 "program": program, "times": [], "losses": []}
    batch = packed_batch(contenders["dense"]["program"].model, contenders["dense"]["program"].settings.batch)
    key = jax.random.key(0)
    for round_ in range(args.rounds):
        order = list(contenders) if round_ % 2 == 0 else list(reversed(contenders))  # alternate who goes first
        for name in order:
            c = contenders[name]
            compiled = c["compiled"]
            state = compiled.init(key)
            put = compiled.put_batch(batch)
            losses, times = [], []
            for _ in range(args.steps + 1):  # the first step of a round is warm-up
                t = time.perf_counter()
                state, metrics = compiled.train_step(state, put, key)
                losses.append(float(metrics["loss"]))
                times.append(time.perf_counter() - t)
            c["times"].append(statistics.median(times[1:]))
            c["losses"] = losses
            print(f"round {round_ + 1}/{args.rounds} {name:<8} median step {c['times'][-1]:.3f}s", flush=True)

    # The block pairs each attention of a layer computes, row by row, for this batch.
    family = family_of(contenders["segment"]["program"].model)
    pairs = {}
    for name, (q, k) in zip(("reasoner", "generator"), family.attention_calls(batch)):
        nq, nk = (-(-t.segment_BL.shape[1] // args.block) for t in (q, k))
        pairs[name] = {"computed": int(pair_counts(q, k, args.block).sum()), "of": shape[0] * nq * nk}
    dense, seg = contenders["dense"], contenders["segment"]
    result = {
        "shape": {"batch_size": shape[0], "text_len": shape[1], "gen_len": shape[2], "samples_per_row": SAMPLES_PER_ROW},
        "block": args.block,
        "median_step_s": {n: statistics.median(c["times"]) for n, c in contenders.items()},
        "round_step_s": {n: c["times"] for n, c in contenders.items()},
        "compile_s": {n: c["compile_s"] for n, c in contenders.items()},
        "losses": {n: c["losses"] for n, c in contenders.items()},
        "max_loss_diff": max(abs(a - b) for a, b in zip(dense["losses"], seg["losses"])),
        "block_pairs": pairs,
    }
    median = result["median_step_s"]
    result["speedup"] = median["dense"] / median["segment"]
    result["attention_speedup"] = (median["dense"] - median["io_only"]) / (median["segment"] - median["io_only"])
    print(f"\n{'attention':<10}{'median step s':>14}{'compile s':>11}")
    for n in contenders:
        print(f"{n:<10}{result['median_step_s'][n]:>14.3f}{result['compile_s'][n]:>11.1f}")
    print(f"segment-aware / dense: {result['speedup']:.2f}x faster per step, {result['attention_speedup']:.2f}x on "
          f"the attention alone (step minus the io_only floor); max loss difference over "
          f"{len(dense['losses'])} steps {result['max_loss_diff']:.2e}")
    print("block pairs computed: " + ", ".join(f"{n} {p['computed']} of {p['of']}" for n, p in pairs.items()))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
