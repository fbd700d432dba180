"""What each megatron rank holds, in HF terms (``mcore_to_hf_slices``, the basis of the engines'
``state_dict()``): placed into empty full tensors, the slices of every shard of a layout rebuild every HF
tensor exactly, with no element left unwritten. Pure functions, no process group."""

from __future__ import annotations

import itertools

import pytest
import torch
import yaml

from helpers import REPO
from tessera.models.megatron import Shard, adapter_for
from tessera.models.weight_map import hf_keys_covered, hf_to_mcore, mcore_to_hf_slices
from tessera.tables.families import FAMILIES, MEGATRON_FAMILIES

LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1)]
CASES = [(f, *lay) for f in MEGATRON_FAMILIES for lay in LAYOUTS] + [
    ("mixtral", 1, 1, 1, 2),
    ("mixtral", 2, 1, 1, 2),
]


def _hf(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = yaml.safe_load((REPO / FAMILIES[family].tiny_config).read_text())["model"]["hf_config"]
    if family != "gpt2":
        d["vocab_size"] = 511  # odd: at tp 2: the padded rows must stay out of the slices
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(5)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("family,tp,pp,vpp,ep", CASES)
def test_slices_of_every_shard_rebuild_the_hf_tensors(family, tp, pp, vpp, ep):
    model = _hf(family)
    cfg, hf = model.config, model.state_dict()
    adapter = adapter_for(cfg.model_type)
    rebuilt: dict[str, torch.Tensor] = {}
    written: dict[str, torch.Tensor] = {}
    for t, p, v, e in itertools.product(range(tp), range(pp), range(vpp), range(ep)):
        shard = Shard(
            tp=tp, tp_rank=t, pp=pp, pp_rank=p, vpp=vpp, vp_stage=v, ep=ep, ep_rank=e, etp=tp, etp_rank=t
        )
        local = hf_to_mcore(hf, adapter, cfg, shard)
        for name, pieces in mcore_to_hf_slices(local, adapter, cfg, shard).items():
            for tensor, index, full in pieces:
                assert full == tuple(hf[name].shape), (name, full)
                box = tuple(slice(a, b) for a, b in index)
                rebuilt.setdefault(name, torch.full(full, float("nan")))[box] = tensor
                written.setdefault(name, torch.zeros(full, dtype=torch.bool))[box] = True
    assert set(rebuilt) == hf_keys_covered(adapter, cfg)
    for name, t in rebuilt.items():
        assert bool(written[name].all()), f"{name}: elements no shard holds"
        assert torch.equal(t, hf[name]), name
