"""GLM-5's train loop: the shared scaffold, auxiliary-loss-free router balancing, untrained indexers, and runs in
chunks that resume from OUT/resume.pt."""

from __future__ import annotations

import json
import sys
import time

from tools.fixture_training.glm.model import F32_SUFFIXES, build_torch_glm, shape_of
from tools.fixture_training.heads import forward_losses, torch_state
from tools.fixture_training.training import (adamw, apply_gradients, final_norm_gain, finish_run, heldout_evaluator,
                                             is_log_step, learning_rate, log_points, log_record, open_run,
                                             param_count, plan_steps, print_run_header, run_args, save_checkpoint,
                                             step_record, window_sampler)


def set_threads(n) -> None:
    """torch's CPU threads (1 is several times faster than 2 on a CPU that other processes keep busy)."""
    if n:
        import torch

        torch.set_num_threads(n)


def dense_indexers() -> None:
    """Skip the indexers' work where their answer is known: without a cache and with at most index_topk keys they
    select every key (transformers' top-k of all T scores), so returning 0..T-1 gives the same attention. Training
    only: it saves the indexer's [B, S, heads, T] scores and top-k on every layer; the indexers are not trained
    anyway."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    if getattr(GlmMoeDsaIndexer.forward, "_dense_shortcut", False):
        return
    full = GlmMoeDsaIndexer.forward

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None):
        B, S, _ = hidden_states.shape
        T = attention_mask.shape[-1]
        if cache is None and T <= self.index_topk:
            import torch

            return torch.arange(T, device=hidden_states.device, dtype=torch.int32).expand(B, S, T)
        return full(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=cache)

    forward._dense_shortcut = True
    GlmMoeDsaIndexer.forward = forward


def train_glm(args) -> None:
    import torch
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, GlmMoeDsaTopkRouter

    set_threads(getattr(args, "threads", None))
    dense_indexers()
    bias_rate = getattr(args, "bias_rate", 1e-3)
    chunk = getattr(args, "chunk_seconds", None)
    out, dev, rng, train_ids, held_ids = open_run(args)
    if args.seq > shape_of(args)["index_topk"]:
        raise SystemExit(f"--seq {args.seq} > index_topk: the (untrained) indexer would make attention sparse")
    lm, head, config = build_torch_glm(shape_of(args))
    if getattr(args, "experts_implementation", None):
        lm.set_experts_implementation(args.experts_implementation)  # the head shares lm's config
    with torch.no_grad():
        gen = torch.Generator().manual_seed(args.seed + 1)
        if args.final_norm_spread > 1:
            gain = final_norm_gain(args.final_norm_spread, config.hidden_size, gen)
            lm.model.norm.weight.copy_(gain)  # GLM's norms are x * w
            head.shared_head.norm.weight.copy_(gain)  # feeds the same lm_head
        for mod in list(lm.modules()) + list(head.modules()):
            if isinstance(mod, GlmMoeDsaIndexer):  # never trained: give k_norm non-trivial values
                mod.k_norm.weight.copy_(1 + 0.1 * torch.randn(mod.k_norm.weight.shape, generator=gen))
                mod.k_norm.bias.copy_(0.1 * torch.randn(mod.k_norm.bias.shape, generator=gen))
    lm.to(dev).train()
    head.to(dev).train()
    n_params = param_count(lm, head)

    routers = [m for m in list(lm.modules()) + list(head.modules()) if isinstance(m, GlmMoeDsaTopkRouter)]
    loads = {id(r): torch.zeros(r.num_experts, device=dev) for r in routers}

    def count(module, _inputs, output):  # (router_logits, topk_weights, topk_indices)
        if module.training:
            loads[id(module)] += torch.bincount(output[2].flatten(), minlength=module.num_experts).float()

    for r in routers:
        r.register_forward_hook(count)

    opt = adamw(lm, head, args, dev)
    batch = window_sampler(train_ids, rng, args.seq, args.batch)
    evaluate = heldout_evaluator(lm, head, held_ids, args)

    def one_step(step, total):
        loss, main, mtp, _, st = forward_losses(lm, head, batch())
        gn = apply_gradients(opt, lm, head, loss, learning_rate(args, step, total), args.clip)
        with torch.no_grad():  # auxiliary-loss-free balancing: raise the bias of under-loaded experts
            imbalance = []
            for r in routers:
                load = loads[id(r)]
                r.e_score_correction_bias += bias_rate * torch.sign(load.mean() - load)
                imbalance.append(load.max() / load.mean().clamp_min(1))
                load.zero_()
        return loss.detach(), main.detach(), mtp.detach(), st, gn, torch.stack(imbalance).max()

    resume = out / "resume.pt"
    logged_args = run_args(args)
    t_call = time.time()
    if resume.exists():
        st = torch.load(resume, map_location=dev, weights_only=False)
        if {k: v for k, v in st["args"].items() if k != "chunk_seconds"} != \
                {k: v for k, v in logged_args.items() if k != "chunk_seconds"}:
            raise SystemExit(f"{resume} was written with other arguments: {st['args']}")
        lm.load_state_dict(st["lm"]), head.load_state_dict(st["head"]), opt.load_state_dict(st["opt"])
        rng.bit_generator.state = st["rng"]
        torch.set_rng_state(st["torch_rng"])
        step, total, history, saved, elapsed = st["step"], st["total"], st["history"], st["saved"], st["elapsed"]
        print(json.dumps({"resumed": str(resume), "step": step, "steps": total}), flush=True)
    else:
        history, saved, elapsed = [], [], 0.0
        print_run_header(dev, n_params, experts_implementation=config._experts_implementation)
        step, total = plan_steps(one_step, args, dev, t_call)
    saves, log_every = log_points(args, total)
    t0 = time.time() - elapsed  # the run's clock, over every chunk
    while step < total:
        if chunk and time.time() - t_call > chunk:
            torch.save({"lm": lm.state_dict(), "head": head.state_dict(), "opt": opt.state_dict(),
                        "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(), "step": step,
                        "total": total, "history": history, "saved": saved, "elapsed": time.time() - t0,
                        "args": logged_args}, resume)
            print(json.dumps({"paused": step, "steps": total, "resume": str(resume)}), flush=True)
            sys.exit(3)
        loss, main, mtp, st, gn, imb = one_step(step, total)
        step += 1
        if is_log_step(step, total, saves, log_every):
            rec = step_record(step, learning_rate(args, step - 1, total), loss, main, mtp, st, gn,
                                   time.time() - t0, max_load_ratio=imb)
            log_record(rec, step, args, saves, log_every, evaluate, history)
        if step in saves:
            save_checkpoint(torch_state(lm, head, F32_SUFFIXES), out, step, saved)
    bias = {f"{i}": [round(float(x), 4) for x in r.e_score_correction_bias] for i, r in enumerate(routers)}
    finish_run(out, args, dev, n_params, total, t0, saved, history, e_score_correction_bias=bias)
    if resume.exists():
        resume.unlink()
