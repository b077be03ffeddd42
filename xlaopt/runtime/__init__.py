"""Running a compiled program: the training loop (`train`), the sharded-vs-single-device check
(`verify`), multi-process start-up (`distributed`) and the progress bar (`progress`)."""
