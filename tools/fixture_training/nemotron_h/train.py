"""The Nemotron-H fixture's train loop: the shared scaffold, its own losses (the backbone has no rotary embedding and
calls its embedding ``embeddings``), auxiliary-loss-free router balancing as GLM's (``e_score_correction_bias``), and
runs in chunks that resume from OUT/resume.pt."""

from __future__ import annotations

import json
import sys
import time

from tools.fixture_training.glm.train import set_threads
from tools.fixture_training.heads import torch_state
from tools.fixture_training.nemotron_h.model import F32_SUFFIXES, build_torch, shape_of
from tools.fixture_training.training import (adamw, apply_gradients, final_norm_gain, finish_run, heldout_evaluator,
                                             is_log_step, learning_rate, log_points, log_record, open_run,
                                             param_count, plan_steps, print_run_header, run_args, save_checkpoint,
                                             step_record, window_sampler)


def losses(lm, head, tokens, router_logits=None, aux_coef=0.0):
    """forward_losses' losses and stats for Nemotron-H: the next token from the backbone's post-``norm_f`` state h_t,
    token t+2 from the head fed (h_t, embedding of token t+1); no balancing term (the routers' biases balance)."""
    import torch
    import torch.nn.functional as F

    h = lm.model(input_ids=tokens).last_hidden_state
    logits = lm.lm_head(h)
    main = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    mtp_logits = lm.lm_head(head(h[:, :-1], lm.model.embeddings(tokens[:, 1:])))[:, :-1]
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), tokens[:, 2:].flatten())
    with torch.no_grad():
        mtp_arg = mtp_logits.argmax(-1)
        stats = {"main_acc": (logits[:, :-1].argmax(-1) == tokens[:, 1:]).float().mean(),
                 "mtp_acc": (mtp_arg == tokens[:, 2:]).float().mean(),
                 "agree": (mtp_arg == logits[:, 1:-1].argmax(-1)).float().mean()}
    return main + mtp, main, mtp, torch.zeros(()), stats


def balance_routers(routers, loads, rate: float):
    """Auxiliary-loss-free balancing after a step: raise the ``e_score_correction_bias`` of each router's
    under-loaded experts (lower the over-loaded ones') by ``rate``, and clear the loads counted over the step.
    Returns the largest max/mean expert load of the step."""
    import torch

    with torch.no_grad():
        imbalance = []
        for r in routers:
            load = loads[id(r)]
            r.e_score_correction_bias += rate * torch.sign(load.mean() - load)
            imbalance.append(load.max() / load.mean().clamp_min(1))
            load.zero_()
        return torch.stack(imbalance).max()


def _resume(path, lm, head, opt, rng, logged_args):
    import torch

    st = torch.load(path, map_location="cpu", weights_only=False)
    if {k: v for k, v in st["args"].items() if k != "chunk_seconds"} != \
            {k: v for k, v in logged_args.items() if k != "chunk_seconds"}:
        raise SystemExit(f"{path} was written with other arguments: {st['args']}")
    lm.load_state_dict(st["lm"]), head.load_state_dict(st["head"]), opt.load_state_dict(st["opt"])
    rng.bit_generator.state = st["rng"]
    torch.set_rng_state(st["torch_rng"])
    print(json.dumps({"resumed": str(path), "step": st["step"], "steps": st["total"]}), flush=True)
    return st["step"], st["total"], st["history"], st["saved"], st["elapsed"]


def train_nemotron(args) -> None:
    import torch
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    set_threads(getattr(args, "threads", None))
    chunk = getattr(args, "chunk_seconds", None)
    out, dev, rng, train_ids, held_ids = open_run(args)
    lm, head, config = build_torch(shape_of(args))
    with torch.no_grad():
        if args.final_norm_spread > 1:
            gain = final_norm_gain(args.final_norm_spread, config.hidden_size, torch.Generator().manual_seed(args.seed + 1))
            lm.model.norm_f.weight.copy_(gain)  # plain RMSNorm gains (x * w)
            head.model.norm_f.weight.copy_(gain)  # the head's final_layernorm feeds the same lm_head
    lm.to(dev).train()
    head.to(dev).train()
    n_params = param_count(lm, head)
    routers = [m for m in list(lm.modules()) + list(head.modules()) if isinstance(m, NemotronHTopkRouter)]
    loads = {id(r): torch.zeros(r.num_experts, device=dev) for r in routers}

    def count(module, _inputs, output):  # (router_logits, topk_weights, topk_indices)
        if module.training:
            loads[id(module)] += torch.bincount(output[2].flatten(), minlength=module.num_experts).float()

    for r in routers:
        r.register_forward_hook(count)
    opt = adamw(lm, head, args, dev)
    batch = window_sampler(train_ids, rng, args.seq, args.batch)
    evaluate = heldout_evaluator(lm, head, held_ids, args, losses=losses)

    def one_step(step, total):
        loss, main, mtp, _, st = losses(lm, head, batch())
        gn = apply_gradients(opt, lm, head, loss, learning_rate(args, step, total), args.clip)
        imbalance = balance_routers(routers, loads, args.bias_rate)
        return loss.detach(), main.detach(), mtp.detach(), st, gn, imbalance

    resume, logged_args, t_call = out / "resume.pt", run_args(args), time.time()
    if resume.exists():
        step, total, history, saved, elapsed = _resume(resume, lm, head, opt, rng, logged_args)
    else:
        history, saved, elapsed = [], [], 0.0
        print_run_header(dev, n_params)
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
            rec = step_record(step, learning_rate(args, step - 1, total), loss, main, mtp, st, gn, time.time() - t0,
                              max_load_ratio=imb)
            log_record(rec, step, args, saves, log_every, evaluate, history)
        if step in saves:
            save_checkpoint(torch_state(lm, head, F32_SUFFIXES), out, step, saved)
    bias = {f"{i}": [round(float(x), 4) for x in r.e_score_correction_bias] for i, r in enumerate(routers)}
    finish_run(out, args, dev, n_params, total, t0, saved, history, e_score_correction_bias=bias)
    if resume.exists():
        resume.unlink()
