"""The recipe schema: what a Tessera run is, as typed, validated, documented fields.

Every field carries a one-line description (used in error messages and `tessera config show`).
Unknown keys are rejected (``extra="forbid"``) so that a typo never silently falls back to a default.
Cross-field rules that need the world size (global batch = micro x grad-accum x dp) live in
:mod:`tessera.plan.layout`, which is computed once from a resolved recipe.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tessera.errors import RecipeError
from tessera.tables.engines import ENGINE_NAMES, ZERO_IMPLS
from tessera.tables.families import MODEL_TYPES

#: what ``parallel.zero_impl`` may say: auto, or a sharding implementation (the registry's ZERO_IMPLS)
ZERO_IMPL_CHOICES: tuple[str, ...] = ("auto", *ZERO_IMPLS)


class _Section(BaseModel):
    # strict: a value of the wrong YAML type is refused, never coerced. Lax pydantic reads `true` as 1 for
    # an int (parallel.zero=true became ZeRO-1, checkpoint.every=false became 0), 1.0 as 1 and "2" as 2.
    # Strict keeps what a recipe legitimately writes: an int where a float is expected (lr: 1), and YAML
    # 1.2 floats such as 3e-4, which the recipe loader and the override parser resolve to floats.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), strict=True)


class ModelSection(_Section):
    hf_config: dict[str, Any] | None = Field(
        None, description="inline Hugging Face config dict (must contain model_type)"
    )
    path: str | None = Field(
        None, description="local HF config.json, config directory or pretrained directory"
    )
    pretrained: bool = Field(False, description="load the weights found in model.path (else random init)")
    attn_implementation: Literal["eager", "sdpa"] = Field(
        "eager", description="HF attention kernel; eager is bit-stable on CPU"
    )
    moe_aux_loss_coeff: float = Field(
        0.0,
        ge=0.0,
        description="MoE router load-balancing loss coefficient (0 = off), the same loss in every engine: "
        "megatron-core's switch load-balancing loss of each layer over the micro-batch's tokens, summed "
        "over layers (HF's router_aux_loss_coef formula pools the layers instead and is not used)",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if self.hf_config is not None and self.path is not None:
            # a recipe layer (e.g. configs/models/tiny-llama.yaml) gives an inline config and an override
            # gives a directory, or the other way round: name the override that clears the other one
            raise RecipeError(
                "give exactly one of model.hf_config (inline dict) or model.path (local dir); both are set",
                field="model.path",
                value=self.path,
                fix="to use the directory, clear the inline config with the override model.hf_config=null "
                "(or `hf_config: null` under model:); to use the inline config, model.path=null",
            )
        if self.hf_config is None and self.path is None:
            raise RecipeError(
                "give exactly one of model.hf_config (inline dict) or model.path (local dir); neither is set",
                field="model",
                value=None,
                fix="e.g. model.path=DIR (a save_pretrained directory) or include configs/models/tiny-llama.yaml",
            )
        if self.hf_config is not None and "model_type" not in self.hf_config:
            raise ValueError("model.hf_config needs a model_type (one of " + ", ".join(MODEL_TYPES) + ")")
        if self.pretrained and self.path is None:
            raise ValueError("model.pretrained: true needs model.path pointing at a pretrained directory")
        return self


class PeftSection(_Section):
    """Parameter-efficient fine-tuning: low-rank adapters on a frozen base (peft's LoRA / DoRA)."""

    method: Literal["lora", "dora"] = Field(
        "lora", description="lora, or dora (weight-decomposed LoRA: a trained magnitude per output row)"
    )
    r: int = Field(8, description="adapter rank (> 0)")
    alpha: float = Field(16.0, description="scaling numerator: the update is (alpha / r) * B @ A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="HF module names that get adapters, as written for peft (e.g. q_proj, v_proj, gate_proj)",
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="HF modules trained in full beside the adapters (e.g. lm_head)"
    )

    @field_validator("r")
    @classmethod
    def _rank(cls, v: int) -> int:
        if v <= 0:
            raise RecipeError(
                "the adapter rank must be positive",
                field="peft.r",
                value=v,
                fix="e.g. peft.r=8 (8-64 is usual)",
            )
        return v

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise RecipeError(
                "no target modules: the adapters would train nothing",
                field="peft.target_modules",
                value=v,
                fix="name the HF modules, e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
            )
        return v


class EvalSection(_Section):
    fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="share of the documents held out for eval loss (the last ones; never trained on); "
        "0 = no eval split",
    )
    max_samples: int = Field(256, ge=1, description="cap on eval rows (whole global batches are used)")


class SourceEntry(_Section):
    path: str = Field(
        description="a prepared directory (tessera data prepare: dataset.json + tokens.bin/.idx), a megatron "
        "indexed-dataset prefix (PATH.bin + PATH.idx, used as is), or text / jsonl / parquet / Arrow files, "
        "a glob or a save_to_disk directory (prepared once into data.cache_dir, cached by content)"
    )
    weight: float = Field(
        1.0, gt=0, description="share of the training rows drawn from this source (normalised)"
    )
    name: str | None = Field(
        None, description="the source's name in metrics and the manifest (default: path)"
    )


class PrepareSection(_Section):
    workers: int | None = Field(
        None, ge=1, description="processes that tokenize raw sources before the launch; null = all cores"
    )


class ChatSection(_Section):
    no_assistant: Literal["error", "skip"] = Field(
        "error", description="a chat row without an assistant turn: refuse it, or skip it (counted)"
    )
    too_long: Literal["error", "skip", "truncate"] = Field(
        "error",
        description="a fine-tuning row longer than data.seq_len (data.packing: false): refuse, skip "
        "(counted) or cut it",
    )


class DataSection(_Section):
    source: Literal["stdlib", "files"] = Field(
        "stdlib", description="stdlib = the Python standard library's source files; files = data.files"
    )
    sources: list[SourceEntry] = Field(
        default_factory=list,
        description="prepared datasets, megatron prefixes or raw files, blended by weight; replaces "
        "data.source / data.files (and data.max_docs, which caps those only)",
    )
    prepare: PrepareSection = Field(
        default_factory=PrepareSection,
        description="how raw text is tokenized into the memory-mapped dataset the ranks read",
    )
    files: list[str] = Field(default_factory=list, description="local text / jsonl / parquet files or globs")
    format: Literal["auto", "text", "jsonl", "parquet", "chat", "prompt_completion"] = Field(
        "auto",
        description="file format (auto picks by extension); chat = rows of messages [{role, content}] "
        "rendered with the tokenizer's chat template, the loss on assistant turns; prompt_completion = rows "
        "of prompt and completion, the loss on the completion (both: files by extension)",
    )
    chat: ChatSection = Field(
        default_factory=lambda: ChatSection(),
        description="fine-tuning rows (data.format chat / prompt_completion): what to do with the odd ones",
    )
    text_field: str = Field("text", description="column holding the text in jsonl / parquet files")
    tokenizer: str = Field(
        "auto",
        description="auto = the pretrained model's own (model.path, with model.pretrained), else bpe; "
        "bpe = train a byte-level BPE on the corpus; or a local tokenizer / model directory",
    )
    tokenizer_override: bool = Field(
        False,
        description="with model.pretrained: train with data.tokenizer although it is not the model "
        "directory's own (the pretrained embeddings then read other token ids; only the vocabulary size "
        "is checked)",
    )
    vocab_size: int = Field(512, ge=260, description="vocabulary size of the locally trained BPE")
    seq_len: int = Field(128, ge=8, description="tokens per training sample")
    packing: bool = Field(
        True, description="pack documents into full rows; false pads each document (labels -100)"
    )
    document_boundaries: bool = Field(
        False,
        description="packed rows: position ids restart at each document, attention stays inside it and a "
        "document's first token is not a target (HF-module engines: deepspeed, ddp)",
    )
    max_docs: int | None = Field(
        400, ge=1, description="cap on documents read (keeps CPU runs small); null = all"
    )
    cache_dir: str = Field(
        ".cache/tessera", description="where tokenizers and tokenized data are cached by hash"
    )
    eval: EvalSection = Field(default_factory=EvalSection, description="the held-out eval split")

    @model_validator(mode="after")
    def _files_given(self) -> DataSection:
        if self.sources and self.files:
            raise ValueError(
                "give data.sources or data.files, not both (data.sources: [{path: ...}] takes files too)"
            )
        if self.source == "files" and not self.files and not self.sources:
            raise ValueError("data.source: files needs data.files (a list of local paths)")
        names = [e.name or e.path for e in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources names repeat ({', '.join(names)}): give each a distinct name")
        return self


class ParallelSection(_Section):
    auto: bool = Field(
        False,
        description="take the planner's layout (`parallel: auto` in YAML): engine, dp/tp/pp/vpp/ep, zero, "
        "micro_batch; parallel.global_batch is kept when set",
    )
    engine: Literal[ENGINE_NAMES] = Field(  # type: ignore[valid-type]  # the names of tables/engines.py
        "deepspeed", description="training engine: " + ", ".join(ENGINE_NAMES)
    )
    dp: int | Literal["auto"] = Field("auto", description="data-parallel degree; auto = world_size / (tp*pp)")
    tp: int = Field(1, ge=1, description="tensor-parallel degree")
    pp: int = Field(1, ge=1, description="pipeline-parallel degree")
    vpp: int = Field(1, ge=1, description="virtual pipeline stages per rank (interleaved schedule)")
    ep: int = Field(1, ge=1, description="expert-parallel degree (MoE families)")
    zero: int = Field(0, description="ZeRO stage 0-3 (sharding of optimizer state / grads / params over dp)")
    zero_impl: Literal[ZERO_IMPL_CHOICES] = Field(  # type: ignore[valid-type]
        "auto",
        description="who shards over dp; only engine megatron has a choice: megatron's DistributedOptimizer "
        "(zero 0-1) or DeepSpeed ZeRO over the dp group (zero 1-3, pp = 1); auto = the engine's own, for "
        "megatron: megatron for 0-1, deepspeed for 2-3",
    )
    sequence_parallel: bool | Literal["auto"] = Field(
        "auto",
        description="engine megatron: sequence parallelism in the TP regions; auto = on when tp > 1 "
        "and megatron shards over dp",
    )
    sp: int = Field(
        1,
        ge=1,
        description="Ulysses sequence-parallel degree (engine deepspeed; DeepSpeed's ALST): every sample's "
        "sequence split over sp ranks, attention heads split over them by all-to-all; world = dp*sp",
    )
    tiled_mlp: bool = Field(
        False,
        description="DeepSpeed's TiledMLP: each MLP computed over sequence tiles, its full-length "
        "intermediate never held (recomputed tile by tile in backward); engine deepspeed",
    )
    tiled_loss: bool = Field(
        False,
        description="the LM head and the loss computed over sequence tiles (DeepSpeed's "
        "sequence_tiled_compute): no full-length logits; engine deepspeed",
    )
    offload_activations: bool = Field(
        False,
        description="with recompute: full, the checkpointed layer inputs kept in host memory until "
        "backward (DeepSpeed's checkpoint offload; CUDA only: on CPU they are in host memory already)",
    )
    recompute: Literal["none", "selective", "full"] = Field(
        "none",
        description="activation recompute: none; selective = megatron-core's attention-core recompute "
        "(engine megatron); full = every layer's activations recomputed in backward from its input "
        "(megatron-core's full granularity, HF gradient checkpointing for engines deepspeed and ddp)",
    )
    micro_batch: int = Field(1, ge=1, description="samples per rank per forward/backward")
    global_batch: int | None = Field(
        None, ge=1, description="samples per optimizer step over all ranks; default micro*grad_accum*dp"
    )
    grad_accum: int | None = Field(None, ge=1, description="micro-batches per step; default derived")
    offload_optimizer: bool = Field(False, description="ZeRO optimizer-state offload to CPU (stages 1-3)")
    offload_params: bool = Field(False, description="ZeRO parameter offload to CPU (stage 3 only)")
    deepspeed_config: str | None = Field(
        None,
        description='path of a user DeepSpeed JSON merged under the recipe; "auto" values are filled '
        "from the recipe as HF Trainer does, contradictions and keys Tessera cannot take are refused",
    )

    @field_validator("zero")
    @classmethod
    def _zero_range(cls, v: int) -> int:
        if v not in (0, 1, 2, 3):
            raise ValueError("ZeRO stage must be 0, 1, 2 or 3")
        return v

    @field_validator("dp")
    @classmethod
    def _dp_pos(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("dp must be >= 1 or 'auto'")
        return v

    @model_validator(mode="after")
    def _offload_rules(self) -> ParallelSection:
        if self.offload_optimizer and self.zero == 0:
            raise ValueError("parallel.offload_optimizer needs parallel.zero 1, 2 or 3")
        if self.offload_params and self.zero != 3:
            raise ValueError("parallel.offload_params needs parallel.zero: 3")
        if self.offload_activations and self.recompute != "full":
            raise RecipeError(
                "activation offload moves the layer inputs that full recompute checkpoints; without "
                "recompute there are none",
                field="parallel.offload_activations",
                value=True,
                fix="set parallel.recompute: full, or parallel.offload_activations: false",
            )
        return self


class OptimSection(_Section):
    name: Literal["adamw", "deepspeed_adam"] = Field(
        "adamw",
        description="adamw = torch.optim.AdamW; deepspeed_adam = DeepSpeed's fused / CPU Adam (JIT-built)",
    )
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    min_lr: float = Field(0.0, ge=0, description="floor of the cosine schedule")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    schedule: Literal["cosine", "constant", "linear"] = Field("cosine", description="decay after warmup")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    betas: tuple[float, float] = Field(
        (0.9, 0.95), strict=False, description="Adam betas"
    )  # a YAML list, read as a tuple; each item stays a strict float
    eps: float = Field(1e-8, gt=0, description="Adam epsilon")
    grad_clip: float = Field(1.0, ge=0, description="global grad-norm clip; 0 disables")


class TrainSection(_Section):
    steps: int = Field(20, ge=1, description="optimizer steps")
    seed: int = Field(1234, description="seed of weights, data order and RNG")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="compute precision")
    log_every: int = Field(1, ge=1, description="metrics / progress every N steps")
    eval_every: int = Field(
        0,
        ge=0,
        description="eval loss on data.eval every N steps and after the last; 0 = after the last only",
    )


class Tolerance(_Section):
    """A band around the baseline's curve, step by step; several forms given: the widest applies."""

    rel: float | None = Field(None, gt=0, description="|candidate - baseline| <= rel * |baseline|")
    abs: float | None = Field(None, gt=0, description="|candidate - baseline| <= abs")
    noise_floor_multiple: float | None = Field(
        None, gt=0, description="|candidate - baseline| <= k * the baseline seeds' spread at that step"
    )

    @model_validator(mode="after")
    def _one_form(self) -> Tolerance:
        if self.rel is None and self.abs is None and self.noise_floor_multiple is None:
            raise ValueError("give rel, abs or noise_floor_multiple")
        return self


class AcceptanceSection(_Section):
    """Thresholds of ``tessera compare``, fixed before the runs start (written to preregistration.json).
    Ratios are candidate / baseline; an unset threshold is not checked."""

    throughput_ratio_min: float | None = Field(
        None, gt=0, description="steady-state tokens/s of the candidate over the baseline's, at least"
    )
    peak_memory_ratio_max: float | None = Field(
        None, gt=0, description="largest per-rank peak memory over the baseline's, at most"
    )
    time_to_first_step_ratio_max: float | None = Field(
        None, gt=0, description="process start to the end of step 1, over the baseline's, at most"
    )
    loss_tolerance: Tolerance | None = Field(None, description="band of the loss curve around the baseline")
    grad_norm_tolerance: Tolerance | None = Field(
        None, description="band of the grad-norm curve around the baseline"
    )
    eval_loss_ratio_max: float | None = Field(
        None, gt=0, description="final eval loss over the baseline's, at most (needs data.eval)"
    )
    warmup_steps: int = Field(5, ge=0, description="first steps left out of every timing statistic")


class LossSpikeRule(_Section):
    zscore: float = Field(6.0, gt=0, description="z-score of the loss against the trailing window")
    window: int = Field(50, ge=5, description="trailing steps the mean and deviation come from")
    patience: int = Field(3, ge=1, description="consecutive steps above the limit before stopping")


class ThroughputRule(_Section):
    value: float = Field(..., gt=0, description="tokens/s (the slowest rank's) below which the run stops")
    window: int = Field(20, ge=1, description="steps the mean is taken over (after the first window)")


class StopSection(_Section):
    hang_timeout_s: float | None = Field(
        300.0, gt=0, description="stop (and restart) when a rank makes no progress this long; null = never"
    )
    startup_timeout_s: float | None = Field(
        600.0,
        gt=0,
        description="before a rank's first step: stop (and restart) when one start-up phase (prepare, "
        "rendezvous, data, model build, checkpoint load, W&B, the first step) makes no progress this long; "
        "covers DeepSpeed's JIT builds (~100 s each on 2 cores); null = never",
    )
    straggler_ratio: float = Field(
        1.5, gt=1, description="warn when a rank's compute time exceeds the median's by this factor"
    )
    straggler_window: int = Field(20, ge=1, description="steps the straggler check averages over")
    loss_spike: LossSpikeRule | None = Field(None, description="stop on a loss spike; null = off")
    min_tokens_per_s: ThroughputRule | None = Field(None, description="throughput floor; null = off")
    max_time_s: float | None = Field(
        None, gt=0, description="wall-time limit: a final checkpoint, then stop; null = none"
    )


class CheckpointSection(_Section):
    every: int = Field(0, ge=0, description="save every N steps (0 = only at the end)")
    keep: int = Field(2, ge=1, description="keep the last N checkpoints")
    at_end: bool = Field(True, description="save after the last step")
    # `async` is a Python keyword: the field is async_ in code, `async` in recipes and in every dump
    model_config = ConfigDict(**_Section.model_config, serialize_by_alias=True)
    async_: bool = Field(
        True,
        alias="async",
        description="write checkpoints in the background while the steps go on (the state is snapshot "
        "first; at most one save in flight; `latest` moves when every rank's files are on disk); false = "
        "the step waits for the whole save. Engines whose saves cannot run in the background (a DeepSpeed "
        "JSON that picks another checkpoint engine) save synchronously either way",
    )


class WandbSection(_Section):
    mode: Literal["online", "offline", "disabled"] = Field("offline", description="W&B mode")
    project: str = Field("tessera", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team)")
    name: str | None = Field(None, description="W&B run name; default the run dir name")
    tags: list[str] = Field(default_factory=list, description="W&B tags")
    init_timeout_s: float = Field(
        30.0, gt=0, description="online: how long wandb.init may try to reach the server (W&B's init_timeout)"
    )
    required: bool = Field(
        False,
        description="online: a W&B server that cannot be reached is an error (exit 2); false = mirror "
        "offline instead, with one warning (upload later with wandb sync)",
    )


class TrackingSection(_Section):
    wandb: WandbSection = Field(default_factory=WandbSection, description="Weights & Biases")


class RunSection(_Section):
    name: str | None = Field(None, description="run name; default the recipe file name")
    world_size: int = Field(1, description="number of ranks")
    launcher: Literal["deepspeed", "torchrun"] = Field("deepspeed", description="process launcher")
    out_dir: str | None = Field(None, description="run directory; default runs/<name>")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile for multi-node runs")
    master_addr: str = Field("127.0.0.1", description="rendezvous address")
    master_port: int | Literal["auto"] = Field(
        "auto",
        description="rendezvous port; auto = a free port on this machine (a hostfile run: 29500)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if available else cpu")
    hardware: str | None = Field(
        None,
        description="hardware profile for the planner: a name in configs/hardware/ or a path; default "
        "h100-sxm-80g on cuda, cpu-2core on cpu",
    )
    restarts: int = Field(
        0,
        ge=0,
        description="restart from the last good checkpoint after a rank failure or hang, at most N times",
    )
    preempt_grace_s: float = Field(
        120.0, gt=0, description="SIGTERM / SIGINT: seconds the ranks get to checkpoint the current step"
    )
    bind_cores_to_rank: bool = Field(
        True, description="deepspeed --bind_cores_to_rank on CPU (needs numactl)"
    )

    @field_validator("master_port")
    @classmethod
    def _port(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1024 <= v <= 65535:
            raise ValueError("master_port must be auto or a port in 1024-65535")
        return v

    @field_validator("world_size")
    @classmethod
    def _ws(cls, v: int) -> int:
        if v < 1:
            raise ValueError("world_size must be >= 1")
        return v


class Recipe(_Section):
    """A resolved recipe: everything one run needs, nothing implicit."""

    model: ModelSection
    data: DataSection = Field(default_factory=DataSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    stop: StopSection = Field(default_factory=StopSection, description="stop rules and the hang watchdog")
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    acceptance: AcceptanceSection = Field(
        default_factory=AcceptanceSection, description="tessera compare's pre-registered thresholds"
    )
    run: RunSection = Field(default_factory=RunSection)
    peft: PeftSection | None = Field(
        None, description="low-rank adapters on a frozen base (null = train every weight)"
    )

    @model_validator(mode="after")
    def _tokenizer_of_the_model(self) -> Recipe:
        """``data.tokenizer: auto`` becomes the pretrained model's directory (or ``bpe``), so the resolved
        recipe, the data cache key and the manifest all name the tokenizer actually used; a pretrained
        model with another tokenizer is refused unless ``data.tokenizer_override`` says so."""
        model, data = self.model, self.data
        own = model.path if model.pretrained else None
        if data.tokenizer == "auto":
            data.tokenizer = own if own is not None else "bpe"
        elif own is not None and not data.tokenizer_override and not same_dir(data.tokenizer, own):
            what = (
                "a BPE trained on this corpus"
                if data.tokenizer == "bpe"
                else f"the tokenizer in {data.tokenizer}"
            )
            raise RecipeError(
                f"model.pretrained loads the weights of {own}, which were trained with that directory's "
                f"tokenizer; {what} gives other token ids to the same embeddings",
                field="data.tokenizer",
                value=data.tokenizer,
                fix=f"data.tokenizer=auto (the model's own tokenizer), or keep it and set "
                f"data.tokenizer_override=true if this tokenizer is the one {own} was trained with",
            )
        return self

    @model_validator(mode="after")
    def _boundaries_on_an_hf_module(self) -> Recipe:
        """Document boundaries in packed rows need an attention that reads them: transformers' mask
        builder does (packed sequences from restarting position ids); megatron-core's local spec has no
        packed-sequence attention on this path (it needs Transformer Engine's THD format)."""
        from tessera.tables.engines import ENGINES, engines_with

        if (
            self.data.document_boundaries
            and self.data.packing
            and not ENGINES[self.parallel.engine].caps.hf_module
        ):
            raise RecipeError(
                f"engine '{self.parallel.engine}' cannot keep attention inside each document of a packed row",
                field="data.document_boundaries",
                value=True,
                fix=f"use parallel.engine: {engines_with(lambda c: c.hf_module)} (transformers' attention honours "
                "it: sdpa, eager, flex, flash-attention), or data.document_boundaries=false",
            )
        return self

    @model_validator(mode="after")
    def _ulysses_rules(self) -> Recipe:
        """What Ulysses sequence parallelism needs of the model and the data, where the engine has it (an
        engine without it refuses ``parallel.sp`` by the capability rules). DeepSpeed's attention wrapper
        drops the attention mask and runs the core kernel causally over the gathered sequence: eager is
        not a kernel it wraps, and packed documents would attend across their boundaries (silently wrong
        losses); each sequence is cut into sp equal slices; the MoE load-balancing loss would see only a
        rank's slice of the tokens."""
        from tessera.tables.engines import ENGINES

        sp, model, data = self.parallel.sp, self.model, self.data
        if sp == 1 or not ENGINES[self.parallel.engine].caps.sp:
            return self
        if model.attn_implementation != "sdpa":
            raise RecipeError(
                f"Ulysses sequence parallelism (parallel.sp={sp}) wraps a fused attention kernel; DeepSpeed's "
                f"wrapper refuses '{model.attn_implementation}'",
                field="model.attn_implementation",
                value=model.attn_implementation,
                fix="set model.attn_implementation: sdpa, or parallel.sp: 1",
            )
        if data.document_boundaries and data.packing:
            raise RecipeError(
                "under Ulysses sequence parallelism attention runs causally over the whole gathered row "
                "(DeepSpeed's wrapper drops the mask), so documents packed in a row would see each other",
                field="data.document_boundaries",
                value=True,
                fix="set data.document_boundaries: false (documents packed and attending across), "
                "data.packing: false (one document per row), or parallel.sp: 1",
            )
        if data.seq_len % sp:
            ws = self.run.world_size
            fits = [k for k in range(2, ws + 1) if ws % k == 0 and data.seq_len % k == 0 and k != sp][:3]
            raise RecipeError(
                f"data.seq_len={data.seq_len} cannot be cut into parallel.sp={sp} equal slices",
                field="data.seq_len",
                value=data.seq_len,
                fix=f"use a multiple of {sp} (e.g. {(data.seq_len // sp + 1) * sp})"
                + (f", or parallel.sp: {' or '.join(map(str, fits))}" if fits else ""),
            )
        if model.moe_aux_loss_coeff:
            raise RecipeError(
                "the router load-balancing loss would be computed on each rank's slice of the sequence, "
                "not on the whole batch as at sp=1",
                field="model.moe_aux_loss_coeff",
                value=model.moe_aux_loss_coeff,
                fix="set model.moe_aux_loss_coeff: 0, or parallel.sp: 1",
            )
        return self

    @model_validator(mode="after")
    def _adapters_on_megatron(self) -> Recipe:
        """An explicit ``zero_impl`` adapters cannot train under (:func:`tessera.tables.engines.adapters_refusal`;
        ``auto`` is judged on the resolved layout, by the planner and the engine)."""
        from tessera.tables.engines import adapters_refusal

        refused = adapters_refusal(self.parallel.engine, self.parallel.zero_impl) if self.peft else None
        if refused is not None:
            raise refused
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def same_dir(a: str, b: str) -> bool:
    """Whether two recipe paths name the same directory, as written (no filesystem access: relative paths
    are relative to the same working directory for data.tokenizer and model.path)."""
    import os

    def norm(p: str) -> str:
        return os.path.normpath(os.path.abspath(os.path.expanduser(p)))

    return norm(a) == norm(b)
