"""A long job's goodput ahead of the run: how often to checkpoint, and what the run will keep.

`failures` says how often a job of N GPUs fails (an MTBF per GPU, or a published run's rate);
`costs` what a failure and a checkpoint cost this job (measured from a run's goodput ledger, or
given); `interval` plans the checkpoint interval of each tier from those (Young's and Daly's
formulas) and gives Daly's expected goodput; `simulate` runs the job as a discrete-event
simulation, failure by failure, for goodput, restarts and the time lost to each cause. The ledger
a run keeps as it goes is `xlaopt.runtime.goodput`.
"""
