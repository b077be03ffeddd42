import dataclasses

import pytest

from xlaopt.models.flops import forward_flops, layer_weights_per_tower
from xlaopt.models.registry import ConfigError, get_config, parse_overrides
from xlaopt.program import TrainProgram
from xlaopt.step import param_count


def test_derived_fields_follow_overrides():
    c = get_config("cosmos3-tiny", {"d_model": 512})
    assert c.head_dim == 512 // c.num_heads == 64
    assert c.mrope_sections == (12, 10, 10) and sum(c.mrope_sections) == c.head_dim // 2
    explicit = get_config("cosmos3-tiny", {"d_model": 512, "head_dim": 32})
    assert explicit.head_dim == 32 and explicit.mrope_sections == (6, 5, 5)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_config("cosmos3-tiny").d_model = 1


@pytest.mark.parametrize("items, message", [
    (["num_heds=3"], "did you mean 'num_heads'"),
    (["num_layers"], "expected key=value"),
    (["num_layers=two"], "not a valid int"),
])
def test_bad_overrides_say_what_is_wrong(items, message):
    with pytest.raises(ConfigError, match=message):
        parse_overrides("cosmos3-tiny", items)


@pytest.mark.parametrize("overrides, message", [
    ({"num_heads": 3}, "not divisible by num_heads=3"),
    ({"num_kv_heads": 3}, "not a multiple of num_kv_heads=3"),
    ({"mrope_sections": (4, 4, 4)}, "summing to head_dim/2=16"),
])
def test_inconsistent_shapes_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        get_config("cosmos3-tiny", overrides)


def test_unknown_model_suggests_a_name():
    with pytest.raises(ConfigError, match="did you mean 'cosmos3-tiny'"):
        get_config("cosmos3-tny")


@pytest.mark.parametrize("name, released", [
    # Totals derived from the released configs without the reasoner's ViT encoder
    # (../shared/docs/cosmos3-architecture.md); we count both towers, embeddings, LM head, generator I/O.
    ("cosmos3-nano", 15.2e9),
    ("cosmos3-super", 64.0e9),
])
def test_released_sizes_counted_from_abstract_tree(name, released):
    count = param_count(TrainProgram(get_config(name)))
    assert abs(count - released) / released < 0.02, count


def test_tiny_is_tiny():
    assert 10e6 <= param_count(TrainProgram(get_config("cosmos3-tiny"))) <= 50e6


def test_flops_formula_by_hand():
    c = get_config("cosmos3-nano")
    d, H, N, dh, F, L = 4096, 32, 8, 128, 12288, 36
    assert layer_weights_per_tower(c) == 2 * d * H * dh + 2 * d * N * dh + 3 * d * F
    # A reasoner-only sample: causal attention is half the square, no generator terms.
    n_r = 1000
    expected = 2 * L * layer_weights_per_tower(c) * n_r + L * 2 * H * dh * n_r**2 + 2 * d * c.vocab_size * n_r
    assert forward_flops(c, n_r, 0) == pytest.approx(expected)
    # Generator tokens see every token of their sample (two-way mask).
    n_g = 500
    extra = forward_flops(c, n_r, n_g) - forward_flops(c, n_r, 0)
    attn = L * 4 * H * dh * n_g * (n_r + n_g)
    io = 4 * d * c.latent_patch_dim * n_g + 2 * (c.timestep_freq_dim * d + d * d) * n_g
    assert extra == pytest.approx(2 * L * layer_weights_per_tower(c) * n_g + attn + io)


def test_nano_720p_attention_share_matches_the_note():
    # The note: for Nano at 720p (~44k generator tokens) attention is ~65% of the forward.
    c = get_config("cosmos3-nano")
    n_r, n_g = 512, 44_160
    total = forward_flops(c, n_r, n_g)
    attn = c.num_layers * (4 * c.num_heads * c.head_dim * n_g * (n_r + n_g) + 2 * c.num_heads * c.head_dim * n_r**2)
    assert 0.6 < attn / total < 0.7
