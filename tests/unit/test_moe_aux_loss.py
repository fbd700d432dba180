"""The router load-balancing loss the HF engines compute from router logits is megatron-core's own
(``switch_load_balancing_loss_func`` on its router's routing map), and a dense model refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.engines.base import router_balance_loss
from tessera.errors import RecipeError

REPO_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_router_balance_loss_is_megatron_cores_per_layer_loss_summed():
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )

    torch.manual_seed(0)
    layers = [torch.randn(96, 8) * 2 for _ in range(3)]  # 96 tokens, 8 experts, 3 layers
    want = torch.zeros(())
    for logits in layers:
        routing_map, scores = compute_routing_scores_for_aux_loss(logits, topk=2, score_function="softmax")
        want += switch_load_balancing_loss_func(
            probs=scores,
            tokens_per_expert=routing_map.sum(dim=0),
            total_num_tokens=96,
            topk=2,
            num_experts=8,
            moe_aux_loss_coeff=0.03,
        )
    got = router_balance_loss(layers, topk=2, coeff=0.03)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    # a router that sends every token to the same two experts scores E/k per layer (balanced: 1)
    skewed = torch.zeros(96, 8)
    skewed[:, :2] = 50.0
    assert float(router_balance_loss([skewed], topk=2, coeff=1.0)) == pytest.approx(4.0, rel=1e-6)


def test_a_dense_model_refuses_the_load_balancing_loss():
    from tessera.launch.runs import validate

    with pytest.raises(RecipeError) as e:
        validate(str(REPO_RECIPES / "tiny-llama-cpu.yaml"), ["model.moe_aux_loss_coeff=0.01"])
    assert e.value.field == "model.moe_aux_loss_coeff" and "no experts" in str(e.value)
    validate(str(REPO_RECIPES / "tiny-mixtral-cpu.yaml"), ["model.moe_aux_loss_coeff=0.01"])
