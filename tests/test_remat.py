"""Named recomputation policies (xlaopt.models.remat): each layer saves exactly the activations
its policy names, as the residuals of the model's vjp show, and computes the numbers of keeping
everything."""
import re

import jax
import pytest
from jax.ad_checkpoint import print_saved_residuals

from xlaopt import step
from xlaopt.analysis import analytic
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.families import family_of
from xlaopt.mesh import MeshSpec
from xlaopt.models import remat
from xlaopt.models.registry import get_config
from xlaopt.planning.price import saved_per_token_layer
from xlaopt.planning.residuals import saved_bytes_per_token_layer
from xlaopt.planning.shapes import analytic_shape
from xlaopt.program import TrainProgram, TrainSettings
from xlaopt.runtime.verify import compare, one_step_grads

from conftest import LLAMA_TINY

NAMED = [name for name, policy in remat.REMAT_POLICIES.items() if policy.saves is not None]
# A gated MLP (SwiGLU, Llama's) and an ungated one (GELU, the ViT's) name their input projections
# apart. The MLP's output only joins the residual sum, whose backward reads nothing: no policy can
# make it a residual, so no block's backward reads it.
BLOCKS = {
    "gated": ("llama-tiny", set(remat.NAMES) - {remat.MLP_IN, remat.MLP_OUT}),
    "ungated": ("vit-tiny", set(remat.NAMES) - {remat.MLP_GATE, remat.MLP_UP, remat.MLP_OUT}),
}


def _saved_names(model: str, policy: str, capsys) -> list[str]:
    """The named residuals of one layer's model under `policy`. The layers are unrolled: inside
    a scan, the residuals would show as the scan's outputs, unnamed (the policy is the same)."""
    config = get_config(model, {"num_layers": 1})
    program = TrainProgram(config, MeshSpec(), settings=TrainSettings(batch=family_of(config).default_batch(config)),
                           execution=ExecutionConfig(remat=policy, layer_stack="unrolled", compute_dtype="float32"))
    params, _ = step.abstract_params_with_axes(program)
    net, family, key = step.make_model(program), family_of(program.model), jax.random.key(0)
    capsys.readouterr()
    print_saved_residuals(lambda w, x: family.loss(net, w, family.with_draws(x, key), key)[0], params,
                          step.abstract_batch(program))
    return sorted(re.findall(r"named '([^']+)'", capsys.readouterr().out))


@pytest.mark.parametrize("block", BLOCKS)
def test_each_policy_saves_exactly_the_names_it_lists(block, capsys, monkeypatch):
    model, read = BLOCKS[block]
    monkeypatch.setitem(remat.REMAT_POLICIES, "every_name",
                        remat.RematPolicy("every_name", "save every name", frozenset(remat.NAMES)))
    assert _saved_names(model, "every_name", capsys) == sorted(read)
    assert _saved_names(model, "full", capsys) == []
    for name in NAMED:
        assert _saved_names(model, name, capsys) == sorted(remat.REMAT_POLICIES[name].saves & read), name


def test_megatron_recomputes_only_the_core_attention_and_torchtitan_every_second_matmul():
    saves = lambda name: remat.REMAT_POLICIES[name].saves  # noqa: E731
    everything_read = BLOCKS["gated"][1]
    assert everything_read <= saves("selective_megatron")  # no named activation reruns: the core attention does
    assert saves("selective_op") & everything_read == {remat.QUERY, remat.VALUE, remat.CONTEXT, remat.MLP_GATE}
    assert saves("minimal_flash") == saves("minimal_with_context") == saves("minimal") | {remat.CONTEXT}


def test_every_policy_computes_the_numbers_of_keeping_everything():
    def program(policy):
        return TrainProgram(LLAMA_TINY, MeshSpec(), execution=ExecutionConfig(remat=policy, compute_dtype="float32"))

    # Policies that keep the same residuals of this block trace the same program: each is run once
    # (minimal_flash is minimal_with_context; the gated block never reads what save_dot_except_mlpwi
    # and save_dot_except_mlp differ by). test_each_policy_saves_exactly_the_names_it_lists checks the sets.
    read = BLOCKS["gated"][1]
    kept = {(p.rule, p.checkpointed, frozenset(p.saves or ()) & read): name
            for name, p in reversed(remat.REMAT_POLICIES.items())}
    assert len(kept) < len(remat.REMAT_POLICIES) - 1 and "none" in kept.values()
    reference = one_step_grads(program("none"))
    for name in kept.values():
        if name != "none":
            result = compare(one_step_grads(program(name)), reference, "float32")
            assert result["ok"], (name, result)


def test_an_unknown_policy_lists_the_names():
    with pytest.raises((UserError, ValueError)) as error:
        ExecutionConfig(remat="save_everything")
    assert all(name in str(error.value) for name in remat.REMAT_POLICIES)


@pytest.mark.parametrize("model", ["llama-tiny", "vit-tiny"])
def test_the_planners_memory_formula_is_what_each_named_policy_saves(model):
    """Each named policy's bytes per token and layer, as the planner's formula counts them (the
    layer input and the named activations the backward reads), equal the residuals the layer
    stack's vjp keeps, traced (`planning.residuals`)."""
    config = get_config(model)
    program = TrainProgram(config, settings=TrainSettings(batch=family_of(config).default_batch(config)))
    traced = saved_bytes_per_token_layer(program, "bfloat16", policies=tuple(NAMED))
    formula = saved_per_token_layer(analytic_shape(config, 1.0), tp=1, compute=2)
    assert {name: traced[name] for name in NAMED} == {name: formula[name] for name in NAMED}


def test_named_policies_are_priced_by_what_they_recompute():
    shape = analytic_shape(get_config("llama3-8b"), 1.0)
    fractions = {name: analytic.recompute_fractions(shape, name) for name in NAMED}
    q, k, v, o, gate, up, down = shape.layer_matmuls()
    assert fractions["selective_op"] == analytic.recompute_fractions(shape, "selective-op")  # TorchTitan's
    assert fractions["selective_op"] == ((k + o + up) / (q + k + v + o + gate + up + down), 0.0, 1.0)
    assert fractions["minimal_with_context"] == fractions["minimal_flash"] == (0.0, 0.0, 1.0)
    assert fractions["minimal"] == (0.0, 1.0, 1.0)  # the attention's output not kept: it runs again
    assert fractions["save_qkv_proj"] == ((o + gate + up) / sum(shape.layer_matmuls()), 1.0, 1.0)
    assert fractions["selective_megatron"] == (0.0, 0.0, 0.0)
    assert fractions["full"] == analytic.recompute_fractions(shape, "full") == (1.0, 1.0, 1.0)
    # Memory falls as less is kept, along MaxText's ladder.
    saved = saved_per_token_layer(shape, tp=1, compute=2)
    ladder = ("minimal_with_context", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj",
              "full")
    assert [saved[name] for name in ladder] == sorted((saved[name] for name in ladder), reverse=True)
    assert saved["none"] > saved["selective_megatron"] > saved["minimal_with_context"]


def test_without_recomputation_norms_and_the_activation_keep_what_fused_kernels_keep():
    """`none` keeps, of the norms, their bf16 inputs and outputs only (autodiff of the fp32 norm
    kept its fp32 input and normalised value), and of the MLP two [tokens, mlp_dim] arrays for the
    activation's backward and its output for the down projection's (autodiff kept six)."""
    from jax._src.ad_checkpoint import saved_residuals

    config = get_config("llama-tiny", {"num_layers": 1})
    program = TrainProgram(config, MeshSpec(), settings=TrainSettings(batch=family_of(config).default_batch(config)),
                           execution=ExecutionConfig(remat="none", layer_stack="unrolled", compute_dtype="bfloat16"))
    params, _ = step.abstract_params_with_axes(program)
    net, family, key = step.make_model(program), family_of(program.model), jax.random.key(0)
    kept = [aval for aval, _ in saved_residuals(lambda w, x: family.loss(net, w, family.with_draws(x, key), key)[0],
                                                params, step.abstract_batch(program)) if aval.ndim == 3]
    rows = kept[0].shape[:2]
    assert sum(a.shape == (*rows, config.mlp_dim) for a in kept) == 3
    assert {a.dtype.name for a in kept if a.shape == (*rows, config.d_model)} == {"bfloat16"}
