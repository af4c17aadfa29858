"""The run scaffold every variant's ``train`` uses: seeding and data, optimiser, learning rate, step plan,
log lines, held-out evaluation, checkpoints, log.json, and the command-line options of all that."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from tools.fixture_training.heads import forward_losses


def open_run(args):
    """(output folder, device, numpy RNG, train ids, held-out ids) of a run, torch seeded with --seed."""
    import torch

    stage, out = Path(args.stage), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # draws the training windows
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    train_ids = torch.from_numpy(np.load(stage / "train.npy").astype(np.int64)).to(dev)
    held_ids = torch.from_numpy(np.load(stage / "heldout.npy").astype(np.int64)).to(dev)
    return out, dev, rng, train_ids, held_ids


def final_norm_gain(spread: float, size: int, generator):
    """Per-channel gains log-uniform in [1/spread, spread], the final norms' start (trainable).

    A tiny model left alone learns a nearly uniform final-norm gain, which makes the pre-norm and
    post-norm states equal up to a scalar that the head's input norm removes; real checkpoints' final
    norms are far from uniform, and so are these, so feeding the head the wrong state shows.
    """
    import torch

    return spread ** (2 * torch.rand(size, generator=generator) - 1)


def param_count(lm, head) -> int:
    return sum(p.numel() for p in lm.parameters()) + sum(p.numel() for p in head.parameters())


def gpu_name(dev):
    import torch

    return torch.cuda.get_device_name() if dev.type == "cuda" else None


def adamw(lm, head, args, dev, no_decay_suffixes=()):
    """AdamW over the backbone's and the head's parameters: matrices with --weight-decay (first group), vectors
    and the parameters named ``*no_decay_suffixes`` without."""
    import torch

    decay, no_decay = [], []
    for mod in (lm, head):
        for name, p in mod.named_parameters():
            (no_decay if p.ndim < 2 or name.endswith(no_decay_suffixes) else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")


def window_sampler(ids, rng, seq: int, batch: int):
    """A function that draws ``batch`` windows of ``seq`` tokens of ``ids`` at random starts from ``rng``."""
    import torch

    offsets = torch.arange(seq, device=ids.device)

    def draw():
        starts = torch.from_numpy(rng.integers(0, ids.numel() - seq, size=batch)).to(ids.device)
        return ids[starts[:, None] + offsets]

    return draw


def heldout_evaluator(lm, head, held_ids, args, router_logits=None, aux_coef=0.0, losses=forward_losses):
    """A function that returns ``losses``' losses and stats (forward_losses' by default; a variant whose model
    forward_losses cannot run gives its own, of the same signature), averaged over the first --eval-batches batches
    of --eval-batch consecutive held-out windows of --seq tokens (the same windows at every call)."""
    import torch

    seq, size = args.seq, args.eval_batch
    offsets = torch.arange(seq, device=held_ids.device)
    starts = np.arange(0, held_ids.numel() - seq, seq)[: args.eval_batches * size]

    @torch.no_grad()
    def evaluate():
        lm.eval(), head.eval()
        tot = {"main": 0.0, "mtp": 0.0, "main_acc": 0.0, "mtp_acc": 0.0, "agree": 0.0}
        n = 0
        for i in range(0, len(starts), size):
            s = torch.from_numpy(starts[i: i + size]).to(held_ids.device)
            _, main, mtp, _, st = losses(lm, head, held_ids[s[:, None] + offsets], router_logits, aux_coef)
            for k, v in (("main", main), ("mtp", mtp), *st.items()):
                tot[k] += float(v)
            n += 1
        lm.train(), head.train()
        return {k: round(v / max(n, 1), 4) for k, v in tot.items()}

    return evaluate


def learning_rate(args, step: int, total: int) -> float:
    """Linear warm-up over min(--warmup, total / 10) steps, then a cosine from --lr down to --min-lr-frac of it."""
    warm = max(1, min(args.warmup, total // 10))
    if step < warm:
        return args.lr * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def apply_gradients(opt, lm, head, loss, lr: float, clip: float):
    """One optimiser step on ``loss`` at learning rate ``lr``, the gradients clipped to norm ``clip``; returns
    their norm before clipping."""
    import torch

    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(lm.parameters()) + list(head.parameters()), clip)
    opt.step()
    return norm


def plan_steps(one_step, args, dev, started: float):
    """(first step, total steps) of a run: 0 and --steps, or with --steps 0 as many as fit in --time-budget
    seconds from ``started``, timed on --calibration-steps steps of one_step(step, total) run here."""
    import torch

    if args.steps:
        return 0, args.steps
    calib = args.calibration_steps
    for step in range(calib):
        one_step(step, 10 ** 9)  # inside the learning rate's warm-up whatever the total turns out to be
        if step == 4:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_start = time.time()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.time() - t_start) / (calib - 5)
    total = max(calib + 1, int((args.time_budget - (time.time() - started)) / (per_step * 1.08)) + calib)
    print(json.dumps({"calibrated_step_s": round(per_step, 4), "steps": total}), flush=True)
    return calib, total


def log_points(args, total: int):
    """(the steps that save a checkpoint, the steps between log lines) of a run of ``total`` steps."""
    saves = sorted({max(1, int(total * f)) for f in args.save_at} | {total})
    return saves, max(1, total // args.logs)


def is_log_step(step: int, total: int, saves, log_every: int) -> bool:
    return step % log_every == 0 or step == total or step in saves


def log_record(rec: dict, step: int, args, saves, log_every: int, evaluate, history: list) -> None:
    """Print a log line and keep it in ``history``, with held-out numbers every --eval-every lines and at saves."""
    if step in saves or step % (log_every * args.eval_every) == 0:
        rec["heldout"] = evaluate()
    history.append(rec)
    print(json.dumps(rec), flush=True)


def step_record(step: int, lr: float, loss, main, mtp, stats: dict, grad_norm, seconds: float, aux=None,
                max_load_ratio=None) -> dict:
    """A training log line, rounded; ``aux`` (router balancing loss) and ``max_load_ratio`` where given."""
    rec = {"step": step, "lr": round(lr, 6), "loss": round(float(loss), 4), "main": round(float(main), 4),
           "mtp": round(float(mtp), 4)}
    if aux is not None:
        rec["aux"] = round(float(aux), 4)
    rec.update({"mtp_acc": round(float(stats["mtp_acc"]), 4), "grad_norm": round(float(grad_norm), 3)})
    if max_load_ratio is not None:
        rec["max_load_ratio"] = round(float(max_load_ratio), 3)
    rec["seconds"] = round(seconds, 1)
    return rec


def save_checkpoint(state: dict, out: Path, step: int, saved: list) -> None:
    """Write ``state`` to OUT/step-NNNNNN.safetensors and add the file's name to ``saved``."""
    from safetensors.torch import save_file

    name = f"step-{step:06d}.safetensors"
    save_file(state, str(out / name), metadata={"format": "pt"})
    saved.append(name)


def run_args(args) -> dict:
    """The parsed options as log.json records them."""
    return {k: v for k, v in vars(args).items() if k not in ("func",)}


def print_run_header(dev, n_params: int, **extra) -> None:
    import torch

    print(json.dumps({"device": str(dev), "torch": torch.__version__, "params": n_params, **extra,
                      "gpu": gpu_name(dev)}), flush=True)


def finish_run(out: Path, args, dev, n_params: int, total: int, started: float, saved: list, history: list,
               **extra) -> None:
    """Write OUT/log.json (``extra`` after the history) and print the summary line."""
    import torch
    import transformers

    log = {
        "variant": args.variant, "device": str(dev), "gpu": gpu_name(dev),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "params": n_params, "steps": total, "tokens_seen": total * args.batch * args.seq,
        "wall_s": round(time.time() - started, 1), "checkpoints": saved, "history": history, **extra,
        "args": run_args(args),
    }
    (out / "log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"done: {total} steps in {log['wall_s']} s; {saved}", flush=True)


def add_optimisation_args(p, seq: int = 512, seq_help: str = None) -> None:
    """train's options of the step count, batch and optimiser (the scaffold's), in the order log.json keeps."""
    p.add_argument("--steps", type=int, default=0, help="0: as many as --time-budget allows (calibrated)")
    p.add_argument("--time-budget", type=float, default=300.0, help="seconds, when --steps is 0")
    p.add_argument("--calibration-steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=seq, help=seq_help)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def add_logging_args(p) -> None:
    """train's options of checkpoints, log lines and held-out evaluation (the scaffold's)."""
    p.add_argument("--save-at", type=float, nargs="*", default=[0.5])
    p.add_argument("--logs", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every N logs")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--eval-batch", type=int, default=16)
