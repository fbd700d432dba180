"""LoRA / DoRA under every layout (issue 34), real gloo ranks, fp32, a tiny pretrained Llama and Mixtral.

One fixture: LoRA r=8 on the seven projections under ddp, ZeRO-2, ZeRO-3, megatron TP2 (sequence parallel)
and PP2, DoRA (with the LM head as a module to save) under ddp and ZeRO-3, LoRA on Mixtral's seven
projections (the experts' fused tensors: one adapter per expert) under ddp, ZeRO-3 and megatron EP2; 10
steps with checkpoints at 5 and 10; then, in new rank processes, a same-layout resume and resumes at other
layouts and engines from step 5.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from helpers import (
    REPO,
    assert_comm_matches_plan,
    assert_model_states_match_plan,
    hf_loss_on_step,
    losses,
    relayout,
    save_pretrained_tiny,
    train_runs,
)

from tessera.checkpoint.index import step_dir_name
from tessera.rundir import RunDir

pytestmark = pytest.mark.slow

R = REPO / "recipes"
LLAMA = R / "tiny-llama-cpu.yaml"
MIXTRAL = R / "tiny-mixtral-cpu.yaml"
SEVEN = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
LORA = ["peft.method=lora", "peft.r=8", "peft.alpha=16", f"peft.target_modules={SEVEN}"]
DORA = ["peft.method=dora", "peft.r=8", "peft.alpha=16", f"peft.target_modules={SEVEN}",
        "peft.modules_to_save=[lm_head]"]  # fmt: skip
DDP = ["parallel.engine=ddp", "parallel.zero=0"]
Z2 = ["parallel.engine=deepspeed", "parallel.zero=2"]
Z3 = ["parallel.engine=deepspeed", "parallel.zero=3"]
TP2 = ["parallel.engine=megatron", "parallel.tp=2", "parallel.zero=0"]  # sequence parallel: auto (on)
PP2 = ["parallel.engine=megatron", "parallel.pp=2", "parallel.zero=0"]
EP2 = ["parallel.engine=megatron", "parallel.ep=2", "parallel.zero=1"]
# name -> (recipe, overrides): the model is the recipe's family, pretrained (seed 7)
RUNS = {
    "lora_ddp": (LLAMA, [*LORA, *DDP]),
    "lora_z2": (LLAMA, [*LORA, *Z2]),
    "lora_z3": (LLAMA, [*LORA, *Z3]),
    "lora_tp2": (LLAMA, [*LORA, *TP2]),
    "lora_pp2": (LLAMA, [*LORA, *PP2]),
    "lora_tp2_bf16": (LLAMA, [*LORA, *TP2, "train.precision=bf16"]),  # the planner's bf16 accounting
    "dora_ddp": (LLAMA, [*DORA, *DDP]),
    "dora_z3": (LLAMA, [*DORA, *Z3]),
    "mixtral_ddp": (MIXTRAL, [*LORA, *DDP]),
    "mixtral_z3": (MIXTRAL, [*LORA, *Z3]),
    "mixtral_ep2": (MIXTRAL, [*LORA, *EP2]),
}
# name -> (source run, the new layout's overrides): resumed from the source's step 5 (2 ranks)
RESUMES = {
    "lora_z2_again": ("lora_z2", []),
    "lora_z3_to_ddp": ("lora_z3", DDP),
    "dora_ddp_to_z3": ("dora_ddp", Z3),
    "lora_tp2_to_z2": ("lora_tp2", [*Z2, "parallel.tp=1"]),
    "lora_tp2_to_tp1": ("lora_tp2", ["parallel.tp=1"]),  # TP1 x DP2: megatron reshards on load
}
COMMON = ["train.steps=10", "checkpoint.every=5", "checkpoint.keep=3", "data.eval.max_samples=32",
          "optim.lr=1e-2", "optim.warmup_steps=0"]  # fmt: skip


def _pretrained(hf) -> list[str]:
    return ["model.hf_config=null", f"model.path={hf}", "model.pretrained=true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    hf = {r: save_pretrained_tiny(base / f"hf_{r.stem}", r) for r in (LLAMA, MIXTRAL)}
    got = train_runs(
        {base / k: (rec, [*_pretrained(hf[rec]), *COMMON, *ov], False) for k, (rec, ov) in RUNS.items()},
        world=2,
    )
    for name, (src, ov) in RESUMES.items():
        relayout(base / src, base / name, ov, at_step=5)
    got |= train_runs({base / k: (None, [], True) for k in RESUMES}, world=2)
    return {"_base": base, "_hf": hf, **{d.name: rec for d, rec in got.items()}}


def _cli(*args: str) -> tuple[int, str]:
    from tessera.cli import main

    with contextlib.redirect_stdout(io.StringIO()) as o, contextlib.redirect_stderr(io.StringIO()) as e:
        code = main(list(args))
    return code, o.getvalue() + e.getvalue()


@pytest.mark.parametrize(
    ("ref", "other"),
    [("lora_ddp", "lora_z2"), ("lora_ddp", "lora_z3"), ("lora_ddp", "lora_tp2"), ("lora_ddp", "lora_pp2"),
     ("dora_ddp", "dora_z3"), ("mixtral_ddp", "mixtral_z3"), ("mixtral_ddp", "mixtral_ep2")],
)  # fmt: skip
def test_every_layout_trains_the_same_adapters(runs, ref, other):
    """Steps 1-10: losses within 1e-6, grad norms within 1e-5 (the adapters' own; the base has none)."""
    a, b = runs[ref], runs[other]
    assert [r["step"] for r in b] == list(range(1, 11))
    assert max(abs(x - y) for x, y in zip(losses(a), losses(b))) <= 1e-6
    assert max(abs(x["grad_norm"] - y["grad_norm"]) for x, y in zip(a, b)) <= 1e-5
    assert losses(a)[-1] < losses(a)[0] - 0.05  # the adapters learn (lr 1e-2)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_frozen_base_is_bit_identical_after_training(runs, name):
    """Every rank compared the base it holds after 10 steps with the pretrained files, bit for bit: each
    tensor once over the replicas, every ZeRO-3 partition."""
    summary = RunDir(runs["_base"] / name).read_summary()
    frozen = summary["frozen_base"]
    assert frozen["unchanged"] and not frozen["differ"]
    # 21 tensors (2 layers x 9, embedding, final norm, head; Mixtral's 9 with router and fused experts);
    # ZeRO-3: each rank its partition of every one (42); TP2: the 16 split ones once per rank (the fused
    # QKV / fc1 give one piece per q, k, v, gate, up: 2 x 14 + 4 for the vocabulary) and the 5 norms once
    # (37); EP2: each rank its 2 experts' pieces (gate, up, down: 2 x 2 x 6 = 24) and 17 others once (41)
    want = {"lora_z3": 42, "dora_z3": 42, "mixtral_z3": 42, "lora_tp2": 37, "lora_tp2_bf16": 37, "mixtral_ep2": 41}
    assert frozen["tensors_checked"] == want.get(name, 21)


def test_checkpoints_hold_the_adapters_and_name_their_base(runs):
    """A checkpoint keeps what trains, by canonical name (28 LoRA tensors; DoRA adds 14 magnitudes and the
    LM head's copy), and the base as path + sha256; no frozen weight is written."""
    from tessera.checkpoint.reader import read_hf_moment, read_hf_state
    from tessera.engines.ddp import MODEL_FILE
    from tessera.evidence.manifest import files_digest
    from tessera.tensorfile import load_tensors

    base, hf = runs["_base"], runs["_hf"][LLAMA]
    ckpt = RunDir(base / "lora_ddp").checkpoints / step_dir_name(10)
    saved = load_tensors(ckpt / MODEL_FILE)
    assert len(saved) == 28 and all(".lora_A." in n or ".lora_B." in n for n in saved)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["peft"]["r"] == 8 and meta["peft"]["method"] == "lora"
    assert meta["base"] == {"from": "files", "path": str(hf), "sha256": files_digest(sorted(hf.glob("*.safetensors")))}
    for name, trained in (("lora_z3", 28), ("dora_z3", 28 + 14 + 1)):
        ckpt = RunDir(base / name).checkpoints / step_dir_name(10)
        state, meta = read_hf_state(ckpt)
        moments = read_hf_moment(ckpt, meta, "exp_avg")
        assert len(moments) == trained and len(state) == 21 + trained
        assert sum(p.stat().st_size for p in ckpt.glob("*model_states.pt")) < 0.5 * sum(
            p.stat().st_size for p in hf.glob("*.safetensors")
        )


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_a_resume_continues_the_run_with_its_adapters_and_moments(runs, name):
    """At the same layout bit-exact; at another engine / stage / TP degree the next step within 1e-6, the
    resharded checkpoint verified (adapters and their Adam moments bit-exact, logits within 1e-5)."""
    src = RESUMES[name][0]
    assert [r["step"] for r in runs[name]] == list(range(1, 11))  # the copied history, then steps 6-10
    a, b = losses(runs[src]), losses(runs[name])[5:]
    if not RESUMES[name][1]:
        assert b == a[5:]
        return
    assert abs(a[5] - b[0]) <= 1e-6 * abs(a[5]) and max(abs(x - y) for x, y in zip(a[5:], b)) <= 1e-5
    rec = RunDir(runs["_base"] / name).read_manifest()["resharded"]
    v = rec["verify"]
    assert v["ok"] and v["moments_equal"] and v["logits_max_abs_diff"] <= 1e-5
    assert int(v["tensors_equal"].split("/")[0]) == int(v["tensors_equal"].split("/")[1]) > 21


@pytest.mark.parametrize("name", ["lora_z3", "dora_z3", "lora_tp2", "mixtral_ep2"])
def test_the_peft_export_loads_with_peft_and_replays_the_run(runs, name, tmp_path):
    """``tessera convert --to peft``: ``PeftModel.from_pretrained`` on the original base gives the run's
    own loss of the next step (so the adapters, and the base they were trained on, are the run's); the
    merged export (``--to hf --merge``) loads with ``from_pretrained`` alone and gives it too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, hf = runs["_base"] / name, runs["_hf"][MIXTRAL if name.startswith("mixtral") else LLAMA]
    ckpt = RunDir(run).checkpoints / step_dir_name(5)
    logged = next(r["loss"] for r in RunDir(run).read_metrics() if r["step"] == 6)
    code, out = _cli("convert", str(ckpt), "--to", "peft", "--out", str(tmp_path / "adapter"))
    assert code == 0, out
    rec = json.loads((tmp_path / "adapter" / "tessera_conversion.json").read_text())
    assert rec["verify"]["ok"] and rec["verify"]["logits"]["max_abs_diff"] <= 1e-5
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(hf) and cfg["r"] == 8 and cfg["use_dora"] == name.startswith("dora")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf), tmp_path / "adapter").eval()
    assert abs(hf_loss_on_step(model, run, 6) - logged) <= 1e-6 * logged
    code, out = _cli("convert", str(ckpt), "--to", "hf", "--merge", "--out", str(tmp_path / "merged"))
    assert code == 0, out
    rec = json.loads((tmp_path / "merged" / "tessera_conversion.json").read_text())
    assert rec["verify"]["ok"] and rec["verify"]["logits_vs_adapters"]["max_abs_diff"] <= 1e-5
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert abs(hf_loss_on_step(merged, run, 6) - logged) <= 1e-5 * logged
    # tessera verify: the checkpoint against its exported adapter (the ecosystem's own load)
    code, out = _cli("verify", str(ckpt), str(tmp_path / "adapter"), "--prompts", "2", "--json")
    assert code == 0 and json.loads(out)["ok"], out


def test_model_states_match_the_plan(runs):
    """Parameters (frozen base apart), gradients and optimizer moments each rank held, against the
    planner's prediction within 5 % (ddp's replicas, ZeRO-2, ZeRO-3 with the base partitioned, megatron's
    TP / PP / EP shards, its fp32 gradient buffers under bf16)."""
    for name in (
        "lora_ddp", "lora_z2", "lora_z3", "dora_z3", "lora_tp2", "lora_tp2_bf16", "lora_pp2", "mixtral_z3",
        "mixtral_ep2",
    ):  # fmt: skip
        want = assert_model_states_match_plan(runs["_base"] / name)
        assert 0 < want["grads"] < want["frozen"] <= want["params"]


@pytest.mark.parametrize(
    ("name", "group"),
    [("lora_ddp", "dp"), ("lora_z2", "dp"), ("lora_z3", "dp"), ("lora_tp2", "tp"), ("lora_tp2_bf16", "tp"),
     ("lora_pp2", "pp")],
)  # fmt: skip
def test_collectives_match_the_plan(runs, name, group):
    """The bytes each rank moved at step 2, op by op, against the plan within 2 %: the adapters' gradients
    only over dp (ZeRO-3 still gathers the base), and on megatron TP the frozen base's collectives (no
    backward into the first layer's attention, no weight-gradient re-gathers) with the adapters' own."""
    assert_comm_matches_plan(runs["_base"] / name, group, 0.02)


def test_bad_exports_exit_2_naming_the_field(runs, tmp_path):
    """--to peft of a run that trained every weight, --to hf of adapters without --merge, --merge of a
    full run: exit 2, nothing written."""
    base = runs["_base"]
    lora = RunDir(base / "lora_ddp").checkpoints / step_dir_name(10)
    code, out = _cli("convert", str(lora), "--to", "hf", "--out", str(tmp_path / "a"))
    assert code == 2 and "--to = 'hf'" in out and "--merge" in out and not (tmp_path / "a").exists()
    code, out = _cli("convert", str(lora), "--to", "ddp", "--merge", "--out", str(tmp_path / "b"))
    assert code == 2 and "--merge" in out
    stripped = RunDir(base / "lora_ddp").checkpoints / step_dir_name(5)
    meta = json.loads((stripped / "meta.json").read_text())
    assert meta["peft"] is not None  # a full run's checkpoint: the same files without the peft record
    full = tmp_path / "full"
    import shutil

    shutil.copytree(stripped, full)
    meta["peft"] = None
    (full / "meta.json").write_text(json.dumps(meta))  # meta.json lists the files' hashes, not its own
    code, out = _cli("convert", str(full), "--to", "peft", "--out", str(tmp_path / "c"))
    assert code == 2 and "--to = 'peft'" in out and "no adapters" in out and not (tmp_path / "c").exists()


def test_compare_judges_a_lora_candidate_against_ddp_with_the_same_adapters(runs, tmp_path):
    """``tessera compare --runs``: ZeRO-3 LoRA against the ddp LoRA baseline passes its loss band; a
    baseline with other adapters is refused as other work."""
    base = runs["_base"]
    acc = tmp_path / "acc.yaml"
    acc.write_text("loss_tolerance: {abs: 1.0e-5}\ngrad_norm_tolerance: {abs: 1.0e-4}\nwarmup_steps: 0\n")
    code, out = _cli("compare", "--runs", str(base / "lora_z3"), str(base / "lora_ddp"), "--acceptance",
                     str(acc), "--out", str(tmp_path / "cmp"))  # fmt: skip
    verdict = json.loads((tmp_path / "cmp" / "verdict.json").read_text())
    assert code == 0 and verdict["verdict"] == "PASS", out
    code, out = _cli("compare", "--runs", str(base / "dora_z3"), str(base / "lora_ddp"), "--acceptance",
                     str(acc), "--out", str(tmp_path / "cmp2"))  # fmt: skip
    assert code == 2 and "the adapters" in out
