"""The small protocol every engine implements, and the loss that all of them share.

Loss normalisation is by tokens, not by micro-batches: a step's loss is the sum of token
cross-entropies over the whole global batch (all micro-batches, all data-parallel ranks) divided by the
number of label tokens in it. That is what a single-rank, no-accumulation run computes, so layouts that
split the same global batch differently give the same numbers even when micro-batches carry different
numbers of tokens (padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass
class StepResult:
    """What one optimizer step reports (global values, identical on every rank)."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int  # label tokens in the global batch
    input_tokens: int  # input positions in the global batch (throughput counts these)


class Engine(Protocol):
    """build (constructor), train_step, save, load, close."""

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], step: int) -> StepResult: ...

    def save(self, root: Path, tag: str, client_state: dict[str, Any]) -> None: ...

    def load(self, root: Path, tag: str) -> dict[str, Any]: ...

    def close(self) -> None: ...


def label_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss after the causal shift (position 0 of each row predicts nothing)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies in fp32 (the caller divides by the global token count)."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
