"""Acceptance of the deepspeed engine on real gloo ranks (tiny Llama, fp32)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import (
    DEFAULT_RECIPE,
    PICKLE_MARKER,
    REPO,
    assert_all_finite,
    assert_close_rel,
    assert_comm_matches_plan,
    assert_damage_is_refused,
    assert_hf_export_replays_the_run,
    assert_model_states_match_plan,
    assert_nan_stop,
    forge_checksum,
    losses,
    plant_pickle,
    set_steps,
    train_run,
    train_runs,
)
from tessera.checkpoint.index import LATEST, checkpoint_files, read_meta, step_dir_name
from tessera.checkpoint.manager import CheckpointManager
from tessera.rundir import ExitCode, RunDir
from tessera.tables.families import FAMILIES, MEGATRON_FAMILIES

#: the families whose ZeRO-2 run is here: the ones tests/dist/test_families.py does not train (its families
#: run ZeRO-2, ZeRO-3 and ddp there)
ZERO2_FAMILIES = [f for f in MEGATRON_FAMILIES if f not in ("qwen3", "qwen3-moe", "deepseek-v3")]
from untrusted import assert_fifo_is_refused, assert_no_code_runs

pytestmark = pytest.mark.slow

STEPS = 20
DDP = ["parallel.engine=ddp", "parallel.zero=0"]
NAN = ["train.steps=4", "checkpoint.every=2"]  # NaN gradient injected at step 3
# two held-out global batches (of 256 rows by default) in every fixture run: each layout's eval and the
# sum across batches are compared all the same, at an eighth of the eval's cost
EVAL = "data.eval.max_samples=32"


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """20-step runs: ZeRO 0-3 and the ddp baseline on 2 ranks and one 1-rank reference (same seed, data,
    global batch); the first halves of the resume checks; the stop-rule runs; offload, bf16 and every
    family. Runs of one world size share one set of rank processes."""
    base = tmp_path_factory.mktemp("zero")
    runs = {"_base": base}
    R = DEFAULT_RECIPE
    got = train_runs({base / "ref": (R, [f"train.steps={STEPS}", "parallel.zero=0", EVAL], False)}, world=1)
    two: dict = {base / f"z{z}": (R, [f"train.steps={STEPS}", f"parallel.zero={z}"], False) for z in range(4)}
    two[base / "ddp"] = (R, [f"train.steps={STEPS}", *DDP], False)
    for name, ov in RESUMED.items():  # checkpoint at step 10, continued to 20 below
        two[base / f"resume_{name}"] = (R, ["train.steps=10", *ov], False)
    # stop rules: a NaN gradient norm at step 3 ends the run (DIVERGED) before it records or saves step 3
    for name, ov in (("z0", ["parallel.zero=0"]), ("z2", ["parallel.zero=2"]), ("ddp", DDP)):
        two[base / f"nan_{name}"] = (R, [*NAN, *ov], False, ExitCode.DIVERGED, "nan_grad@3")
    # non-finite state at a checkpoint (finite loss and norm): the save is refused, latest stays step 1
    two[base / "nanstate_z2"] = (
        R, ["train.steps=3", "checkpoint.every=1", "parallel.zero=2"], False, ExitCode.DIVERGED, "nan_param@2"
    )  # fmt: skip
    # the stop rules of issue 11, each on an injected cause, and all of them armed on a clean run
    z2 = [f"train.steps={STEPS}", "parallel.zero=2"]
    two[base / "rules_clean"] = (R, [*z2, *RULES_ON], False)
    spike = ["stop.loss_spike.zscore=3", "stop.loss_spike.window=5", "stop.loss_spike.patience=1"]
    two[base / "rule_spike"] = (R, [*z2, *spike], False, ExitCode.LOSS_SPIKE, "spike:step=8:factor=30")
    floor = ["stop.min_tokens_per_s.value=1e12", "stop.min_tokens_per_s.window=2"]
    two[base / "rule_floor"] = (R, [*z2, *floor], False, ExitCode.THROUGHPUT_FLOOR)
    two[base / "rule_time"] = (R, [*z2, "stop.max_time_s=0.001"], False, ExitCode.TIME_LIMIT)
    two[base / "preempt_z2"] = (R, z2, False, ExitCode.PREEMPTED, "sigterm:step=4")
    slow = ["train.steps=8", "stop.straggler_window=3", "stop.straggler_ratio=1.2"]
    two[base / "straggler_z2"] = (R, slow, False, 0, "slow:rank=1:factor=6")
    for name, ov in OFFLOAD.items():
        two[base / name] = (R, [f"train.steps={STEPS}", *ov], False)
    two[base / "bf16"] = (R, ["train.steps=8", "parallel.zero=2", "train.precision=bf16"], False)
    for name, ov in RECOMPUTED.items():  # HF gradient checkpointing (parallel.recompute: full)
        two[base / f"recompute_{name}"] = (
            R,
            [f"train.steps={RECOMPUTE_STEPS}", *ov, "parallel.recompute=full"],
            False,
        )
    for fam in ZERO2_FAMILIES:
        two[base / f"family_{fam}"] = (
            REPO / FAMILIES[fam].tiny_recipe, ["train.steps=5", "parallel.zero=2", "optim.warmup_steps=0"], False
        )  # fmt: skip
    two = {d: (rec, [*ov, EVAL], *rest) for d, (rec, ov, *rest) in two.items()}
    got.update(train_runs(two, world=2))
    for name in RESUMED:  # continue in the same run dirs: the recipe on disk is what --resume reads
        set_steps(base / f"resume_{name}", STEPS)
    # a checkpoint whose RNG file is a pickle that would create a marker when unpickled, checksum forged
    evil = base / "pickle_z2"
    shutil.copytree(base / "resume_z2", evil)
    plant_pickle(evil)
    resumed = {base / f"resume_{name}": (R, [], True) for name in RESUMED}
    resumed[base / "preempt_z2"] = (R, [], True)  # continue the preempted run to the end
    resumed[evil] = (R, [], True, ExitCode.USER_ERROR)
    got.update(train_runs(resumed, world=2))
    runs.update({d.name: rec for d, rec in got.items()})
    return runs


RESUMED = {"z2": ["parallel.zero=2"], "z3": ["parallel.zero=3"], "ddp": DDP}
RECOMPUTED = {"z2": ["parallel.zero=2"], "z3": ["parallel.zero=3"], "ddp": DDP}
RECOMPUTE_STEPS = 8


@pytest.mark.parametrize("name", sorted(RECOMPUTED))
def test_full_recompute_changes_no_loss_and_no_gradient_norm(zero_runs, name):
    """HF gradient checkpointing under ZeRO-2, ZeRO-3 (parameters gathered again for the recompute) and
    DDP: the same losses and gradient norms as the run that keeps its activations, within 1e-6."""
    run, ref = zero_runs[f"recompute_{name}"], zero_runs[name][:RECOMPUTE_STEPS]
    assert len(run) == RECOMPUTE_STEPS
    assert_close_rel(losses(run), losses(ref), 1e-6)
    assert_close_rel([r["grad_norm"] for r in run], [r["grad_norm"] for r in ref], 1e-6)


RULES_ON = [
    "stop.loss_spike.zscore=6", "stop.loss_spike.window=10", "stop.loss_spike.patience=2",
    "stop.min_tokens_per_s.value=10", "stop.min_tokens_per_s.window=3", "stop.max_time_s=3600",
]  # fmt: skip
OFFLOAD = {
    "zero2-offload-opt": ["parallel.zero=2", "parallel.offload_optimizer=true"],
    "zero3-offload-opt-params": [
        "parallel.zero=3",
        "parallel.offload_optimizer=true",
        "parallel.offload_params=true",
    ],
}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_held_match_the_plan(zero_runs, zero):
    """Parameter, gradient and optimizer bytes each rank holds vs plan.estimate, within 5 %; DeepSpeed
    keeps an fp32 master partition and partitions gradients from stage 1 on (engines/held.py)."""
    want = assert_model_states_match_plan(zero_runs["_base"] / f"z{zero}")
    psi4 = 4 * 139_584  # tiny Llama, fp32
    total = {0: 4 * psi4, 1: 3 * psi4, 2: 3 * psi4, 3: 3.5 * psi4}[zero]  # 16Ψ, 4Ψ+16Ψ/N, ..., at N = 2
    assert sum(want.values()) == total


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_bytes_match_the_plan(zero_runs, zero):
    """comm.jsonl against plan.comm_estimate: ZeRO 0-3 at dp 2 within 2 % per op (DeepSpeed on gloo: an
    all-reduce of the gradients per step / per micro-batch for 0-2, all-gathers + reduce-scatter for 3)."""
    pred = assert_comm_matches_plan(zero_runs["_base"] / f"z{zero}", "dp", 0.02)
    ops = {k.split(":")[0] for k in pred}
    assert ops == (
        {"all_reduce"}
        if zero == 0
        else {"all_reduce", "all_gather"}
        if zero < 3
        else {"all_gather", "reduce_scatter"}
    )


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_match_single_rank(zero_runs, zero):
    ref = losses(zero_runs["ref"])
    assert len(ref) == STEPS and ref[-1] < ref[0]  # it trains
    assert_close_rel(losses(zero_runs[f"z{zero}"]), ref, 1e-5)
    # the same tokens went through every layout
    assert [r["tokens"] for r in zero_runs[f"z{zero}"]] == [r["tokens"] for r in zero_runs["ref"]]


def test_grad_norm_lr_and_eval_loss_agree(zero_runs):
    ref = zero_runs["ref"]
    for name in ("z0", "z1", "z2", "z3", "ddp"):
        assert_close_rel([r["grad_norm"] for r in zero_runs[name]], [r["grad_norm"] for r in ref], 1e-4)
        assert [r["lr"] for r in zero_runs[name]] == [r["lr"] for r in ref]
        # the held-out split, evaluated after the last step only (eval_every 50 > the steps run)
        evals = [r["step"] for r in zero_runs[name] if r.get("eval_loss") is not None]
        assert evals == [len(ref)]
        assert abs(zero_runs[name][-1]["eval_loss"] - ref[-1]["eval_loss"]) <= 1e-5 * ref[-1]["eval_loss"]


# ---- engine ddp: the naive baseline ---------------------------------------------------------------------


def test_ddp_matches_single_rank_and_zero0(zero_runs):
    """torch DDP over full replicas, 2 ranks: the 1-rank reference and DeepSpeed without ZeRO, step by step."""
    ddp = zero_runs["ddp"]
    assert len(ddp) == STEPS
    assert_close_rel(losses(ddp), losses(zero_runs["ref"]), 1e-5)
    assert_close_rel(losses(ddp), losses(zero_runs["z0"]), 1e-5)
    assert [r["tokens"] for r in ddp] == [r["tokens"] for r in zero_runs["ref"]]
    manifest = RunDir(zero_runs["_base"] / "ddp").read_manifest()
    assert manifest["layout"]["engine"] == "ddp" and manifest["layout"]["zero_impl"] == "ddp"


def test_ddp_bytes_and_model_states_match_the_plan(zero_runs):
    """One all-reduce of all fp32 gradients per step (4Ψ bytes, in DDP's buckets, seen through the comm
    hook) within 2 %; a full replica's params / grads / Adam moments = 4Ψ / 4Ψ / 8Ψ within 5 %."""
    run = zero_runs["_base"] / "ddp"
    pred = assert_comm_matches_plan(run, "dp", 0.02)
    psi4 = 4 * 139_584
    assert pred == {"all_reduce:dp": psi4}
    want = assert_model_states_match_plan(run)
    assert want == {"params": psi4, "grads": psi4, "optimizer": 2 * psi4}
    # the message count: DDP's buckets (1 MiB first, then 25 MiB) as the planner fills them, from step 2 on
    import yaml

    from tessera.config.loader import validate_recipe
    from tessera.models.hf import load_hf_config
    from tessera.plan.comm_estimate import comm_per_step
    from tessera.plan.facts import model_facts
    from tessera.plan.layout import layout_from_recipe

    recipe = validate_recipe(yaml.safe_load(RunDir(run).recipe.read_text()))
    facts = model_facts(load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size))
    ops = comm_per_step(
        facts, layout_from_recipe(recipe), seq_len=recipe.data.seq_len, precision="fp32", backend="gloo"
    )
    messages = next(o.messages for o in ops if (o.op, o.group) == ("all_reduce", "dp"))
    for rec in RunDir(run).read_comm():
        if rec["phase"] == "step" and rec["step"] >= 2:
            grads = [o for o in rec["ops"] if (o["op"], o["dtype"]) == ("all_reduce", "float32")]
            assert [o["count"] for o in grads] == [messages], (rec["step"], rec["rank"], grads)


# ---- resume ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_resume_is_bit_exact(zero_runs, name):
    resumed, full = zero_runs[f"resume_{name}"], zero_runs[name]
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert losses(resumed)[10:] == losses(full)[10:]  # bit-identical, not approximately equal
    assert [r["grad_norm"] for r in resumed][10:] == [r["grad_norm"] for r in full][10:]
    manifest = RunDir(zero_runs["_base"] / f"resume_{name}").read_manifest()
    assert manifest["resumed_from"].endswith(step_dir_name(10))


@pytest.mark.parametrize("name", ["z2", "ddp"])
def test_checkpoint_is_self_describing(zero_runs, name):
    """meta.json v2: format, engine and its sharding, the full layout, precision, the HF config, the
    tokenizer hash, the layout-free sampler position, and the sha256 and size of every file."""
    run = RunDir(zero_runs["_base"] / f"resume_{name}")
    ckpt = run.checkpoints / step_dir_name(STEPS)
    meta = read_meta(ckpt)
    manifest = run.read_manifest()
    assert meta["format_version"] == 2 and meta["step"] == STEPS
    assert meta["engine"] == manifest["layout"]["engine"] and meta["layout"] == manifest["layout"]
    assert meta["sharding"] == {"z2": "deepspeed-zero2", "ddp": "torch-ddp"}[name]
    assert {"dp", "tp", "pp", "vpp", "ep", "etp", "zero", "zero_impl"} <= set(meta["layout"])
    assert meta["precision"] == "fp32" and meta["model_config"]["model_type"] == "llama"
    assert meta["tokenizer_hash"] == manifest["tokenizer_hash"]
    assert meta["sampler"]["consumed_samples"] == STEPS * 16 and "rank" not in meta["sampler"]
    assert {f["path"] for f in meta["files"]} == set(checkpoint_files(ckpt))
    assert all(len(f["blake3"]) == 64 and "sha256" not in f for f in meta["files"])


@pytest.mark.parametrize("name", ["z2", "ddp"])
def test_damaged_checkpoint_is_refused_naming_the_file(zero_runs, tmp_path, name):
    """Every file of the checkpoint, one at a time: a flipped byte (same size), a truncation and a
    deletion are refused naming the file; and `tessera run --resume` exits 2 with that name before
    anything launches."""
    assert_damage_is_refused(zero_runs["_base"] / f"resume_{name}", tmp_path)


def test_a_pickle_in_place_of_the_rng_file_is_never_run(zero_runs):
    """Ranks resuming from a checkpoint whose RNG file is a pickle (checksum forged to match) exit 2
    naming the file, and the pickle's payload never runs."""
    evil = RunDir(zero_runs["_base"] / "pickle_z2")
    assert not (evil.path / PICKLE_MARKER).exists()
    log = evil.rank_file(0, "log").read_text()
    assert "not a readable safetensors file" in log and "rng_rank00000.safetensors" in log
    assert evil.rank_exit(0) == ExitCode.USER_ERROR and evil.rank_exit(1) == ExitCode.USER_ERROR


@pytest.mark.parametrize("name", ["z2", "z3"])
def test_no_code_runs_from_a_forged_deepspeed_checkpoint(zero_runs, tmp_path, capsys, name):
    """Each kind of .pt of a ZeRO-2 / ZeRO-3 checkpoint (model states, optimizer states) replaced by a
    payload pickle (plain, and a torch.save zip) with its checksum forged: `tessera verify`, `tessera
    convert` and `tessera run --resume` exit 2 naming the file and the class, no traceback, no rank
    started, no marker file; an unlisted FIFO named like a shard is refused at once (no hang)."""
    run = zero_runs["_base"] / f"resume_{name}"
    assert_no_code_runs(run, tmp_path, capsys, ("model_states.pt", "optim_states.pt"))
    assert_fifo_is_refused(run, tmp_path, capsys)


@pytest.mark.parametrize("name", ["z1", "z2", "z3", "bf16"])
def test_zero_partitions_read_one_parameter_at_a_time_equal_deepspeeds_merge(zero_runs, name):
    """The ZeRO reader's per-parameter reads (`ZeroTensors`: each parameter's elements read from the
    partition files by hand) give exactly what DeepSpeed's zero_to_fp32 merge gives, for the weights
    (buffers and tied names included) and both Adam moments, ZeRO 1, 2 and 3 and a bf16 run, after their
    trained steps; each read is a fresh tensor (nothing kept between reads), and a range of rows read alone
    (`part`, the verification's row blocks) is those rows of it."""
    import torch

    from tessera.engines.zero_lazy import ZeroTensors
    from tessera.engines.zero_reader import zero_merge

    ckpt = sorted((zero_runs["_base"] / name / "checkpoints").glob("step_*"))[-1]
    zero = 2 if name == "bf16" else int(name[1])
    for kind in (None, "exp_avg", "exp_avg_sq"):
        lazy, whole = ZeroTensors(ckpt, zero, kind), zero_merge(ckpt, zero, kind)
        assert lazy.plan is not None and set(lazy) == set(whole)
        for k, want in whole.items():
            got = lazy[k]
            assert got.dtype == torch.float32 and torch.equal(got, want), (name, kind, k)
            assert lazy[k] is not got  # read afresh each time: nothing kept between reads
            assert lazy.shape_of(k) == tuple(want.shape)
            assert not want.dim() or torch.equal(lazy.part(k, (slice(1, 3),)), want[1:3])  # rows read alone
        assert any(bool(t.abs().sum()) for t in whole.values())  # trained values, not zeros


#: what only an engine that has stepped changes in its files: its counters, and the LR its schedule set
STEPPED = ("global_steps", "global_samples", "lr")


def _differences(a, b, path: str = "") -> list[str]:
    """Where two loaded pickles differ: keys (and their order), types, values, each tensor's dtype, shape
    and bits; an object by its attributes. ``STEPPED`` paths are left out. Not requires_grad: DeepSpeed's
    saved fp32 partitions are slices of its trained flat tensors, requiring grad when the save's grad mode
    made them so (a conversion's save: yes, as the writer writes them; the runs' saves here: no); its load
    copies their values only."""
    last = path.rsplit(".", 1)[-1]
    if last in STEPPED and (last != "lr" or ".param_groups[" in path):
        return []
    if torch.is_tensor(a) and torch.is_tensor(b):
        same = (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b)
        return [] if same else [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, dict):
        head = [] if list(a) == list(b) else [f"{path}: keys {list(a)} vs {list(b)}"]
        return head + [d for k in a if k in b for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        head = [] if len(a) == len(b) else [f"{path}: {len(a)} items vs {len(b)}"]
        return head + [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return _differences(vars(a), vars(b), path)
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


@pytest.mark.parametrize("name", ["z1", "z2", "bf16", "family_gpt2", "family_mixtral"])
def test_the_conversion_writer_writes_the_files_deepspeeds_engine_wrote(zero_runs, tmp_path, name):
    """The ZeRO 1-2 conversion writer (`engines/zero_writer.py`: DeepSpeed's files made without its engine,
    each tensor's bytes made as torch's writer reaches its record), given a trained checkpoint's weights,
    fp32 masters, Adam moments and step, writes each rank's files as DeepSpeed's engine wrote them: the
    same keys in the same order, the same values, every tensor bit for bit (module, partitions, moments),
    except what only a stepping engine changes; also GPT-2 (its LM head tied to the embedding) and Mixtral
    (experts). `writer_for` takes these layouts and declines ZeRO-3."""
    from tessera.config.loader import load_run_recipe
    from tessera.engines.deepspeed_engine import PARAM_DTYPE
    from tessera.engines.ds_config import build_ds_config
    from tessera.engines.optim import MOMENTS, build_optimizer
    from tessera.engines.zero_lazy import ZeroTensors
    from tessera.engines.zero_reader import READER
    from tessera.engines.zero_writer import ZeroWriter, save_filled, writer_for, zero_files
    from tessera.models.hf import empty_model, hf_config_of
    from tessera.plan.layout import layout_from_recipe
    from tessera.safeload import safe_torch_load
    from tessera.writes import write_hashed

    run = RunDir(zero_runs["_base"] / name)
    ckpt = sorted(run.checkpoints.glob("step_*"))[-1]
    meta, recipe = read_meta(ckpt), load_run_recipe(run)
    layout = layout_from_recipe(recipe)
    assert writer_for(recipe, layout) is ZeroWriter
    assert writer_for(load_run_recipe(RunDir(zero_runs["_base"] / "z3")), layout_from_recipe(
        load_run_recipe(RunDir(zero_runs["_base"] / "z3")))) is None  # fmt: skip
    dtype = PARAM_DTYPE[recipe.train.precision]
    model = empty_model(hf_config_of(meta), dtype=dtype, device="meta")
    masters = ZeroTensors(ckpt, layout.zero, None)
    moments = {k: ZeroTensors(ckpt, layout.zero, k) for k in MOMENTS}
    config = build_ds_config(recipe, layout, device="cpu")
    optimizer = build_optimizer(recipe, model.named_parameters(), device="cpu", offload=False)
    written = []
    for rank in range(layout.dp):
        files = zero_files(
            model, optimizer, config, zero=layout.zero, dp=layout.dp, rank=rank, dtype=dtype,
            weights=masters, masters=masters, moments=moments, step=READER.adam_step(ckpt, meta),
        )  # fmt: skip
        for file, obj, fills in files:
            write_hashed(tmp_path / file, lambda f, obj=obj, fills=fills: save_filled(obj, fills, f))
            written.append(file)
    assert sorted(written) == sorted(p.name for p in ckpt.glob("*.pt"))
    for file in written:
        mine, engine = safe_torch_load(tmp_path / file), safe_torch_load(ckpt / file)
        assert not _differences(mine, engine, file), _differences(mine, engine, file)[:8]
    assert name != "bf16" or "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in written


@pytest.mark.parametrize("name", ["z3", "ddp"])
def test_export_to_hf_reproduces_the_run(zero_runs, tmp_path, name):
    """`tessera convert --to hf` of the step-10 checkpoint (ZeRO-3 partitions through DeepSpeed's
    zero_to_fp32; the ddp engine's safetensors): from_pretrained loads it, and its loss on step 11's batch
    is the loss the run logged for step 11; its special-token ids are the run's tokenizer's, and `tessera
    verify` fails a copy whose config.json says otherwise."""
    run = zero_runs["_base"] / f"resume_{name}"
    report = assert_hf_export_replays_the_run(run, 10, tmp_path / "hf", tamper=name == "ddp")
    assert report["sharding"] == {"z3": "deepspeed-zero3", "ddp": "torch-ddp"}[name]


def test_verify_names_the_one_tensor_that_differs(zero_runs, tmp_path, capsys):
    """`tessera verify` of a ddp checkpoint against a copy with one weight changed by one ulp-sized step
    (checksums re-forged so it loads): exit 1, the tensor named, the Adam moments still equal; against an
    untouched copy: exit 0, logits within 1e-5."""
    from tessera.cli import main
    from tessera.engines.ddp import MODEL_FILE
    from tessera.tensorfile import load_tensors_and_meta, save_tensors

    src = RunDir(zero_runs["_base"] / "resume_ddp").checkpoints / step_dir_name(10)
    same, changed = tmp_path / "same", tmp_path / "changed"
    shutil.copytree(src, same)
    shutil.copytree(src, changed)
    tensors, meta = load_tensors_and_meta(changed / MODEL_FILE)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] = torch.nextafter(tensors[name][3, 5], torch.tensor(1e9))
    save_tensors(changed / MODEL_FILE, tensors, meta)
    forge_checksum(changed, MODEL_FILE)
    assert main(["verify", str(src), str(same), "--prompts", "2", "--json"]) == 0
    ok = json.loads(capsys.readouterr().out)
    assert ok["weights_ok"] and ok["optimizer"]["ok"] and ok["logits"]["max_abs_diff"] <= 1e-5
    assert main(["verify", str(src), str(changed), "--prompts", "2", "--json"]) == 1
    bad = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in bad["tensors"] if not r["equal"]] == [name]
    assert bad["optimizer"]["ok"] and not bad["ok"]


# ---- stop rules -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["z0", "z2", "ddp"])
def test_nan_grad_norm_stops_the_run_and_keeps_a_finite_checkpoint(zero_runs, name):
    assert_nan_stop(zero_runs["_base"] / f"nan_{name}", zero_runs[f"nan_{name}"], zero_runs["ref"])


def test_non_finite_state_is_never_saved(zero_runs):
    run = RunDir(zero_runs["_base"] / "nanstate_z2")
    assert [r["step"] for r in zero_runs["nanstate_z2"]] == [1, 2]  # step 2 trained finely; its state did not
    assert (run.checkpoints / LATEST).read_text().strip() == step_dir_name(1)
    assert not (run.checkpoints / step_dir_name(2)).exists()
    assert "non-finite model or optimizer state" in run.rank_file(0, "log").read_text()
    assert_all_finite(run.checkpoints / step_dir_name(1))


# ---- more layouts and families --------------------------------------------------------------------------


def _uneven_jsonl(path):
    """Documents of very different lengths (from a stdlib file), so padded rows carry uneven token counts."""
    import inspect
    import json as _json
    import textwrap

    text = inspect.getsource(textwrap)
    docs, pos = [], 0
    for i in range(96):
        n = 40 + (i * 97) % 700
        docs.append(text[pos : pos + n])
        pos = (pos + n) % (len(text) - 800)
    path.write_text("".join(_json.dumps({"text": d}) + "\n" for d in docs))
    return path


def test_grad_accum_is_token_normalised(tmp_path):
    """dp1 x ga2 == dp2 x ga1 at the same global batch, with padded rows of uneven token counts."""
    data_file = _uneven_jsonl(tmp_path / "uneven.jsonl")
    common = [
        "train.steps=6",
        "data.source=files",
        f"data.files=[{data_file}]",
        "data.packing=false",
        "data.seq_len=128",
        f"data.cache_dir={tmp_path / 'cache'}",
        "parallel.micro_batch=2",
        "parallel.global_batch=4",
        "optim.warmup_steps=0",
    ]
    a = train_run(tmp_path / "dp1ga2", [*common, "parallel.zero=2"], world=1)
    b = train_run(tmp_path / "dp2ga1", [*common, "parallel.zero=2"], world=2)
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert_close_rel(losses(a), losses(b), 1e-5)
    # the test means something only if micro-batches really carry different token counts
    from tessera.config.loader import load_recipe
    from tessera.data import StepSampler, prepare_data
    from tessera.plan.layout import layout_from_recipe

    r = load_recipe(DEFAULT_RECIPE, [*common, "run.world_size=1"]).recipe
    data = prepare_data(r.data)
    s = StepSampler.for_layout(len(data), layout_from_recipe(r), rank=0, seed=r.train.seed)
    per_step = [[data.rows.label_tokens(mb) for mb in s.next_step()] for _ in range(6)]
    assert sum(a != b for a, b in per_step) >= 3, per_step


@pytest.mark.parametrize("family", ZERO2_FAMILIES)
def test_family_trains_under_zero2(zero_runs, family):
    from tessera.config.loader import load_recipe

    model_type = load_recipe(REPO / FAMILIES[family].tiny_recipe).recipe.model.hf_config["model_type"]
    assert model_type in FAMILIES[family].model_types
    ls = losses(zero_runs[f"family_{family}"])
    assert len(ls) == 5 and ls[-1] < ls[0], ls


@pytest.mark.parametrize("name", sorted(OFFLOAD))
def test_offload_matches_the_reference(zero_runs, name):
    assert_close_rel(losses(zero_runs[name]), losses(zero_runs["ref"]), 1e-5)


def test_bf16_trains(zero_runs):
    ls, ref = losses(zero_runs["bf16"]), losses(zero_runs["ref"])[:8]
    assert ls[-1] < ls[0]
    assert_close_rel(ls, ref, 2e-2)  # bf16 compute stays near the fp32 curve


def test_manifest_diff_of_two_zero_stages(zero_runs, capsys):
    """`tessera manifest diff` of two runs that differ only in parallel.zero: exactly that, its layout
    field and the recipe hash, all under config; a run against its own checkpoint's copy: nothing."""
    from tessera.cli import main

    base = zero_runs["_base"]
    assert main(["manifest", "diff", str(base / "z1"), str(base / "z2"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {"config"}
    assert {r["key"] for r in got["config"]} == {"recipe.parallel.zero", "layout.zero", "recipe_hash"}
    zero = {r["key"]: (r["a"], r["b"]) for r in got["config"]}
    assert zero["recipe.parallel.zero"] == zero["layout.zero"] == (1, 2)
    ckpt = RunDir(base / "resume_z2").checkpoints / step_dir_name(20)
    assert main(["manifest", "diff", str(base / "resume_z2"), str(ckpt / "manifest.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {}


# ---- stop rules and preemption (issue 11) -------------------------------------------------------------


def _stopped(run_dir) -> dict:
    return RunDir(run_dir).read_summary()["stopped"]


def test_stop_rules_do_not_fire_on_the_clean_run_nor_change_it(zero_runs):
    """Every rule armed: the run completes, bit-identical to the run without them."""
    assert [r["loss"] for r in zero_runs["rules_clean"]] == [r["loss"] for r in zero_runs["z2"]]
    assert all("stopped" not in r for r in zero_runs["rules_clean"])
    assert RunDir(zero_runs["_base"] / "rules_clean").read_summary()["stopped"] is None


@pytest.mark.parametrize(
    ("name", "rule", "code", "step", "words"),
    [
        ("rule_spike", "loss_spike", ExitCode.LOSS_SPIKE, 9, "standard deviations above the mean"),
        ("rule_floor", "throughput_floor", ExitCode.THROUGHPUT_FLOOR, 4, "under stop.min_tokens_per_s"),
        ("rule_time", "time_limit", ExitCode.TIME_LIMIT, 1, "stop.max_time_s=0.001 s reached at step 1"),
    ],
)
def test_each_stop_rule_fires_on_its_cause(zero_runs, name, rule, code, step, words):
    """The rule's own exit code, a one-line diagnosis in the summary, the manifest, metrics and the
    record of the step; the last good checkpoint kept (the time limit saves its step first)."""
    base = zero_runs["_base"] / name
    last = zero_runs[name][-1]
    assert last["step"] == step and last["stopped"]["rule"] == rule and last["stopped"]["exit_code"] == code
    stopped = _stopped(base)
    assert stopped["exit_code"] == code and words in stopped["diagnosis"] and "\n" not in stopped["diagnosis"]
    assert RunDir(base).read_manifest()["stopped"] == stopped
    latest = CheckpointManager(RunDir(base).checkpoints, keep=2, rank=0, world_size=2).latest()
    assert (
        (latest is not None and latest.name == step_dir_name(1)) if rule == "time_limit" else latest is None
    )


def test_preemption_checkpoints_the_step_and_resumes_bit_exactly(zero_runs):
    """A preemption request at step 4 (what SIGTERM to tessera run writes): every rank stops after step
    4 with a checkpoint of it and exit code PREEMPTED; --resume finishes identical to the uninterrupted run."""
    base = zero_runs["_base"] / "preempt_z2"
    meta = RunDir(base).read_manifest()
    assert [r["step"] for r in zero_runs["preempt_z2"]] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in zero_runs["preempt_z2"]] == [r["loss"] for r in zero_runs["z2"]]
    assert [r["grad_norm"] for r in zero_runs["preempt_z2"]] == [r["grad_norm"] for r in zero_runs["z2"]]
    assert [x["from"] for x in meta["restarts"]] == [step_dir_name(4)]
    assert (RunDir(base).checkpoints / step_dir_name(4)).is_dir()


def test_a_slow_rank_is_named_a_straggler(zero_runs):
    """Rank 1's forward passes made 6x slower: its compute time (step time minus collectives) is in every
    line, and once a window of 3 steps exists it is named in the line (metrics, W&B) and warned about."""
    recs = zero_runs["straggler_z2"]
    for r in recs:
        c0, c1 = r["compute_time_s_per_rank"]
        assert c1 > 1.5 * c0
    named = [r["straggler"] for r in recs if "straggler" in r]
    assert [r["step"] for r in recs if "straggler" in r] == list(range(3, 9))
    assert all(n["rank"] == 1 and n["ratio"] > 1.2 for n in named)  # stop.straggler_ratio
