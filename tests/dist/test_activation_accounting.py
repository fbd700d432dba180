"""Activation accounting, checked: the bytes autograd saved for backward in one micro-batch's forward
(measured on every rank with saved-tensor hooks, each storage once, parameters left out; summary.json)
against the planner's estimate of them for the layout (``activations_per_micro_batch``) within 10 %.

Every family at tp 1 (the HF module, deepspeed engine) and tp 2 (megatron-core), with recompute none and
full, at seq 128 so that the s² attention scores are a large term (and the loss's log-probabilities
another). Mixtral cannot train at tp 2 (megatron-core needs sequence parallelism with MoE under TP, and
its local spec has none for RMSNorm: the layout is refused before launch), so its megatron case is tp 1.
One step per run; all runs share one pair of rank processes.
"""

from __future__ import annotations

import pytest
from helpers import REPO, assert_activations_match_plan, train_runs

pytestmark = pytest.mark.slow

R = REPO / "recipes"
FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "mixtral")
SHAPE = [
    "data.seq_len=128",
    "parallel.micro_batch=2",
    "parallel.global_batch=4",
    "train.steps=1",
    "checkpoint.at_end=false",
    "data.eval.max_samples=4",  # one held-out batch: the eval after the step saves nothing for backward
]
ENGINES = {
    "hf_tp1": ["parallel.engine=deepspeed", "parallel.zero=0"],
    "mcore_tp2": ["parallel.engine=megatron", "parallel.tp=2", "parallel.zero=0"],
}
CASES = {
    f"{fam}_{eng}_{rc}": (fam, [*SHAPE, *over, f"parallel.recompute={rc}"])
    for fam in FAMILIES
    for eng, over in ENGINES.items()
    if (fam, eng) != ("mixtral", "mcore_tp2")
    for rc in ("none", "full")
}
for rc in ("none", "full"):  # Mixtral on megatron-core: tp 1 (see above)
    CASES[f"mixtral_mcore_tp1_{rc}"] = (
        "mixtral",
        [*SHAPE, "parallel.engine=megatron", "parallel.zero=0", f"parallel.recompute={rc}"],
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("activations")
    specs = {base / name: (R / f"tiny-{fam}-cpu.yaml", over, False) for name, (fam, over) in CASES.items()}
    train_runs(specs, world=2)
    return {d.name: d for d in specs}


@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_activation_bytes_match_the_planner(runs, name):
    got, want = assert_activations_match_plan(runs[name], tol=0.10)
    assert want > 0 and got[0] == got[1]  # both ranks see the same shapes (dp or tp peers)
