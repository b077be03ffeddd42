"""Bulk file I/O shared by checkpoints (`xlaopt.checkpoint`) and the sample store
(`xlaopt.data`): aligned and pooled host buffers (`hostmem`), the one O_DIRECT reader with its
fallback to plain reads (`direct`), crc32c (`crc32c`) and the zarr3 array specs both write
(`zarr3`); and the check that every output a command names can be written, made before any
work (`outputs`), as the local checkpoint tier's directory and peer count are (`node_local`).
Nothing here imports either user."""
