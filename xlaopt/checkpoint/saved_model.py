"""The model a checkpoint was saved from, as its manifest's metadata records it (`model`, the
registered name, and `config`, the config's fields as JSON): rebuilt into a config, so that a
command given only `--ckpt DIR` serves what was trained there, and compared field by field with
a config a command was given, so that another model's checkpoint is refused by name."""
from __future__ import annotations

import dataclasses
import json

from xlaopt.checkpoint.layout import CheckpointError

# Fields that were model-config fields before they became execution settings: a checkpoint
# saved back then carries them in its config.
FORMER_MODEL_FIELDS = ("remat", "attention_block", "attention")


def _saved_fields(meta: dict) -> dict:
    return {k: v for k, v in meta["config"].items() if k not in FORMER_MODEL_FIELDS}


def config_differences(config, meta: dict) -> list[str]:
    """`field: saved X, now Y` for each field where `config` differs from the saved one. A field
    added since the checkpoint was saved ran at its default (new fields keep old behaviour)."""
    now = json.loads(json.dumps(dataclasses.asdict(config)))  # tuples -> lists, as saved
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    saved = json.loads(json.dumps(defaults)) | _saved_fields(meta)
    return [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}"
            for k in sorted(set(now) | set(saved)) if now.get(k) != saved.get(k)]


def saved_config(meta: dict, where: str):
    """The config the checkpoint at `where` was saved with. Its class is the registered model's;
    a name that is not registered (weights imported under their own name) is matched by its
    fields to the one family whose config has exactly them."""
    from xlaopt.models.registry import config_class, registered_models

    if "model" not in meta or "config" not in meta:
        raise CheckpointError(f"{where}: its metadata names no model (saved by something other than xlaopt train "
                              f"or import-weights?); give --model with the same --set fields it was trained with")
    saved = _saved_fields(meta)
    if meta["model"] in registered_models():
        classes = [config_class(meta["model"])]
    else:
        classes = {config_class(n) for n in registered_models()}
        classes = [c for c in classes if {f.name for f in dataclasses.fields(c)} >= set(saved)]
    if len(classes) != 1:
        raise CheckpointError(f"{where}: a checkpoint of {meta['model']!r}, whose config fields match "
                              f"{len(classes)} model families; give --model with the fields it was trained with")
    cls = classes[0]
    unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise CheckpointError(f"{where}: saved config fields {', '.join(unknown)} are unknown to this xlaopt's "
                              f"{cls.__name__}; read it with the version that wrote it")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
