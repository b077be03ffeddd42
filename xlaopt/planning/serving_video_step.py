"""A Cosmos 3 text-to-video request priced from a compiled denoising step: `xlaopt analyze --serve video`.

The step (`serving_step.analyze_denoise`: both guidance branches as two rows, the prompt's K/V
cached or the joint sequence every step) is compiled at the request's size on the mesh, for the
CPU or deviceless for the topology's GPUs, and simulated on the topology; the request is that
step `steps` times, plus the prompt's one reasoner pass (cached sampler) and the VAE decode, both
priced analytically (`serving_video`), beside the analytic price of the whole request on the
same layout. Both branches' text regions are one length in a batch: the longer of the prompt and
the negative prompt, as the sampler pads them.

A layout that splits positions over `context` compiles the sampler's Ulysses attention
(`sample_cosmos.ulysses`): the clip's and the text's lengths must divide the context ranks.
"""
from __future__ import annotations

from xlaopt.analysis.topology import Topology
from xlaopt.errors import UserError
from xlaopt.inference.video_profile import VideoProfile
from xlaopt.mesh import MeshSpec
from xlaopt.sharding import Rule


def analyze_video(config, spec: MeshSpec, rules: tuple[Rule, ...], topology: Topology, target: str,
                  profile: VideoProfile, cached: bool = True, dtype: str = "bfloat16") -> dict:
    from xlaopt.analysis import costmodel as cm
    from xlaopt.planning import serving_video as sv
    from xlaopt.planning.serving_step import analyze_denoise

    layout = sv.layout_of_mesh(spec, profile.guided)
    if layout.data > 1:
        raise UserError(f"--mesh {spec}: analyze prices one request; data beyond the guidance branches would be "
                        f"replicas serving other requests (plan --serve video prices them)")
    which = "cached" if cached else "uncached"
    gen, text = profile.gen_tokens(config.patch_size), max(profile.branch_text_tokens())
    step = analyze_denoise(config, spec, rules, topology, target, 1, text, gen, profile.guidance, dtype,
                           which=(which,))
    eff = cm.serving_efficiency(topology)
    analytic = sv.price_video(config, profile, layout, topology, eff, cached)
    parts = {"steps": profile.steps * step[which]["step_time_s"], "prompt": analytic.parts["prompt"],
             "vae": analytic.parts["vae"]}
    return {**step, "mode": "video", "request": sv.request_report(config, profile), "sampler": which,
            "layout": layout.name, "seconds_per_video": sum(parts.values()), "parts": parts,
            "analytic": {"seconds_per_video": analytic.seconds, "step_s": analytic.step_s, "parts": analytic.parts}}


def format_video_step(r: dict) -> str:
    s, a = r[r["sampler"]], r["analytic"]
    return "\n".join([
        f"{r['model']} text-to-video on {r['layout']}, topology {r['topology']}, target {r['target']}: "
        f"{r['gen']:,} generator tokens after {r['text']:,} prompt tokens, guidance {r['guidance']:g}, "
        f"{r['request']['steps']} steps, sampler {r['sampler']}, {r['compute_dtype']}",
        f"seconds a video {r['seconds_per_video']:.4g} (analytic {a['seconds_per_video']:.4g}): steps "
        f"{r['parts']['steps']:.4g} (compiled step {s['step_time_s']:.4g} s, analytic {a['step_s']:.4g}), prompt "
        f"{r['parts']['prompt']:.3g}, VAE decode {r['parts']['vae']:.3g} (analytic); compile {s['compile_s']:.1f} s",
    ])
