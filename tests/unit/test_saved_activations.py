"""The activation meter: each storage autograd saves counted once, parameters and their views left out,
one measurement per arming, nothing counted while disarmed."""

from __future__ import annotations

import torch

from tessera.engines.held import SavedActivations


def test_each_saved_storage_counts_once_and_parameters_not_at_all():
    lin = torch.nn.Linear(8, 16, bias=False)
    meter = SavedActivations()
    x = torch.randn(4, 8, requires_grad=True)
    with meter.micro_batch():  # disarmed: nothing measured
        lin(x).sum().backward()
    assert meter.per_micro_batch is None
    meter.arm([lin])
    with meter.micro_batch():
        y = lin(x)  # saves x (the weight is a parameter)
        z = torch.tanh(y)  # saves its output, 4 x 16
        w = z.view(64) * z.view(64)  # two views of one storage: counted once
    meter.disarm()
    w.sum().backward()
    assert meter.per_micro_batch == 4 * 8 * 4 + 4 * 16 * 4


def test_the_largest_micro_batch_is_kept_and_a_new_arming_starts_over():
    meter = SavedActivations()
    meter.arm([])
    for n in (3, 5, 2):
        x = torch.randn(n, requires_grad=True)
        with meter.micro_batch():
            torch.exp(x)  # saves its output: n fp32
    assert meter.per_micro_batch == 5 * 4
    meter.arm([])
    with meter.micro_batch():
        torch.exp(torch.randn(1, requires_grad=True))
    assert meter.per_micro_batch == 4
