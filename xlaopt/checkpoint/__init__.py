"""Tensorstore checkpoints: sharded, asynchronous, atomic, restorable onto any mesh.

The layout (zarr3 arrays plus a JSON manifest) is described in `layout.py`; plain tensorstore
or zarr-python read it without xlaopt.
"""
from xlaopt.checkpoint.layout import CheckpointError
from xlaopt.checkpoint.manager import CheckpointManager, Retention, SaveInfo

__all__ = ["CheckpointError", "CheckpointManager", "Retention", "SaveInfo"]
