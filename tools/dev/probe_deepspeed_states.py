import sys
sys.path.insert(0, "/work/main/tests")
from helpers import run_on_ranks

def probe(zero):
    import torch
    from tessera.config.loader import load_recipe
    from tessera.plan.layout import layout_from_recipe
    from tessera.models.hf import build_model
    from tessera.engines.deepspeed_engine import DeepSpeedEngine
    r = load_recipe("/work/main/recipes/tiny-llama-cpu.yaml", [f"parallel.zero={zero}", "run.device=cpu"]).recipe
    lay = layout_from_recipe(r)
    eng = DeepSpeedEngine(build_model(r.model, seed=1, vocab_size=512), r, lay, device="cpu")
    torch.manual_seed(0)
    mbs = [{"input_ids": torch.randint(0, 512, (4, 64))} for _ in range(lay.grad_accum)]
    for m in mbs: m["labels"] = m["input_ids"].clone()
    grads_seen = {}
    orig_step = eng.engine.step
    def step_hook():
        if eng.engine.is_gradient_accumulation_boundary():
            o = eng.engine.optimizer
            g = sum(p.grad.numel()*4 for p in eng.engine.module.parameters() if p.grad is not None)
            extra = {}
            for name in ("averaged_gradients", "ipg_buffer", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "grads_in_partition", "__param_id_to_grad_partition"):
                v = getattr(o, name, None)
                if v is None: continue
                ts = v.values() if isinstance(v, dict) else v
                flat = []
                for t in ts:
                    if isinstance(t, (list, tuple)): flat += [x for x in t if torch.is_tensor(x)]
                    elif torch.is_tensor(t): flat.append(t)
                extra[name] = sum(t.numel()*t.element_size() for t in flat)
                extra[name+".grad"] = sum(t.grad.numel()*4 for t in flat if getattr(t, "grad", None) is not None)
            grads_seen.update(module_grads=g, **extra)
        return orig_step()
    eng.engine.step = step_hook
    eng.train_step(mbs, 1)
    o = eng.engine.optimizer
    inner = getattr(o, "optimizer", o)
    st = sum(v.numel()*v.element_size() for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    ip = sum(p.numel()*p.element_size() for g in inner.param_groups for p in g["params"])
    mp = sum((p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel())*4 for p in eng.engine.module.parameters())
    return dict(zero=zero, module_params=mp, inner_opt_params=ip, opt_state=st, **grads_seen)

if __name__ == "__main__":
    for z in (0, 1, 2, 3):
        print(run_on_ranks(probe, 2, z)[0], flush=True)
