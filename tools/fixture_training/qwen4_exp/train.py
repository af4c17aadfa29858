"""The qwen4_exp fixture's train loop: the shared scaffold (training.py) around this model's forward (the head reads
the backbone's pre-mixer hyper-connection streams), with a Switch-style router balancing term."""

from __future__ import annotations

import time

from tools.fixture_training.heads import load_balancing
from tools.fixture_training.qwen4_exp.model import build, check_dense_indexer, forward, shape_of
from tools.fixture_training.training import (adamw, apply_gradients, finish_run, is_log_step, learning_rate, log_points,
                                             log_record, open_run, param_count, plan_steps, print_run_header,
                                             save_checkpoint, step_record, window_sampler)


def losses(lm, head, tokens, aux_coef: float):
    """(loss, main CE, head CE on token t+2, router balance term, stats) on [B, L] tokens; stats as heads.py's:
    main_acc, mtp_acc and ``agree``, the head's argmax against the backbone's own argmax one position later
    (teacher-forced greedy acceptance)."""
    import torch
    import torch.nn.functional as F

    logits, mtp_logits, routers = forward(lm, head, tokens)
    main = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), tokens[:, 2:].flatten())
    cfg = lm.config
    aux = sum(load_balancing(r, cfg.num_experts, cfg.num_experts_per_tok) for r in routers) / len(routers)
    with torch.no_grad():
        mtp_arg = mtp_logits.argmax(-1)
        stats = {"main_acc": (logits[:, :-1].argmax(-1) == tokens[:, 1:]).float().mean(),
                 "mtp_acc": (mtp_arg == tokens[:, 2:]).float().mean(),
                 "agree": (mtp_arg == logits[:, 1:-1].argmax(-1)).float().mean()}
    return main + mtp + aux_coef * aux, main, mtp, aux, stats


def heldout(lm, head, held_ids, args):
    """A function: losses and stats averaged over the first --eval-batches batches of --eval-batch consecutive
    held-out windows of --seq tokens (the same windows every call)."""
    import numpy as np
    import torch

    seq, size = args.seq, args.eval_batch
    offsets = torch.arange(seq, device=held_ids.device)
    starts = np.arange(0, held_ids.numel() - seq, seq)[: args.eval_batches * size]

    @torch.no_grad()
    def evaluate():
        lm.eval(), head.eval()
        tot, n = {}, 0
        for i in range(0, len(starts), size):
            s = torch.from_numpy(starts[i: i + size]).to(held_ids.device)
            _, main, mtp, _, st = losses(lm, head, held_ids[s[:, None] + offsets], 0.0)
            for k, v in (("main", main), ("mtp", mtp), *st.items()):
                tot[k] = tot.get(k, 0.0) + float(v)
            n += 1
        lm.train(), head.train()
        return {k: round(v / max(n, 1), 4) for k, v in tot.items()}

    return evaluate


def checkpoint_state(lm, head) -> dict:
    """transformers' ForCausalLM names and the head's under ``mtp.``; floats in float32 (export stores bf16), the
    n-gram hashing buffers as they are (int64)."""
    sd = dict(lm.state_dict())
    sd.update({f"mtp.{k}": v for k, v in head.state_dict().items()})
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().contiguous()
            for k, v in sorted(sd.items())}


def spread_head_norms(head, spread: float, seed: int) -> None:
    """The head's trained norms start with gains log-uniform in [1/spread, spread] (weight = gain - 1, the norms
    being zero-centred), as real heads' norms are far from uniform: left at 0 the small head learns nearly uniform
    gains, and a conversion that adds 1 to them (Qwen3.5's rule, wrong here) only rescales what the next norm
    undoes, so the fixture would not show it."""
    import torch
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    from tools.fixture_training.training import final_norm_gain

    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, m in head.named_modules():
            if isinstance(m, Qwen4ExpTextRMSNorm) and ".indexer." not in name:
                m.weight.copy_(final_norm_gain(spread, m.weight.numel(), gen) - 1)


def untrained_vectors(lm, head, seed: int) -> None:
    """The indexers' q/k norms get no gradient (their selection is a mask): draw them around 0 so that they are
    not all zero in the fixture (a shifted or dropped norm then changes bytes)."""
    import torch
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in list(lm.modules()) + list(head.modules()):
            if isinstance(m, Qwen4ExpTextQSAIndexer):
                for norm in (m.q_layernorm, m.k_layernorm):
                    norm.weight.copy_(0.1 * torch.randn(norm.weight.shape, generator=gen))


def train_qwen4_exp(args) -> None:
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    out, dev, rng, train_ids, held_ids = open_run(args)
    shape = shape_of(args)
    if args.seq > shape["indexer_budget"]:
        raise SystemExit(f"--seq {args.seq} > indexer_budget: the (untrained) indexer would make attention sparse")
    lm, head, config = build(shape)
    untrained_vectors(lm, head, args.seed)
    if args.head_norm_spread > 1:
        spread_head_norms(head, args.head_norm_spread, args.seed)
    check_dense_indexer(lm, train_ids[None, :48].cpu())
    lm.to(dev).train()
    head.to(dev).train()
    n_params = param_count(lm, head)
    aux_coef = config.router_aux_loss_coef
    opt = adamw(lm, head, args, dev, no_decay_suffixes=("A_log", "dt_bias"))
    batch = window_sampler(train_ids, rng, args.seq, args.batch)
    evaluate = heldout(lm, head, held_ids, args)

    def one_step(step, total):
        loss, main, mtp, aux, st = losses(lm, head, batch(), aux_coef)
        gn = apply_gradients(opt, lm, head, loss, learning_rate(args, step, total), args.clip)
        return loss.detach(), main.detach(), mtp.detach(), aux.detach(), st, gn

    print_run_header(dev, n_params, threads=torch.get_num_threads())
    history, saved, t0 = [], [], time.time()
    step, total = plan_steps(one_step, args, dev, t0)
    saves, log_every = log_points(args, total)
    while step < total:
        loss, main, mtp, aux, st, gn = one_step(step, total)
        step += 1
        if is_log_step(step, total, saves, log_every):
            rec = step_record(step, learning_rate(args, step - 1, total), loss, main, mtp, st, gn, time.time() - t0,
                              aux=aux)
            log_record(rec, step, args, saves, log_every, evaluate, history)
        if step in saves:
            save_checkpoint(checkpoint_state(lm, head), out, step, saved)
    finish_run(out, args, dev, n_params, total, t0, saved, history)
