"""The Qwen3.5 text fixtures (``--variant dense|moe``): config, model, the train loop (Qwen3-Next's too),
the raw layout, export and parity.

Trained with transformers' own ``Qwen3_5[Moe]ForCausalLM`` and an MTP head of its decoder layer and norm
(heads.build_with); exported as the Qwen3.5 release stores it: ``model.language_model.*``, top-level
``mtp.*``, bf16 with ``A_log`` and the gated norm in f32, the MoE backbone's experts fused and the MTP
layer's per expert.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from tools.fixture_training.corpus import EOS_ID, PAD_ID, VOCAB
from tools.fixture_training.folders import (REPO, checkpoint_step, load_checkpoint, logged_at, parity_ids,
                                            provenance, write_tokenizer_and_generation)
from tools.fixture_training.heads import build_with, forward_losses, is_moe, torch_state
from tools.fixture_training.training import (adamw, apply_gradients, finish_run, final_norm_gain, heldout_evaluator,
                                             is_log_step, learning_rate, log_points, log_record, open_run,
                                             param_count, plan_steps, print_run_header, save_checkpoint,
                                             step_record, window_sampler)

SCRIPT = "tools/fixture_training"  # training.json's "script": python -m tools.fixture_training
FIXTURES = {"dense": REPO / "mtpconvert/fixture/data/text-qwen35-mtp",
            "moe": REPO / "mtpconvert/fixture/data/text-qwen35-moe-mtp"}

# ---------------------------------------------------------------------------------------------
# Model configuration (the raw config.json, shaped like the Qwen3.5 releases')
# ---------------------------------------------------------------------------------------------
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=48,
    linear_value_head_dim=48,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    attention_bias=False,
    attention_dropout=0.0,
    attn_output_gate=True,
    initializer_range=0.02,
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 2, 2], "mrope_interleaved": True},
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)

VARIANTS = {
    "dense": dict(intermediate_size=512),
    "moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                norm_topk_prob=True, router_aux_loss_coef=0.01),
}


# train/export options that override VARIANTS["moe"] (None: keep the variant's value)
MOE_SHAPE = {"experts": "num_experts", "top_k": "num_experts_per_tok", "expert_size": "moe_intermediate_size",
             "shared_expert_size": "shared_expert_intermediate_size"}


def moe_shape(args) -> dict:
    """The MoE sizes given on the command line, as config keys (train's args, or the run's logged args)."""
    given = args if isinstance(args, dict) else vars(args)
    return {key: given[opt] for opt, key in MOE_SHAPE.items() if given.get(opt) is not None}


def text_config(variant: str, shape: dict = None) -> dict:
    cfg = dict(TEXT, **VARIANTS[variant])
    if shape:
        if variant != "moe":
            raise ValueError("MoE sizes apply to --variant moe only")
        cfg.update(shape)
    cfg["model_type"] = "qwen3_5_moe_text" if variant == "moe" else "qwen3_5_text"
    return cfg


def hf_config(variant: str, shape: dict = None) -> dict:
    moe = variant == "moe"
    text = dict(text_config(variant, shape), dtype="bfloat16")
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "5.23.0",
    }


F32_SUFFIXES = ("A_log", "linear_attn.norm.weight")  # stored f32 in the Qwen3.5 releases


def torch_classes(variant: str):
    if variant == "moe":
        from transformers import Qwen3_5MoeForCausalLM as LM, Qwen3_5MoeTextConfig as Config
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer as Layer, Qwen3_5MoeRMSNorm as Norm)
    else:
        from transformers import Qwen3_5ForCausalLM as LM, Qwen3_5TextConfig as Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as Layer, Qwen3_5RMSNorm as Norm
    return LM, Config, Layer, Norm


def build_torch(variant: str, shape: dict = None):
    """(backbone Qwen3_5[Moe]ForCausalLM, MTP head module, transformers config)."""
    LM, Config, Layer, Norm = torch_classes(variant)
    cfg = {k: v for k, v in text_config(variant, shape).items() if k != "model_type"}
    return build_with(LM, Config(**cfg), Layer, Norm)


# ---------------------------------------------------------------------------------------------
# train (torch + transformers only)
# ---------------------------------------------------------------------------------------------
def train(args, build=None, f32_suffixes=F32_SUFFIXES) -> None:
    """Train a backbone and its MTP head: ``build()`` makes (lm, head, config) once the run has seeded torch
    (default: the Qwen3.5 model of --variant); the checkpoints keep the tensors named ``*f32_suffixes`` in float32.
    Qwen3-Next trains here too (qwen3_next.train_next)."""
    import torch

    out, dev, rng, train_ids, held_ids = open_run(args)
    lm, head, config = build() if build else build_torch(args.variant, moe_shape(args))
    if getattr(args, "experts_implementation", None) and is_moe(config):
        lm.set_experts_implementation(args.experts_implementation)  # the head shares lm's config
    if args.final_norm_spread > 1:
        gen = torch.Generator().manual_seed(args.seed + 1)
        gain = final_norm_gain(args.final_norm_spread, config.hidden_size, gen)
        with torch.no_grad():
            lm.model.norm.weight.copy_(gain - 1)  # zero-centred: the norm multiplies by 1 + weight
            head.norm.weight.copy_(gain - 1)  # mtp.norm feeds the same lm_head
    lm.to(dev).train()
    head.to(dev).train()
    n_params = param_count(lm, head)

    router_logits = []
    if is_moe(config):
        def keep(_module, _inputs, output):  # the router's logits (first of its outputs)
            router_logits.append(output[0] if isinstance(output, tuple) else output)
        for name, mod in list(lm.named_modules()) + [(f"mtp.{n}", m) for n, m in head.named_modules()]:
            if name.endswith("mlp.gate"):
                mod.register_forward_hook(keep)
    aux_coef = getattr(config, "router_aux_loss_coef", 0.0) if is_moe(config) else 0.0

    opt = adamw(lm, head, args, dev, no_decay_suffixes=("A_log", "dt_bias"))
    batch = window_sampler(train_ids, rng, args.seq, args.batch)
    evaluate = heldout_evaluator(lm, head, held_ids, args, router_logits, aux_coef)

    def one_step(step, total):
        loss, main, mtp, aux, st = forward_losses(lm, head, batch(), router_logits, aux_coef)
        gn = apply_gradients(opt, lm, head, loss, learning_rate(args, step, total), args.clip)
        return loss.detach(), main.detach(), mtp.detach(), aux.detach(), st, gn

    print_run_header(dev, n_params)
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
            save_checkpoint(torch_state(lm, head, f32_suffixes), out, step, saved)
    finish_run(out, args, dev, n_params, total, t0, saved, history)


# ---------------------------------------------------------------------------------------------
# export (raw Hugging Face layout) and parity
# ---------------------------------------------------------------------------------------------
def raw_names(state: dict) -> dict:
    """transformers' ForCausalLM names + mtp.* -> the published Qwen3.5 raw layout (tensors unchanged).

    The backbone keeps transformers' fused experts (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]); the MTP layer's experts are written one by one, as the
    Qwen3.5 MoE release has them. Norms are zero-centred and conv1d is [C, 1, K] in both.
    """
    out = {}
    for k, v in state.items():
        if k.startswith("mtp.") and k.endswith("mlp.experts.gate_up_proj"):
            mlp = k[: -len(".gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{mlp}.{e}.gate_proj.weight"] = v[e, :inter]
                out[f"{mlp}.{e}.up_proj.weight"] = v[e, inter:]
        elif k.startswith("mtp.") and k.endswith("mlp.experts.down_proj"):
            mlp = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                out[f"{mlp}.{e}.down_proj.weight"] = v[e]
        elif k.startswith("model."):
            out["model.language_model." + k[len("model."):]] = v
        elif k.startswith(("mtp.", "lm_head.")):
            out[k] = v
        else:
            raise ValueError(f"unexpected tensor {k}")
    return out


def export(args) -> None:
    import mlx.core as mx

    from mtpconvert.io.shard_writer import write_all

    stage, run = Path(args.stage), Path(args.run)
    out = Path(args.out or FIXTURES[args.variant])
    log = json.loads((run / "log.json").read_text())
    ckpt = args.checkpoint or log["checkpoints"][-1]
    state = raw_names(load_checkpoint(run / ckpt))
    stored = {}
    for k, v in sorted(state.items()):
        a = mx.array(v.float().numpy())
        stored[k] = a if k.endswith(F32_SUFFIXES) else a.astype(mx.bfloat16)  # bf16 -> f32 -> bf16 is exact
    out.mkdir(parents=True, exist_ok=True)
    write_all(out / "model.safetensors", stored, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(args.variant, moe_shape(log["args"])), indent=4) + "\n")
    write_tokenizer_and_generation(out, stage)
    manifest = json.loads((stage / "manifest.json").read_text())
    step = checkpoint_step(ckpt)
    record = {**provenance(SCRIPT, args.commands, manifest, log, ckpt), "final": logged_at(log, step),
              "history": log["history"]}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    size = (out / "model.safetensors").stat().st_size
    n = sum(v.numel() for v in state.values())
    print(f"wrote {out} ({size / 1e6:.2f} MB, {n / 1e6:.2f} M parameters, step {step})")


def parity(args) -> None:
    """transformers (torch, f32, CPU) on the raw folder vs MLX on its `mtpconvert convert` output."""
    import subprocess
    import tempfile

    import mlx.core as mx
    import torch

    from mtpconvert.runtime.decoding.load import load

    src = Path(args.folder)
    cfg = json.loads((src / "config.json").read_text())
    variant = "moe" if "moe" in cfg["model_type"] else "dense"
    raw = load_checkpoint(src / "model.safetensors")
    state = {}  # raw -> transformers names (inverse of raw_names)
    for k, v in raw.items():
        state[("model." + k[len("model.language_model."):]) if k.startswith("model.language_model.") else k] = v.float()
    text = cfg["text_config"]
    lm, head, _ = build_torch(variant, {k: text[k] for k in MOE_SHAPE.values()} if variant == "moe" else None)
    mtp_state = {k[4:]: v for k, v in state.items() if k.startswith("mtp.")}
    if variant == "moe":  # per-expert MTP experts -> fused
        E = cfg["text_config"]["num_experts"]
        pre = "layers.0.mlp.experts"
        mtp_state[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([mtp_state.pop(f"{pre}.{e}.gate_proj.weight"),
                                                                   mtp_state.pop(f"{pre}.{e}.up_proj.weight")])
                                                        for e in range(E)])
        mtp_state[f"{pre}.down_proj"] = torch.stack([mtp_state.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
    lm.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")}, strict=True)
    head.load_state_dict(mtp_state, strict=True)
    lm.eval(), head.eval()
    ids = parity_ids(args, cfg["text_config"]["vocab_size"])[1].astype(np.int64)
    tokens = torch.from_numpy(ids)[None]
    with torch.no_grad():
        h = lm.model(input_ids=tokens).last_hidden_state
        t_logits = lm.lm_head(h)[0].numpy()
        pos = torch.arange(tokens.shape[1] - 1)[None, None].expand(3, 1, -1)
        m = head(h[:, :-1], lm.model.embed_tokens(tokens[:, 1:]), lm.model.rotary_emb(h, pos))
        t_mtp = lm.lm_head(m)[0].numpy()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "f32"
        subprocess.run([sys.executable, "-m", "mtpconvert", "convert", str(src), str(out), "--dtype", "float32",
                        "--no-smoke"], check=True, cwd=REPO, capture_output=True)
        mm = load(out)
        x = mx.array(ids[None])
        cache = mm.model.make_cache()
        _, post = mm.backbone.forward(x, cache)
        m_logits = np.array(mm.logits(post)[0])
        hm = mm.head(post[:, :-1], mm.embed(x[:, 1:]))
        m_mtp = np.array(mm.logits(hm)[0])

    def report(name, a, b):
        agree = float((a.argmax(-1) == b.argmax(-1)).mean())
        print(f"{name}: max |torch - mlx| = {np.abs(a - b).max():.2e} (logit scale {np.abs(a).max():.1f}), "
              f"argmax agreement {agree:.4f}")
        return agree

    ok = report("backbone logits", t_logits, m_logits) > 0.99 and report("MTP logits", t_mtp, m_mtp) > 0.99
    sys.exit(0 if ok else 1)
