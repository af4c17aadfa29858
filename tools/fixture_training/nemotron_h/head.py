"""The Nemotron-H head retrained on a frozen backbone, so that a converter's block-order and latent-orientation
mistakes show in the head's acceptance.

A tiny head whose two blocks nearly commute, and whose latent MoE carries little, accepts about as many drafts run in
the wrong block order or with its (square) latent projections transposed as run right: a fixture like that cannot
catch a converter that makes either mistake. A real Super's blocks do not commute, so the first mistake breaks its
head, and its latent projections are not square (hidden 4096, latent 1024), so the second one does not even load.
This run makes the fixture's square head as sensitive by training: the backbone of an existing folder stays as it
is (no gradient, its routers' biases untouched), the head starts from that folder's head, and its loss is

    CE(head) + contrast * sum over b of mean over positions of max(0, CE(head).detach() + margin - CE(head broken as b))

with b the two conversions (the blocks run in the other order; ``fc1_latent_proj`` := ``fc2_latent_proj``ᵀ and
``fc2_latent_proj`` := ``fc1_latent_proj``ᵀ): the correct head keeps learning token t+2, and each broken one is
pushed, at every position, to a cross-entropy at least ``margin`` nats above the correct one's. The head's routers
keep their auxiliary-loss-free balancing. The run folder holds the backbone and head in train's checkpoint layout,
so export writes it as it writes a full run; log.json carries the source folder's own training record (``backbone``).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from tools.fixture_training.glm.train import set_threads
from tools.fixture_training.heads import torch_state
from tools.fixture_training.nemotron_h.model import F32_SUFFIXES, FIXTURE, SHAPE_OPTS, build_torch
from tools.fixture_training.nemotron_h.train import balance_routers
from tools.fixture_training.training import (adamw, apply_gradients, is_log_step, learning_rate, log_points,
                                             open_run, print_run_header, run_args, save_checkpoint)

CONTRASTED = ("blocks_swapped", "latent_transposed")


def latent_moe(head):
    return next(b.mixer for b in head.model.layers if hasattr(b.mixer, "fc1_latent_proj"))


@contextlib.contextmanager
def run_broken(head, how: str):
    """While inside, ``head(...)`` runs as the conversion ``how`` wrote it, with gradients to the head's own
    parameters: the block list reversed, or each latent projection's weight read as the other's transpose."""
    import torch

    if how == "blocks_swapped":
        kept = head.model.layers
        head.model.layers = torch.nn.ModuleList(list(kept)[::-1])
        try:
            yield
        finally:
            head.model.layers = kept
    elif how == "latent_transposed":
        moe = latent_moe(head)
        fc1, fc2 = moe.fc1_latent_proj, moe.fc2_latent_proj
        own = fc1.forward, fc2.forward
        fc1.forward = lambda x: torch.nn.functional.linear(x, fc2.weight.T)
        fc2.forward = lambda x: torch.nn.functional.linear(x, fc1.weight.T)
        try:
            yield
        finally:
            fc1.forward, fc2.forward = own
    else:
        raise ValueError(how)


def contrast_losses(lm, head, tokens, margin: float, contrast: float):
    """(loss, the correct head's CE, {b: CE of the head broken as b}, stats) on [B, L] tokens, the backbone frozen."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        h = lm.model(input_ids=tokens).last_hidden_state
        following = lm.lm_head(h)[:, 1:-1].argmax(-1)  # the backbone's greedy token t+2
        e = lm.model.embeddings(tokens[:, 1:])
    target = tokens[:, 2:].flatten()

    def ce(mtp_logits):  # per position
        return F.cross_entropy(mtp_logits.flatten(0, 1).float(), target, reduction="none")

    logits = lm.lm_head(head(h[:, :-1], e))[:, :-1]
    mtp_each = ce(logits)
    mtp = mtp_each.mean()
    broken, stats = {}, {}
    with torch.no_grad():
        stats["mtp_acc"] = (logits.argmax(-1) == tokens[:, 2:]).float().mean()
        stats["agree"] = (logits.argmax(-1) == following).float().mean()
    head.counting = False  # the routers' loads are the correct head's
    for how in CONTRASTED:
        with run_broken(head, how):
            b_logits = lm.lm_head(head(h[:, :-1], e))[:, :-1]
        broken[how] = ce(b_logits)
        with torch.no_grad():
            stats[f"agree_{how}"] = (b_logits.argmax(-1) == following).float().mean()
    head.counting = True
    # per position: a broken head far off at a few positions does not make up for one still right at the others
    hinge = sum(torch.relu(mtp_each.detach() + margin - b).mean() for b in broken.values())
    return mtp + contrast * hinge, mtp, {how: b.mean() for how, b in broken.items()}, stats


def _record(step, lr, loss, mtp, broken, stats, grad_norm, imbalance, seconds) -> dict:
    rec = {"step": step, "lr": round(lr, 6), "loss": round(float(loss.detach()), 4),
           "mtp": round(float(mtp.detach()), 4)}
    rec.update({f"mtp_{k}": round(float(v.detach()), 4) for k, v in broken.items()})
    rec.update({k: round(float(v), 4) for k, v in stats.items()})
    rec.update({"grad_norm": round(float(grad_norm), 3), "max_load_ratio": round(float(imbalance), 3),
                "seconds": round(seconds, 1)})
    return rec


def train_head(args) -> None:
    import torch
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from tools.fixture_training.folders import load_folder
    from tools.fixture_training.nemotron_h.export import load_release
    from tools.fixture_training.nemotron_h.model import nemotron_config, shape_of

    set_threads(args.threads)
    source = Path(args.source or FIXTURE)
    src_cfg = json.loads((source / "config.json").read_text())
    for opt, key in SHAPE_OPTS.items():  # the source's sizes, logged so that export builds the same model
        setattr(args, opt, src_cfg[key])
    shape = shape_of(args)
    out, dev, rng, train_ids, held_ids = open_run(args)
    lm, head, _ = build_torch(shape)
    load_release(lm, head, load_folder(source), nemotron_config(shape))
    lm.to(dev).eval().requires_grad_(False)
    head.to(dev).train()
    head.counting = True
    routers = [m for m in head.modules() if isinstance(m, NemotronHTopkRouter)]
    loads = {id(r): torch.zeros(r.num_experts, device=dev) for r in routers}

    def count(module, _inputs, output):  # (router_logits, topk_weights, topk_indices)
        if module.training and head.counting:
            loads[id(module)] += torch.bincount(output[2].flatten(), minlength=module.num_experts).float()

    for r in routers:
        r.register_forward_hook(count)
    opt = adamw(head, torch.nn.Module(), args, dev)
    offsets = torch.arange(args.seq, device=dev)

    def batch():
        starts = torch.from_numpy(rng.integers(0, train_ids.numel() - args.seq, size=args.batch)).to(dev)
        return train_ids[starts[:, None] + offsets]

    held_starts = torch.arange(0, held_ids.numel() - args.seq, args.seq)[: args.eval_batches * args.eval_batch]

    @torch.no_grad()
    def evaluate():
        head.eval()
        tot, n = {}, 0
        for i in range(0, len(held_starts), args.eval_batch):
            s = held_starts[i: i + args.eval_batch].to(dev)
            _, mtp, broken, st = contrast_losses(lm, head, held_ids[s[:, None] + offsets], args.margin, args.contrast)
            for k, v in (("mtp", mtp), *((f"mtp_{b}", v) for b, v in broken.items()), *st.items()):
                tot[k] = tot.get(k, 0.0) + float(v)
            n += 1
        head.train()
        return {k: round(v / max(n, 1), 4) for k, v in tot.items()}

    n_params = sum(p.numel() for p in lm.parameters()) + sum(p.numel() for p in head.parameters())
    print_run_header(dev, n_params, trained=sum(p.numel() for p in head.parameters()))
    print(json.dumps({"step": 0, "heldout": evaluate()}), flush=True)
    total, history, saved, t0 = args.steps, [], [], time.time()
    saves, log_every = log_points(args, total)
    for step in range(total):
        lr = learning_rate(args, step, total)
        loss, mtp, broken, st = contrast_losses(lm, head, batch(), args.margin, args.contrast)
        gn = apply_gradients(opt, head, torch.nn.Module(), loss, lr, args.clip)
        imbalance = balance_routers(routers, loads, args.bias_rate)  # as train's
        done = step + 1
        if is_log_step(done, total, saves, log_every):
            rec = _record(done, lr, loss, mtp, broken, st, gn, imbalance, time.time() - t0)
            if done in saves or done % (log_every * args.eval_every) == 0:
                rec["heldout"] = evaluate()
            history.append(rec)
            print(json.dumps(rec), flush=True)
        if done in saves:
            save_checkpoint(torch_state(lm, head, F32_SUFFIXES), out, done, saved)
    import transformers

    backbone = json.loads((source / "training.json").read_text())
    routers_all = [m for m in list(lm.modules()) + list(head.modules()) if isinstance(m, NemotronHTopkRouter)]
    log = {
        "variant": args.variant, "device": str(dev), "gpu": None if dev.type != "cuda" else
        torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
        "params": n_params, "steps": total, "tokens_seen": total * args.batch * args.seq,
        "wall_s": round(time.time() - t0, 1), "checkpoints": saved, "history": history,
        "e_score_correction_bias": {f"{i}": [round(float(x), 4) for x in r.e_score_correction_bias]
                                    for i, r in enumerate(routers_all)},
        # what made the backbone (and the head this run started from): the source folder's own record
        "backbone": {k: backbone[k] for k in ("commands", "training", "checkpoint", "final", "acceptance", "history")
                     if k in backbone},
        "args": run_args(args),
    }
    (out / "log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"done: {total} steps in {log['wall_s']} s; {saved}", flush=True)
