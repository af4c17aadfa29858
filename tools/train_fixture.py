"""Train the bundled fixture: a tiny Qwen3.5 (dense or MoE) with an MTP head, on the CPU.

The backbone learns the synthetic language (next token); the MTP head learns token
t+2 from the backbone's post-norm state h_t and the embedding of token t+1, the
convention vLLM/SGLang/llama.cpp use at inference. Both share embed_tokens/lm_head.
The result is saved in the raw Hugging Face layout (zero-centred norms, [C,1,K]
conv1d, top-level mtp.*), exactly what `mtpconvert convert` takes from the hub.

    python -m tools.train_fixture --variant dense --steps 1500
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3_5 import Model, ModelArgs

from mtpconvert.fixture import DENSE, MOE
from mtpconvert.fixture.language import MarkovLanguage, write_tokenizer
from mtpconvert.io.shard_writer import write_all
from mtpconvert.families import QWEN3_5

from tools.rawexport import to_raw

VOCAB = 512
TEXT = dict(
    model_type="qwen3_5_text",
    vocab_size=VOCAB,
    hidden_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    attention_bias=False,
    attn_output_gate=True,
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 0], "mrope_interleaved": True},
    dtype="bfloat16",
)
VARIANTS = {
    "dense": dict(intermediate_size=256),
    "moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                norm_topk_prob=True),
}


def hf_config(variant: str) -> dict:
    text = dict(TEXT, **VARIANTS[variant])
    moe = variant == "moe"
    text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    text["layer_types"] = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(4)]
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "5.23.0",
    }


class Trainee(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.backbone = Model(ModelArgs.from_dict(config))
        self.mtp = QWEN3_5.backbone_class()(self.backbone, QWEN3_5, config).make_head(1)

    def losses(self, tokens: mx.array):
        lm = self.backbone.language_model
        h = lm.model(tokens)  # post final norm
        logits = lm.lm_head(h)
        main = nn.losses.cross_entropy(logits[:, :-1], tokens[:, 1:], reduction="mean")
        emb = lm.model.embed_tokens(tokens[:, 1:])
        m = self.mtp(h[:, :-1], emb)
        mtp_logits = lm.lm_head(m)[:, :-1]
        mtp = nn.losses.cross_entropy(mtp_logits, tokens[:, 2:], reduction="mean")
        acc = (mtp_logits.argmax(-1) == tokens[:, 2:]).mean()
        return main, mtp, acc


def mlx_weights(model: Trainee) -> dict:
    """Parameters under mlx-lm's names, MTP under language_model.mtp.*."""
    out = {k: v for k, v in tree_flatten(model.backbone.parameters())}
    out.update({f"language_model.mtp.{k}": v for k, v in tree_flatten(model.mtp.parameters())})
    return out


def train(variant: str, steps: int, batch: int, seq: int, seed: int, log_every: int = 100):
    mx.random.seed(seed)
    lang = MarkovLanguage()
    config = hf_config(variant)
    model = Trainee(config)
    return lang, config, model, _fit(model, lang, steps, batch, seq, seed, log_every)


def _fit(model, lang, steps, batch, seq, seed, log_every):
    rng = np.random.default_rng(seed)
    tok_ids = np.array(word_token_ids(lang))
    opt = optim.AdamW(learning_rate=optim.cosine_decay(3e-3, steps, 3e-4), weight_decay=0.01)

    def loss_fn(m, tokens):
        main, mtp, acc = m.losses(tokens)
        return main + mtp, (main, mtp, acc)

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(tokens):
        (loss, aux), grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss, aux

    history = []
    t0 = time.time()
    for i in range(steps):
        tokens = mx.array(tok_ids[lang.batch(batch, seq, rng)])
        loss, (main, mtp, acc) = step(tokens)
        mx.eval(state, loss)
        if i % log_every == 0 or i == steps - 1:
            rec = dict(step=i, loss=float(loss), main=float(main), mtp=float(mtp), mtp_acc=float(acc),
                       seconds=round(time.time() - t0, 1))
            history.append(rec)
            print(json.dumps(rec), flush=True)
    return history


_WORD_IDS = {}


def word_token_ids(lang: MarkovLanguage):
    key = tuple(lang.words)
    if key not in _WORD_IDS:
        from mtpconvert.fixture.language import build_tokenizer, word_ids

        _WORD_IDS[key] = word_ids(build_tokenizer(lang.words, VOCAB), lang.words)
    return _WORD_IDS[key]


def save_raw(model: Trainee, config: dict, lang: MarkovLanguage, out: Path, experts: str, history) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float32) for k, v in mlx_weights(model).items()}
    raw = to_raw(weights, experts=experts)
    # Stored like the Qwen3.5 release: BF16, with A_log and the gated norm in F32.
    stored = {k: (v if k.endswith(("A_log", "linear_attn.norm.weight")) else v.astype(mx.bfloat16))
              for k, v in sorted(raw.items())}
    write_all(out / "model.safetensors", stored, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 2}, indent=2) + "\n")
    write_tokenizer(out, lang.words, VOCAB)
    (out / "training.json").write_text(json.dumps({"history": history}, indent=1) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="dense")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", default="published35", help="expert layout for MoE: per_expert, fused, published35")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    lang, config, model, history = train(args.variant, args.steps, args.batch, args.seq, args.seed)
    out = args.out or (DENSE if args.variant == "dense" else MOE)
    save_raw(model, config, lang, out, args.experts, history)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
