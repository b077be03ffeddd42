"""The layout planner: which mesh, device order, recomputation, micro-batching and precision
to train a model with on a topology, found in seconds and explained.

  shapes.py   a model config as the analytic cost model's shape (a decoder, or Cosmos 3's two towers)
  space.py    the candidate layouts that make sense for a model, a topology and a batch
  price.py    a candidate's analytic step time and memory per device
  planner.py  rank: drop what cannot run or fit, price the rest analytically, compile the top few
  replan.py   from one layout to another: the resharding it needs
  serving.py  how to lay a model out to serve it, priced analytically (`plan --serve`)
  serving_step.py  that serving step compiled and simulated beside its analytic price (`analyze --serve`)
The planning pass (`xlaopt.passes.layout_plan`) and `xlaopt plan` drive it.
"""
