"""The torch.distributed wrapper counts what real gloo ops move, per op and group, once each."""

from __future__ import annotations

import pytest

from helpers import run_on_ranks

pytestmark = pytest.mark.slow


def known_ops() -> list[dict]:
    import torch
    import torch.distributed as dist

    from tessera.comm.accounting import group_namer, install
    from tessera.plan.layout import ParallelLayout

    layout = ParallelLayout(engine="megatron", world_size=2, dp=1, tp=2, zero_impl="megatron")
    tp_group = dist.new_group([0, 1])  # the same ranks as the world: named by identity
    counter = install(group_namer(layout, {tp_group: "tp"}))
    rank = dist.get_rank()
    x = torch.ones(1000, dtype=torch.float32)
    dist.all_reduce(x)  # world, 4000 bytes
    dist.all_reduce(x, group=tp_group)  # tp, 4000 bytes
    out = torch.empty(2000)
    dist.all_gather_into_tensor(out, x, group=tp_group)  # gathered output: 8000 bytes
    rs = torch.empty(500)
    dist.reduce_scatter_tensor(rs, x, group=tp_group)  # input: 4000 bytes
    w = dist.all_reduce(torch.ones(10, dtype=torch.float64), async_op=True)  # 80 bytes
    w.wait()
    y = torch.zeros(250, dtype=torch.bfloat16)
    if rank == 0:
        dist.send(y, 1)
    else:
        dist.recv(y, 0)
    ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, y, 1 - rank)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    objs = [None, None]
    dist.all_gather_object(objs, {"r": rank})  # counted once, not as its inner all_gathers
    return counter.pop_step()


def test_counts_bytes_and_groups():
    for rank, ops in enumerate(run_on_ranks(known_ops, 2)):
        by = {(o["op"], o["group"], o["dtype"]): o for o in ops}
        # tp=2 on 2 ranks: the world group is the tp group, so both all-reduces are "tp"
        assert by[("all_reduce", "tp", "float32")]["bytes"] == 8000
        assert by[("all_reduce", "tp", "float32")]["count"] == 2
        assert by[("all_reduce", "tp", "float64")]["bytes"] == 80
        assert by[("all_gather", "tp", "float32")]["bytes"] == 8000
        assert by[("reduce_scatter", "tp", "float32")]["bytes"] == 4000
        p2p = "send" if rank == 0 else "recv"
        assert (by[(p2p, "tp", "bfloat16")]["count"], by[(p2p, "tp", "bfloat16")]["bytes"]) == (2, 1000)
        assert by[("all_gather_object", "tp", "-")]["count"] == 1
        assert sum(o["count"] for o in ops) == 8
        assert all(o["seconds"] >= 0 for o in ops)
