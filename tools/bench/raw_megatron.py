"""A hand-written megatron-core training script: the baseline ``tessera run`` (engine megatron) is measured against.

The minimal canonical megatron-core loop (as NVIDIA/Megatron-LM's examples/run_simple_mcore_train_loop.py and
``pretrain_gpt``'s train step): ``parallel_state.initialize_model_parallel``, the model-parallel RNG seed, a
``TransformerConfig``, ``GPTModel`` with megatron-core's local (pure torch) layer spec, ``Float16Module``
for bf16, megatron's ``DistributedDataParallel``, ``get_megatron_optimizer`` (Adam with fp32 main params,
grad clipping; the distributed optimizer at parallel.zero=1), ``config.finalize_model_grads_func`` and
``get_forward_backward_func()``; per step ``zero_grad_buffer``, the schedule over the micro-batches (loss:
the mean token loss of each micro-batch, which the schedule divides by their number) and
``optimizer.step()``. Layouts: tp, dp (pp = 1, no experts).

What it takes from Tessera, so that both runs train the same model on the same batches: the input side
(recipe and overrides, data, seeded sampler, LR as a function of the step: ``_raw_common.py``), the HF ->
megatron mapping of the model (the family adapter's ``TransformerConfig`` fields: RMSNorm, SwiGLU, RoPE,
GQA, no biases, untied embeddings; the vocabulary padded to a multiple of tp, as Tessera pads it), the
CPU-only settings and shim (``tessera.engines.cpu_shim``: megatron-core 0.16.1 assumes CUDA; applied only
on CPU, as the engine does), and with ``--init tessera`` (the default) the seeded initial weights, put
into megatron's layout by Tessera's weight map; ``--init megatron`` keeps megatron's own initialisation.
Tessera's megatron engine also uses the local spec (TransformerEngine is not installed by make setup).

Measures per step (rank 0 writes JSONL to --out; the fields: see _raw_common.py) the optimizer step's
time, its wall-clock end, tokens, loss, and on the first step the time from process start.

Launch it exactly as `tessera run` launches its ranks::

    DS_ACCELERATOR=cpu .venv/bin/deepspeed --num_gpus 2 --bind_cores_to_rank --master_addr 127.0.0.1 \\
        --master_port 29620 tools/bench/raw_megatron.py --recipe recipes/tiny-llama-cpu-mcore-tp2.yaml \\
        --steps 10 --out /tmp/raw-mcore.jsonl
    # one GPU: DS_ACCELERATOR=cuda .venv/bin/deepspeed --num_gpus 1 --master_addr 127.0.0.1 \\
    #   --master_port 29621 tools/bench/raw_megatron.py --recipe recipes/bench-llama-1b-h200.yaml \\
    #   parallel.engine=megatron ...
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from _raw_common import (
    PG_TIMEOUT,
    RawRun,
    Step,
    StepLog,
    finish,
    load_data,
    lr_of,
    mean_over,
    model_source,
    parse_args,
    run_main,
    setup,
    steps,
)

IGNORE_INDEX = -100


def check_layout(run: RawRun) -> None:
    L = run.layout
    unsupported = {
        "parallel.pp": L.pp != 1,
        "parallel.vpp": L.vpp != 1,
        "parallel.ep": L.ep != 1,
        "parallel.zero (0 = DDP, 1 = distributed optimizer)": L.zero > 1,
        "parallel.zero_impl (megatron's own only)": L.zero_impl == "deepspeed" and L.zero > 0,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        sys.exit(
            f"raw_megatron.py runs tp x dp layouts with megatron's DDP / distributed optimizer; set {bad}"
        )


def init_parallel(run: RawRun) -> Any:
    """torch.distributed (env:// from the launcher), megatron-core's groups and its model-parallel RNG."""
    from megatron.core import parallel_state, tensor_parallel

    torch.distributed.init_process_group(
        backend="nccl" if run.device == "cuda" else "gloo", timeout=PG_TIMEOUT
    )
    if run.device == "cpu":  # megatron-core assumes CUDA: Tessera's CPU shim, only on CPU
        from tessera.engines import cpu_shim

        cpu_shim.apply()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=run.layout.tp, pipeline_model_parallel_size=1
    )
    seed = run.recipe.train.seed
    if run.device == "cpu":
        from tessera.engines import cpu_shim

        cpu_shim.seed_model_parallel_rng(
            seed, tp_rank=parallel_state.get_tensor_model_parallel_rank(), ep_rank=0
        )
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel_state


def build_model(run: RawRun, ps: Any, *, init: str) -> tuple[Any, Any]:
    """(GPTModel, its TransformerConfig) of this TP rank, on the device."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tessera.engines.megatron_build import CPU_CONFIG, RECOMPUTE
    from tessera.models.megatron import Shard, adapter_for
    from tessera.models.weight_map import hf_to_mcore

    source = model_source(run)
    hf_cfg = source.hf_config()
    adapter = adapter_for(hf_cfg.model_type)
    shape_kw = adapter.transformer(hf_cfg, run.recipe.data.seq_len)  # the model's shape, from the HF config
    if shape_kw.get("num_moe_experts"):
        sys.exit("raw_megatron.py is for dense models (no experts)")
    bf16 = run.recipe.train.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    tp = run.layout.tp
    config = TransformerConfig(
        **shape_kw,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=run.layout.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        attention_softmax_in_fp32=True,
        **RECOMPUTE[run.layout.recompute],
        **(CPU_CONFIG if run.device == "cpu" else {}),
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
        vocab_size=-(-hf_cfg.vocab_size // tp) * tp,  # padded to a multiple of tp (zero rows)
        max_sequence_length=hf_cfg.max_position_embeddings,
        parallel_output=True,
        **adapter.gpt(hf_cfg),  # RoPE base / scaling, untied output layer
    )
    if init == "tessera":  # the same initial weights as every Tessera engine: the seeded HF tensors
        shard = Shard(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank())
        missing, unexpected = model.load_state_dict(
            hf_to_mcore(source.tensors(), adapter, hf_cfg, shard), strict=False
        )
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    if run.device == "cuda":
        model.cuda(torch.cuda.current_device())
    return model, config


def build(run: RawRun, ps: Any, *, init: str) -> tuple[Any, Any, Any]:
    """The script's model (``Float16Module`` for bf16, megatron's ``DistributedDataParallel``), megatron's
    optimizer and the schedule function, as Megatron-LM's ``setup_model_and_optimizer`` makes them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    model, config = build_model(run, ps, init=init)
    distopt = run.layout.zero == 1
    if config.bf16:  # as Megatron-LM's get_model: bf16 weights everywhere, fp32 main params in the optimizer
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distopt
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    o = run.recipe.optim
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            clip_grad=o.grad_clip or 0.0,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=distopt,
        ),
        [model],
    )
    config.finalize_model_grads_func = finalize_model_grads  # dp grad reduction, tp-replicated grads
    return model, optimizer, get_forward_backward_func()


def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    """megatron-core's forward step: one micro-batch (input_ids, labels) through ``model``; the loss is the
    micro-batch's mean token loss."""
    ids, labels = next(data_iterator)
    device = next(model.parameters()).device
    ids = ids.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    # megatron scores position t against labels[t]: shift by one, mask the last position and -100s
    target = torch.full_like(labels, IGNORE_INDEX)
    target[:, :-1] = labels[:, 1:]
    loss_mask = (target != IGNORE_INDEX).float()
    target = target.clamp(min=0)
    position_ids = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
    output = model(ids, position_ids, None, labels=target)  # per-token loss [b, s]; causal mask

    def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
        # a copy: the schedule divides the returned loss by the micro-batch count in place
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def train_step(
    run: RawRun, model: Any, optimizer: Any, forward_backward: Any, batch: Step, n: int
) -> tuple[list[dict[str, torch.Tensor]], float | None, float]:
    """One optimizer step of the raw loop: the LR, zeroed gradient buffers, megatron-core's schedule over
    the micro-batches and ``optimizer.step()``. Returns the schedule's reported losses, the grad norm and
    the LR."""
    lr = lr_of(run, n)
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.zero_grad_buffer()
    optimizer.zero_grad()
    reported = forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(batch.micro),
        model=model,
        num_microbatches=len(batch.micro),
        seq_length=run.recipe.data.seq_len,
        micro_batch_size=run.layout.micro_batch,
        forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("megatron's optimizer skipped the step")
    return reported, None if grad_norm is None else float(grad_norm), lr


def reported_loss(run: RawRun, reported: list[dict[str, torch.Tensor]], batch: Step) -> float:
    """The step's loss as the loop reports it: the schedule's micro-batch losses, their mean over
    micro-batches and data-parallel ranks (one all-reduce, after the timed step)."""
    from megatron.core import parallel_state

    loss_sum = torch.stack([d["lm loss"] for d in reported]).sum()
    return mean_over(
        loss_sum, len(batch.micro) * run.layout.dp, group=parallel_state.get_data_parallel_group()
    )


def main() -> None:
    ap_args = parse_args(
        __doc__.splitlines()[0],
        extra=lambda ap: ap.add_argument(
            "--init",
            choices=["tessera", "megatron"],
            default="tessera",
            help="initial weights: Tessera's seeded HF weights (as `tessera run`), or megatron's own init",
        ),
    )
    run = setup(ap_args)
    check_layout(run)
    ps = init_parallel(run)
    load_data(run)
    model, optimizer, forward_backward = build(run, ps, init=ap_args.init)
    log = StepLog(run, ap_args.out)
    model.train()
    for n, batch in enumerate(steps(run), start=1):
        run.sync()
        t0 = time.perf_counter()
        reported, grad_norm, lr = train_step(run, model, optimizer, forward_backward, batch, n)
        run.sync()
        dt = time.perf_counter() - t0
        wall = time.time()
        log.write(
            n,
            dt,
            wall,
            batch,
            loss=reported_loss(run, reported, batch),
            lr=lr,
            grad_norm=None if grad_norm is None else float(grad_norm),
        )
    ps.destroy_model_parallel()
    finish(log)


if __name__ == "__main__":
    run_main(main)
