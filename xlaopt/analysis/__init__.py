"""Analysis of a compiled training step: what it costs, and where the time goes.

The chain, module by module: `hlo` reads collectives (and loop trip counts) out of compiled HLO
text; `schedule` turns the scheduled HLO into the entry's ops in execution order (loops expanded,
FLOPs and bytes per op); `simulate` runs that schedule on a cluster `topology` (devices, nodes,
link levels) with a compute and a communication stream; `costmodel` holds the pricing
primitives (roofline, collectives over link levels, fitted efficiencies), `analytic` prices a
decoder step from its shapes alone, and `calibrate` / `calibrate_compiled` fit the efficiencies
to published runs. `analyze` is `xlaopt analyze` (compile, schedule, simulate, report), with
`gpu_aot` compiling deviceless for GPUs; `inspection` is `xlaopt inspect`; `hardware` and
`cpu_peak` give the peak FLOP/s of real devices; `notebook` renders an analysed step as HTML.
"""
