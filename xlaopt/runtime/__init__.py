"""Running a compiled program: the training loop (`train`), the sharded-vs-single-device check
(`verify`), sampling (`generate`), multi-process start-up (`distributed`) and a local job's
launcher (`launch`), what a job does about dead, stopped or stuck peers, non-finite losses and
SIGTERM (`faults`), its goodput ledger (`goodput`) and the progress bar (`progress`)."""
