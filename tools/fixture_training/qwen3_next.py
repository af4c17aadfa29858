"""The Qwen3-Next text fixture ``text-qwen3next-mtp`` (``--variant next``).

The backbone is transformers' own ``Qwen3NextForCausalLM`` (flat ``qwen3_next`` config: 4 layers,
linear attention at 0-2 and full attention at 3, every layer MoE with a shared expert), trained on
the same stage (corpus, tokenizer, token ids) and with the same train loop as the Qwen3.5 text
fixtures. The MTP head is heads.build_with's, built of Qwen3-Next parts:
``fc(concat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])``, one full-attention
``Qwen3NextDecoderLayer`` (MoE + shared expert), ``norm`` and the shared ``lm_head``; its RMSNorms are
Qwen3-Next's zero-centred ``x * (1 + w)`` (the gated norm of the linear attention is ``x * w``, stored
as is, like the release).

export writes the published Qwen3-Next raw layout (tests/data/layouts/Qwen3-Next-80B-A3B-Instruct):
flat ``model.*`` keys, every expert of the backbone and of ``mtp.layers.0`` one by one, all tensors
bf16 (A_log and the GDN norm too), the backbone plus ``lm_head`` in ``model-00001-of-00002`` and
every ``mtp.*`` tensor in the last shard ``model-00002-of-00002``, an index, and a config.json with
the published keys in the published order: no MTP count field. It then measures the head's
acceptance in torch on the exported folder and writes training.json and README.md.

parity loads the folder with ``Qwen3NextForCausalLM.from_pretrained`` (which ignores ``mtp.*`` and
fuses the per-expert tensors) and compares its logits with this module's model holding the trained
checkpoint (``--run``) or the folder's own tensors; with ``--acceptance`` it also measures the head's
acceptance with the from_pretrained backbone (a few minutes on a CPU). Torch only.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

from tools.fixture_training.corpus import VOCAB
from tools.fixture_training.folders import (REPO, checkpoint_step, fuse_experts, load_checkpoint, load_folder,
                                            load_into, logged_at, loading_problems, parity_ids, provenance,
                                            readme_method, split_experts, write_shards,
                                            write_tokenizer_and_generation)
from tools.fixture_training.heads import build_with, head_positions
from tools.fixture_training.qwen3_5 import SCRIPT, TEXT, moe_shape, train

LAYOUT = REPO / "tests/data/layouts/Qwen3-Next-80B-A3B-Instruct"

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")  # backbone, mtp.*

EXPERT_OPTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
               "shared_expert_intermediate_size": 64}
FIXTURE = REPO / "mtpconvert/fixture/data/text-qwen3next-mtp"


def next_config(shape: dict = None) -> dict:
    """The raw config.json: the published Qwen3-Next keys, in its (alphabetical) order, with this model's sizes."""
    import transformers

    t = TEXT
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 0,  # <|endoftext|>, as 151643 is in the release
        "decoder_sparse_step": 1,
        "eos_token_id": t["eos_token_id"],  # <|im_end|>
        "full_attention_interval": t["full_attention_interval"],
        "head_dim": t["head_dim"],
        "hidden_act": "silu",
        "hidden_size": t["hidden_size"],
        "initializer_range": t["initializer_range"],
        "intermediate_size": 256,  # dense MLP size: unused, every layer is MoE (mlp_only_layers empty)
        "linear_conv_kernel_dim": t["linear_conv_kernel_dim"],
        "linear_key_head_dim": t["linear_key_head_dim"],
        "linear_num_key_heads": t["linear_num_key_heads"],
        "linear_num_value_heads": t["linear_num_value_heads"],
        "linear_value_head_dim": t["linear_value_head_dim"],
        "max_position_embeddings": t["max_position_embeddings"],
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": EXPERT_OPTS["moe_intermediate_size"],
        "norm_topk_prob": True,
        "num_attention_heads": t["num_attention_heads"],
        "num_experts": EXPERT_OPTS["num_experts"],
        "num_experts_per_tok": EXPERT_OPTS["num_experts_per_tok"],
        "num_hidden_layers": t["num_hidden_layers"],
        "num_key_value_heads": t["num_key_value_heads"],
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": t["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.01,
        "shared_expert_intermediate_size": EXPERT_OPTS["shared_expert_intermediate_size"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    for k, v in (shape or {}).items():
        if k not in cfg:
            raise ValueError(f"not a Qwen3-Next config key: {k}")
        cfg[k] = v
    return cfg


def shape_of(given) -> dict:
    """MoE sizes from train's options (``--experts`` ...) or a run's logged args, over the fixture's defaults."""
    return dict(EXPERT_OPTS, **moe_shape(given))


def build_torch_next(shape: dict = None):
    """(Qwen3NextForCausalLM, MTP head, config): the config is the one config.json loads into."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    config = Qwen3NextConfig.from_dict(next_config(dict(EXPERT_OPTS, **(shape or {}))))
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"], config.layer_types
    return build_with(Qwen3NextForCausalLM, config, Qwen3NextDecoderLayer, Qwen3NextRMSNorm)


def train_next(args) -> None:
    """Qwen3.5's train loop on this model; its checkpoints store every tensor in bf16, as the release does."""
    train(args, build=lambda: build_torch_next(moe_shape(args)), f32_suffixes=())


# ---------------------------------------------------------------------------------------------
# the published raw layout (per expert)
# ---------------------------------------------------------------------------------------------
def published_keys(cfg: dict) -> set:
    """The release's tensor names cut to this model's layers and experts (layers 0-3: linear x3, full)."""
    import gzip

    keep = set()
    for line in gzip.decompress((LAYOUT / "tensors.tsv.gz").read_bytes()).decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key = line.split("\t")[0]
        layer = re.search(r"^model\.layers\.(\d+)\.", key)
        expert = re.search(r"\.experts\.(\d+)\.", key)
        if (layer and int(layer.group(1)) >= cfg["num_hidden_layers"]) or \
                (expert and int(expert.group(1)) >= cfg["num_experts"]):
            continue
        keep.add(key)
    return keep


def split_state(state: dict) -> dict:
    """The folder's key -> shard file: ``mtp.*`` in the last shard, the rest in the first."""
    return {k: SHARDS[1] if k.startswith("mtp.") else SHARDS[0] for k in sorted(state)}


# ---------------------------------------------------------------------------------------------
# acceptance (torch): the head's argmax for t+2 against the backbone's greedy token at t+2
# ---------------------------------------------------------------------------------------------
def head_logits(lm, head, tokens):
    """(backbone logits [B, L, V], head logits [B, L-1, V]: row t drafts token t+2 from (h_t, token t+1))."""
    import torch

    with torch.no_grad():
        h = lm.model(input_ids=tokens).last_hidden_state
        B, L = tokens.shape
        pe = lm.model.rotary_emb(h, head_positions(lm.config, B, L - 1, tokens.device))
        m = head(h[:, :-1], lm.model.embed_tokens(tokens[:, 1:]), pe)
        return lm.lm_head(h), lm.lm_head(m)


def acceptance(lm, head, held: np.ndarray, eot: int = 0, seq: int = 512, windows: int | None = None,
               prompt: int = 64, generate: int = 64) -> dict:
    """Two torch measurements on held-out text (the stage's heldout.npy):

    teacher_forced  on ``windows`` (default: all) windows of ``seq`` held-out tokens: share of positions t where the
                    head's argmax (from h_t and the true token t+1) equals the backbone's argmax at t+1
                    (its greedy token t+2); the training log's "agree"
    greedy          each held-out file gives a ``prompt``-token prompt (from its middle) that the
                    backbone continues greedily (``generate()``, KV cache) for ``generate`` tokens; share of the generated tokens
                    t+2 (t+1 generated too) that the head's argmax from (h_t, t+1) equals: the greedy
                    acceptance of one draft per step
    """
    import torch

    lm.eval(), head.eval()
    starts = np.arange(0, held.size - seq, seq)[:windows]
    hits = total = 0
    for s in starts:
        tokens = torch.from_numpy(held[s: s + seq].astype(np.int64))[None]
        logits, mtp = head_logits(lm, head, tokens)
        hits += int((mtp[0, :-1].argmax(-1) == logits[0, 1:-1].argmax(-1)).sum())
        total += seq - 2
    teacher = hits / total
    docs = np.split(held, np.flatnonzero(held == eot) + 1)
    g_hits = g_total = 0
    per_prompt = []
    for doc in docs:
        if doc.size < 2 * prompt:
            continue
        mid = doc.size // 2
        seqn = torch.from_numpy(doc[mid: mid + prompt].astype(np.int64))[None]
        with torch.no_grad():
            seqn = lm.generate(seqn, max_new_tokens=generate, min_new_tokens=generate, do_sample=False,
                               eos_token_id=None, pad_token_id=eot)
        _, mtp = head_logits(lm, head, seqn)
        draft = mtp[0].argmax(-1)  # row t drafts token t+2
        t = torch.arange(prompt - 1, seqn.shape[1] - 2)  # t+1 is the prompt's last token or later; t+2 generated
        ok = int((draft[t] == seqn[0, t + 2]).sum())
        g_hits, g_total = g_hits + ok, g_total + t.numel()
        per_prompt.append(round(ok / t.numel(), 4))
    return {"teacher_forced": round(teacher, 4), "teacher_forced_positions": total,
            "greedy": round(g_hits / max(g_total, 1), 4), "greedy_drafts": g_total, "greedy_by_prompt": per_prompt,
            "method": acceptance.__doc__.split("\n\n", 1)[1].strip()}


# ---------------------------------------------------------------------------------------------
# export and parity
# ---------------------------------------------------------------------------------------------
def export_next(args) -> None:
    import torch

    stage, run = Path(args.stage), Path(args.run)
    out = Path(args.out or FIXTURE)
    log = json.loads((run / "log.json").read_text())
    ckpt = args.checkpoint or log["checkpoints"][-1]
    cfg = next_config(shape_of(log["args"]))
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in split_experts(load_checkpoint(run / ckpt)).items()}
    expected = published_keys(cfg)
    if set(state) != expected:
        raise SystemExit(f"layout differs from the release: extra {sorted(set(state) - expected)[:5]}, "
                         f"missing {sorted(expected - set(state))[:5]}")
    total = write_shards(out, state, split_state(state), SHARDS)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer_and_generation(out, stage)

    lm, head, _ = build_torch_next(shape_of(log["args"]))  # the acceptance of what was written
    load_into(lm, head, fuse_experts(load_folder(out)))
    acc = acceptance(lm, head, np.load(stage / "heldout.npy"))
    manifest = json.loads((stage / "manifest.json").read_text())
    step = checkpoint_step(ckpt)
    record = {
        **provenance(SCRIPT, args.commands, manifest, log, ckpt),
        "acceptance": dict(acc, measured_with={"torch": torch.__version__,
                                               "transformers": __import__("transformers").__version__}),
        "final": logged_at(log, step),
        "history": log["history"],
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    write_readme(out, record, manifest, sum(v.numel() for v in state.values()))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB in all, {total / 1e6:.2f} MB of tensors, "
          f"{sum(v.numel() for v in state.values()) / 1e6:.2f} M parameters, step {step}); acceptance: "
          f"teacher-forced {acc['teacher_forced']:.4f}, greedy {acc['greedy']:.4f} ({acc['greedy_drafts']} drafts)")


def write_readme(out: Path, record: dict, manifest: dict, n_params: int) -> None:
    acc, a = record["acceptance"], record["training"]["args"]
    held = ", ".join(f["path"] for f in manifest["heldout_files"])
    script_note = ("`python -m tools.fixture_training --variant next` (this repository; the Qwen3-Next parts are in\n"
                   "`tools/fixture_training/qwen3_next.py`)")
    method = readme_method(record, script_note, "python -m tools.fixture_training")
    text = f"""# text-qwen3next-mtp

A small Qwen3-Next model with an MTP head ({n_params / 1e6:.2f} M parameters): MoE in every layer
({a.get('experts') or EXPERT_OPTS['num_experts']} experts, top {a.get('top_k') or EXPERT_OPTS['num_experts_per_tok']}, \
and a shared expert), linear attention in layers 0-2 and full attention in layer 3. It is in the
published Qwen3-Next raw layout: flat `model.*` keys, per-expert tensors in the backbone and the MTP
layer, all bf16, every `mtp.*` tensor in the last shard, no MTP field in config.json. It was trained
for mtpconvert's tests of the `qwen3_next` family. The head accepts a realistic share of greedy
drafts, measured in torch on held-out text: {acc['greedy']:.0%} of the tokens of greedy continuations,
{acc['teacher_forced']:.0%} teacher-forced (`acceptance` in training.json says how). A broken
conversion should therefore show up.

`Qwen3NextForCausalLM.from_pretrained` loads the folder (it skips `mtp.*`).

## Licence of the training text

Trained on the pure-Python modules of CPython {manifest['python']}'s standard library, as installed with the
interpreter ({len(manifest['train_files'])} files, {manifest['train_tokens']} tokens; each file's path and SHA-256 are in
training.json). That text is under the {manifest['licence']}. The tokenizer
(byte-level BPE, vocabulary {manifest['vocab_size']}, the Qwen3.5 text fixtures' own) was trained on the same
files. Held out of training (prompts of the tests and benchmarks): {held}.

{method}"""
    (out / "README.md").write_text(text)


def parity_next(args) -> None:
    """from_pretrained(folder) against this module's model with the trained (or the folder's) weights; acceptance."""
    import torch
    from transformers import Qwen3NextForCausalLM

    src = Path(args.folder)
    cfg = json.loads((src / "config.json").read_text())
    assert not {"mtp_num_hidden_layers", "num_nextn_predict_layers"} & set(cfg), "config names an MTP count"
    raw = load_folder(src)
    bad = {k: str(v.dtype) for k, v in raw.items() if v.dtype != torch.bfloat16}
    assert not bad, f"not bf16: {bad}"
    hf, info = Qwen3NextForCausalLM.from_pretrained(src, dtype=torch.float32, output_loading_info=True)
    hf.eval()
    missing, mismatched, unexpected = loading_problems(info, "mtp.")
    print(f"from_pretrained: {len(missing)} missing, {len(mismatched)} mismatched, {len(unexpected)} unexpected "
          f"non-mtp keys")
    shape = {k: cfg[k] for k in EXPERT_OPTS}
    lm, head, _ = build_torch_next(shape)
    if args.run:
        run = Path(args.run)
        ckpt = args.checkpoint or json.loads((src / "training.json").read_text())["checkpoint"]["file"]
        trained = load_checkpoint(run / ckpt)
        print(f"reference: the trained checkpoint {run / ckpt}")
        assert set(split_experts(trained)) == set(raw), "the run's tensors are not the folder's"
        assert all(torch.equal(v.to(torch.bfloat16), raw[k]) for k, v in split_experts(trained).items()), \
            "the folder's tensors differ from the checkpoint's"
        load_into(lm, head, trained)
    else:
        print("reference: the folder's tensors, fused back into this module's model")
        load_into(lm, head, fuse_experts(raw))
    lm.eval(), head.eval()
    stage_ids, ids = parity_ids(args, cfg["vocab_size"])
    tokens = torch.from_numpy(ids.astype(np.int64))[None]
    with torch.no_grad():
        a = hf(input_ids=tokens, use_cache=False).logits[0]
        b, _ = head_logits(lm, head, tokens)
        b = b[0]
    diff = float((a - b).abs().max())
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    print(f"backbone logits: max |from_pretrained - reference| = {diff:.2e} (logit scale {float(a.abs().max()):.1f}), "
          f"argmax agreement {agree:.4f}")
    if stage_ids is not None and args.acceptance:
        acc = acceptance(hf, head, stage_ids)
        print(f"acceptance (from_pretrained backbone + head): teacher-forced {acc['teacher_forced']:.4f} "
              f"({acc['teacher_forced_positions']} positions), greedy {acc['greedy']:.4f} ({acc['greedy_drafts']} drafts)")
    ok = not missing and not mismatched and not unexpected and diff < 1e-4 and agree == 1.0
    sys.exit(0 if ok else 1)
