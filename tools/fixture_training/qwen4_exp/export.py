"""The qwen4_exp fixture's export: a checkpoint as the raw release layout (transformers' own ``save_pretrained`` of
``Qwen4ExpForConditionalGeneration`` for the backbone, ``mtp.*`` beside it), read back with ``from_pretrained``, the
head's acceptance measured in torch on what was written, and training.json / README.md."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.fixture_training.folders import (checkpoint_step, load_checkpoint, logged_at, provenance,
                                            write_tokenizer_and_generation)
from tools.fixture_training.glm.acceptance import bootstrap_ci, greedy_prompts
from tools.fixture_training.qwen4_exp.model import FIXTURE, VISION, build, forward, release_config, shape_of

SCRIPT = "tools/fixture_training/qwen4_exp"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")  # backbone, mtp.*
LM_PREFIX = "model.language_model."


def vlm_model(shape: dict, seed: int = 0):
    """transformers' Qwen4ExpForConditionalGeneration of this shape, the vision tower drawn from ``seed``."""
    import torch
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen4ExpConfig(text_config=dict(shape), vision_config=dict(VISION, out_hidden_size=shape["hidden_size"]),
                            tie_word_embeddings=False)
    return Qwen4ExpForConditionalGeneration(config)


def release_tensors(state: dict, shape: dict, seed: int = 0) -> dict:
    """The release's tensors: the backbone as ``save_pretrained`` writes it (``model.language_model.*``,
    ``model.visual.*``, ``lm_head``; n-gram tables in ``shard_N`` parts, conv1d [C, 1, K], int64 hashing buffers),
    then the head as ``mtp.*``; every float in bf16."""
    import torch
    from safetensors.torch import load_file

    model = vlm_model(shape, seed)
    text = {(LM_PREFIX + k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()
            if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(text, strict=False)
    if unexpected or [k for k in missing if not k.startswith("model.visual.")]:
        raise SystemExit(f"the checkpoint does not fit the model: {unexpected[:5]} {missing[:5]}")
    model.to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tensors = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
    tensors.update({k: v.to(torch.bfloat16) for k, v in state.items() if k.startswith("mtp.")})
    return {k: v.contiguous() for k, v in sorted(tensors.items())}


def write_release(out: Path, tensors: dict, config: dict) -> int:
    """The backbone in the first shard, the head in the last (as the release), an index, config.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    weight_map = {k: SHARDS[1] if k.startswith("mtp.") else SHARDS[0] for k in tensors}
    for shard in SHARDS:
        save_file({k: tensors[k] for k, s in weight_map.items() if s == shard}, str(out / shard),
                  metadata={"format": "pt"})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return total


def read_back(folder: Path):
    """(Qwen4ExpForCausalLM, head) in float32 from a written folder: the backbone through
    ``Qwen4ExpForConditionalGeneration.from_pretrained`` (it must load with nothing missing), the head from
    ``mtp.*``."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen4ExpForConditionalGeneration

    vlm, info = Qwen4ExpForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                 output_loading_info=True)
    bad = {k: v for k, v in info.items() if k != "unexpected_keys" and v}
    unexpected = [k for k in info.get("unexpected_keys") or [] if not k.startswith("mtp.")]
    if bad or unexpected:
        raise SystemExit(f"from_pretrained: {bad} {unexpected[:5]}")
    config = json.loads((folder / "config.json").read_text())
    lm, head, _ = build(shape_of(dict_of_text(config)))
    text = {"model." + k[len("model.language_model."):]: v for k, v in vlm.state_dict().items()
            if k.startswith("model.language_model.")}
    lm.load_state_dict(dict(text, **{"lm_head.weight": vlm.lm_head.weight}), strict=True)
    raw = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        raw.update(load_file(str(f)))
    head.load_state_dict({k[4:]: v.float() for k, v in raw.items() if k.startswith("mtp.")}, strict=True)
    return lm.float().eval(), head.float().eval()


def dict_of_text(config: dict) -> dict:
    """train's size options as a run's logged args would carry them, from a written config.json."""
    tc = config["text_config"]
    return {"hidden_size": tc["hidden_size"], "experts": tc["num_experts"], "top_k": tc["num_experts_per_tok"],
            "expert_size": tc["moe_intermediate_size"], "ngram_base": tc["ngram_vocab_size_base"]}


def export_qwen4_exp(args) -> None:
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    stage, run = Path(args.stage), Path(args.run)
    out = Path(args.out or FIXTURE)
    log = json.loads((run / "log.json").read_text())
    ckpt = args.checkpoint or log["checkpoints"][-1]
    shape = shape_of(log["args"])
    tensors = release_tensors(load_checkpoint(run / ckpt), shape, log["args"]["seed"])
    total = write_release(out, tensors, release_config(shape))
    write_tokenizer_and_generation(out, stage)
    lm, head = read_back(out)
    acc = acceptance(lm, head, np.load(stage / "heldout.npy"))
    manifest = json.loads((stage / "manifest.json").read_text())
    step = checkpoint_step(ckpt)
    record = {**provenance(SCRIPT, args.commands, manifest, log, ckpt),
              "acceptance": dict(acc, measured_with={"torch": torch.__version__,
                                                     "transformers": transformers.__version__}),
              "final": logged_at(log, step), "history": log["history"]}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    from tools.fixture_training.qwen4_exp.readme import write_readme

    n_params = sum(v.numel() for v in tensors.values() if v.is_floating_point())
    write_readme(out, record, manifest, n_params)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB in all, {total / 1e6:.2f} MB of tensors, {n_params / 1e6:.2f} M "
          f"parameters, step {step}); torch acceptance: greedy {acc['greedy']:.4f}, teacher-forced "
          f"{acc['teacher_forced']:.4f}; broken: {json.dumps(acc['broken'])}")


def remeasure_qwen4_exp(args) -> None:
    """The torch acceptance of a written folder again (``acceptance`` in its training.json replaced; ``--no-record``:
    printed only), on the stage's held-out ids."""
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(args.folder)
    lm, head = read_back(folder)
    acc = acceptance(lm, head, np.load(Path(args.stage) / "heldout.npy"))
    acc["measured_with"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    print(json.dumps({k: v for k, v in acc.items() if k != "method"}, indent=1))
    if args.no_record:
        return
    record = json.loads((folder / "training.json").read_text())
    record["acceptance"] = acc
    line = f"python -m tools.fixture_training.qwen4_exp acceptance {args.folder} --stage STAGE"
    record["commands"] = [c for c in record["commands"] if " acceptance " not in c] + [line]
    (folder / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    from tools.fixture_training.qwen4_exp.check import rewrite_readme

    rewrite_readme(folder, record)
    print(f"recorded in {folder / 'training.json'} and README.md")


# ---------------------------------------------------------------------------------------------
# acceptance (torch)
# ---------------------------------------------------------------------------------------------
def continuations(lm, prompts: list, generate: int):
    """The backbone's greedy continuations of same-length prompts, one batch, a full forward per token."""
    import torch

    seqs = torch.from_numpy(np.stack(prompts))
    with torch.no_grad():
        for _ in range(generate):
            nxt = lm(input_ids=seqs, use_cache=False).logits[:, -1].argmax(-1)
            seqs = torch.cat([seqs, nxt[:, None]], dim=1)
    return seqs


def head_hits(lm, head, seqs, prompt: int):
    """Per sequence: how many generated tokens t+2 (t+1 the prompt's last token or later) the head's argmax from
    (h_t, t+1) equals, and of how many."""
    import torch

    with torch.no_grad():
        _, mtp, _ = forward(lm, head, seqs)
    t = torch.arange(prompt - 1, seqs.shape[1] - 2)
    hits = (mtp.argmax(-1)[:, t] == seqs[:, t + 2]).sum(1).numpy()
    return hits, np.full(hits.size, t.numel())


def greedy(lm, head, seqs, prompt: int) -> dict:
    hits, totals = head_hits(lm, head, seqs, prompt)
    return {"greedy": round(float(hits.sum() / max(totals.sum(), 1)), 4), "greedy_ci95": bootstrap_ci(hits, totals),
            "greedy_drafts": int(totals.sum()), "greedy_by_prompt": [round(h / t, 4) for h, t in zip(hits, totals)]}


def teacher_forced(lm, head, held: np.ndarray, seq: int = 128, batch: int = 16) -> dict:
    """Share of positions of every ``seq``-token held-out window where the head's argmax (h_t, true t+1) equals
    the backbone's argmax at t+1."""
    import torch

    starts = np.arange(0, held.size - seq, seq)
    hits = []
    for i in range(0, len(starts), batch):
        tokens = torch.from_numpy(np.stack([held[s: s + seq] for s in starts[i: i + batch]]).astype(np.int64))
        with torch.no_grad():
            logits, mtp, _ = forward(lm, head, tokens)
        hits += (mtp.argmax(-1) == logits[:, 1:-1].argmax(-1)).sum(1).tolist()
    hits = np.array(hits)
    totals = np.full(hits.size, seq - 2)
    return {"teacher_forced": round(float(hits.sum() / totals.sum()), 4),
            "teacher_forced_ci95": bootstrap_ci(hits, totals), "teacher_forced_positions": int(totals.sum())}


def broken_heads(head):
    """(name, edit) pairs: each edit changes the head in place as a broken conversion would and returns its undo."""
    import torch

    def swap():
        a, b = head.fc_embedding.weight, head.fc_hidden.weight
        with torch.no_grad():
            keep = a.detach().clone()
            a.copy_(b), b.copy_(keep)
        return swap  # swapping again undoes it

    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    def shift(sign=1.0):
        with torch.no_grad():
            for m in head.modules():
                if isinstance(m, Qwen4ExpTextRMSNorm):
                    m.weight += sign
        return lambda: shift(-1.0)

    def roll_streams():
        # the backbone's hc streams reach the head one place round (stream k read as stream k+1): what a converter
        # that reorders the streams' axis of the head's inputs amounts to
        plain, hc = head.forward, head.config.hc_count

        def forward(next_embeddings, hidden):
            streams = hidden.unflatten(-1, (hc, -1)).roll(1, dims=-2).flatten(-2)
            return plain(next_embeddings, streams)

        head.forward = forward

        def undo():
            del head.forward
        return undo

    return [("fc_halves_swapped", swap), ("head_norms_shifted_plus_one", shift),
            ("input_streams_rolled", roll_streams)]


def acceptance(lm, head, held: np.ndarray, eot: int = 0, prompt: int = 64, generate: int = 64,
               per_file: int = 2) -> dict:
    """Torch measurements of the head on held-out text (the stage's heldout.npy):

    greedy          ``per_file`` ``prompt``-token prompts from each held-out file, continued greedily by the
                    backbone for ``generate`` tokens; share of the generated tokens t+2 (t+1 the prompt's last token
                    or later) that the head's argmax from (h_t, t+1) equals: the greedy acceptance of one draft a
                    step. 95% interval: percentile bootstrap over prompts
    teacher_forced  every 128-token held-out window: share of positions t where the head's argmax (h_t and the true
                    token t+1) equals the backbone's argmax at t+1; the training log's "agree"
    broken          the greedy measurement with the head as a broken conversion leaves it: fc_embedding and
                    fc_hidden swapped, every RMS norm of the head shifted by +1 (mlx-vlm adds the 1 itself), the
                    backbone's hc streams fed to the head one place round
    """
    t0 = time.time()
    prompts = greedy_prompts(held, eot, prompt, per_file)
    seqs = continuations(lm, prompts, generate)
    out = {**greedy(lm, head, seqs, prompt), **teacher_forced(lm, head, held),
           "prompts": len(prompts), "prompt_tokens": prompt, "generated_tokens": generate, "broken": {}}
    for name, edit in broken_heads(head):
        undo = edit()
        out["broken"][name] = {k: v for k, v in greedy(lm, head, seqs, prompt).items() if k in ("greedy",
                                                                                                 "greedy_ci95")}
        undo()
    out["seconds"] = round(time.time() - t0, 1)
    out["method"] = acceptance.__doc__.split("\n\n", 1)[1].strip()
    return out
