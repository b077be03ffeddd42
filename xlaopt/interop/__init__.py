"""Interoperability with NVIDIA's reference Cosmos 3 implementation in `diffusers`
(`Cosmos3OmniTransformer`): its config.json and safetensors layout in and out
(`diffusers_config`, `diffusers_weights`), its forward call on one sample
(`reference_forward`), and a number-for-number comparison against it (`parity`).

Nothing here imports torch or diffusers except `parity`'s reference side.
"""
