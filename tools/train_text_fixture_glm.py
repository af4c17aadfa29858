"""GLM-5 (``glm_moe_dsa``) specifics of tools/train_text_fixture.py (``--variant glm5``): the text fixture
``text-glm5-mtp``.

The backbone is transformers' own ``GlmMoeDsaForCausalLM``: 4 layers, layer 0 dense
(``first_k_dense_replace`` 1) and layers 1-3 MoE (8 routed experts, top 2, sigmoid ``noaux_tc`` routing with
``e_score_correction_bias``, 1 shared expert), MLA attention (``q_lora_rank``, ``kv_lora_rank``, split
nope/rope heads) and a DSA indexer in every layer whose ``index_topk`` (256) keeps it dense up to 256 tokens.
It is trained on the same stage (corpus, tokenizer, token ids) as the Qwen3.5 text fixtures.

The MTP ("nextn") head is GLM-5's / DeepSeek-V3's: ``h' = eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])``
with ``h_t`` the backbone's state after ``model.norm`` and ``embed`` the backbone's ``embed_tokens`` (GLM-5
ships no embedding in its nextn layer), one full ``GlmMoeDsaDecoderLayer`` (MoE + shared expert, MLA with
its own indexer), ``shared_head.norm``, and the backbone's ``lm_head`` (GLM-5 ships no ``shared_head.head``).
Plain RMSNorms (``x * w``). It is trained next to the backbone to predict token t+2.

Training differs from the Qwen variants in two GLM points: the routers are balanced the auxiliary-loss-free
way (after each step every router's ``e_score_correction_bias`` moves by ``--bias-rate`` against the sign
of its experts' load imbalance, as DeepSeek-V3 does), and the indexers are not trained (transformers
computes them under ``no_grad``; they stay at their initialisation, ``k_norm`` drawn around 1 / 0 so that
its weight and bias are not trivial tensors). A run can stop after ``--chunk-seconds`` and continue from
``OUT/resume.pt`` when started again with the same arguments (exit status 3 until it is done).

export writes the raw Hugging Face release layout: flat ``model.*`` keys, every expert one by one
(``mlp.experts.{e}.{gate,up,down}_proj.weight``), ``mlp.gate.e_score_correction_bias`` in F32 and every other
tensor in bf16, the nextn layer at ``model.layers.{num_hidden_layers}.*`` (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` and the whole decoder block, indexer included; no ``embed_tokens``, no
``shared_head.head``) in the last shard ``model-00002-of-00002`` and the rest in ``model-00001-of-00002``,
an index, and a config.json carrying what transformers' ``GlmMoeDsaConfig`` and mlx-lm's ``glm_moe_dsa``
``ModelArgs`` read (``num_nextn_predict_layers`` 1, ``topk_method``, ``scoring_func``, ``moe_layer_freq``,
``rope_parameters``, the ``index_*`` fields). It then measures the head's acceptance in torch on the
written folder (greedy k=1 with a bootstrap interval over prompts, teacher-forced, and two broken heads),
compares mlx-lm's float32 logits on the folder with transformers', and writes training.json and README.md.

parity re-checks a folder: dtypes, the key set (and that the backbone's is what ``save_pretrained``
writes), ``GlmMoeDsaForCausalLM.from_pretrained`` against this script's model, mlx-lm against
transformers; ``--acceptance`` measures the head again. mlx-vlm runs the folder's head as mlx-vlm 0.7.10's
``glm_moe_dsa_mtp`` drafter (root-folder route) and measures its greedy acceptance; run it with the
interpreter of a venv holding mlx-vlm (it needs no torch).

    python tools/train_text_fixture.py prepare --stage /tmp/stage
    python tools/train_text_fixture_glm.py train --stage /tmp/stage --out /tmp/run-glm5 --steps 3000
    python tools/train_text_fixture_glm.py export --stage /tmp/stage --run /tmp/run-glm5
    python tools/train_text_fixture_glm.py parity mtpconvert/fixture/data/text-glm5-mtp --stage /tmp/stage
    VENV/bin/python tools/train_text_fixture_glm.py mlx-vlm mtpconvert/fixture/data/text-glm5-mtp --stage /tmp/stage

(``python tools/train_text_fixture.py train|export --variant glm5 ...`` and ``parity FOLDER`` reach the same code.)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_text_fixture as base  # noqa: E402  (train_text_fixture.py puts itself here when it runs as __main__)

FIXTURE = base.REPO / "mtpconvert/fixture/data/text-glm5-mtp"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")  # backbone, nextn layer
F32_SUFFIXES = ("e_score_correction_bias",)  # stored F32 in GLM releases; everything else bf16

# The model's sizes (config keys); train's options (--hidden-size, --layers, --experts, --top-k,
# --expert-size, --index-topk) override them and the run's logged args carry them to export.
GLM_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=4,  # layer 0 dense, 1-3 MoE; the nextn layer is layer 4
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=384,  # the dense MLP of layer 0
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=256,  # the indexer keeps every key up to 256 of them: dense attention for the fixture's lengths
)
SHAPE_OPTS = {"hidden_size": "hidden_size", "layers": "num_hidden_layers", "experts": "n_routed_experts",
              "top_k": "num_experts_per_tok", "expert_size": "moe_intermediate_size", "index_topk": "index_topk"}


def shape_of(given) -> dict:
    """The model's sizes: GLM_SHAPE with train's options (argparse namespace or a run's logged args) over it."""
    given = given if isinstance(given, dict) else vars(given)
    if given.get("shared_expert_size") is not None:
        raise ValueError("--shared-expert-size: GLM's shared expert is n_shared_experts x moe_intermediate_size")
    return dict(GLM_SHAPE, **{key: given[opt] for opt, key in SHAPE_OPTS.items() if given.get(opt) is not None})


def glm_config(shape: dict = None) -> dict:
    """The raw config.json: GLM-5's keys (those GlmMoeDsaConfig and mlx-lm's glm_moe_dsa ModelArgs read), sorted."""
    import transformers

    s = dict(GLM_SHAPE, **(shape or {}))
    cfg = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "eos_token_id": base.TEXT["eos_token_id"],  # <|im_end|>
        "first_k_dense_replace": 1,
        "head_dim": s["qk_rope_head_dim"],  # GLM-5's config has head_dim = qk_rope_head_dim (transformers sets it so)
        "hidden_act": "silu",
        "hidden_size": s["hidden_size"],
        "index_head_dim": s["index_head_dim"],
        "index_n_heads": s["index_n_heads"],
        "index_topk": s["index_topk"],
        "indexer_rope_interleave": True,
        "initializer_range": base.TEXT["initializer_range"],
        "intermediate_size": s["intermediate_size"],
        "kv_lora_rank": s["kv_lora_rank"],
        "max_position_embeddings": base.TEXT["max_position_embeddings"],
        "model_type": "glm_moe_dsa",
        "moe_intermediate_size": s["moe_intermediate_size"],
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": s["n_routed_experts"],
        "n_shared_experts": s["n_shared_experts"],
        "norm_topk_prob": True,
        "num_attention_heads": s["num_attention_heads"],
        "num_experts_per_tok": s["num_experts_per_tok"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_key_value_heads": s["num_key_value_heads"],
        "num_nextn_predict_layers": 1,
        "pad_token_id": base.TEXT["pad_token_id"],  # <|endoftext|>
        "q_lora_rank": s["q_lora_rank"],
        "qk_nope_head_dim": s["qk_nope_head_dim"],
        "qk_rope_head_dim": s["qk_rope_head_dim"],
        "rms_norm_eps": 1e-05,
        "rope_interleave": True,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "v_head_dim": s["v_head_dim"],
        "vocab_size": base.VOCAB,
    }
    unknown = set(shape or {}) - set(cfg)
    if unknown:
        raise ValueError(f"not GLM config keys: {sorted(unknown)}")
    return cfg


def build_torch_glm(shape: dict = None):
    """(GlmMoeDsaForCausalLM, nextn head, config): the config is the one config.json loads into."""
    import torch
    import torch.nn as nn
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm

    config = GlmMoeDsaConfig.from_dict(glm_config(shape))
    config._attn_implementation = "sdpa"
    n = config.num_hidden_layers
    assert config.mlp_layer_types == ["dense"] + ["sparse"] * (n - 1), config.mlp_layer_types
    assert config.indexer_types == ["full"] * n, config.indexer_types
    lm = GlmMoeDsaForCausalLM(config)

    class NextNLayer(GlmMoeDsaDecoderLayer):
        """Layer ``num_hidden_layers`` of the release: enorm, hnorm, eh_proj, a MoE decoder block, shared_head.norm.

        Its state-dict names are the release's names under ``model.layers.{N}.``.
        """

        def __init__(self):
            config.mlp_layer_types.append("sparse")  # layer N: MoE, its own ("full") indexer
            config.indexer_types.append("full")
            try:
                super().__init__(config, n)
            finally:
                config.mlp_layer_types.pop()
                config.indexer_types.pop()
            H, eps = config.hidden_size, config.rms_norm_eps
            self.enorm = GlmMoeDsaRMSNorm(H, eps=eps)
            self.hnorm = GlmMoeDsaRMSNorm(H, eps=eps)
            self.eh_proj = nn.Linear(2 * H, H, bias=False)
            self.shared_head = nn.Module()
            self.shared_head.norm = GlmMoeDsaRMSNorm(H, eps=eps)

        def forward(self, hidden, next_embeddings, position_embeddings):
            """Row t: (h_t, embedding of token t+1) -> the normed state whose lm_head logits draft token t+2."""
            x = self.eh_proj(torch.cat([self.enorm(next_embeddings), self.hnorm(hidden)], dim=-1))
            L = x.shape[1]
            mask = torch.full((L, L), torch.finfo(x.dtype).min, device=x.device, dtype=x.dtype).triu(1)[None, None]
            pos = torch.arange(L, device=x.device)[None]
            out, _ = super().forward(x, attention_mask=mask, position_ids=pos, position_embeddings=position_embeddings)
            return self.shared_head.norm(out)

    head = NextNLayer()
    for m in head.modules():  # the backbone's init (normal 0.02, norms at 1, router bias 0)
        lm._init_weights(m)
    return lm, head, config


# ---------------------------------------------------------------------------------------------
# names: transformers (fused experts, head under mtp.*) <-> the release's raw layout
# ---------------------------------------------------------------------------------------------
def nextn_prefix(cfg) -> str:
    n = cfg["num_hidden_layers"] if isinstance(cfg, dict) else cfg.num_hidden_layers
    return f"model.layers.{n}."


def raw_names(state: dict, cfg) -> dict:
    """checkpoint names (``model.*``, ``lm_head.*``, the head's ``mtp.*``) -> the release's: head at layer N,
    experts split."""
    pre = nextn_prefix(cfg)
    renamed = {(pre + k[4:] if k.startswith("mtp.") else k): v for k, v in state.items()}
    return base.next_module().raw_names(renamed)


def fused_names(raw: dict, cfg) -> dict:
    """The inverse of raw_names."""
    pre = nextn_prefix(cfg)
    fused = base.next_module().fused_names(raw)
    return {("mtp." + k[len(pre):] if k.startswith(pre) else k): v for k, v in fused.items()}


def expected_keys(cfg: dict) -> set:
    """The release's tensor names for this config (GLM-5's; nextn layer without embed_tokens / shared_head.head)."""
    attn = [f"self_attn.{m}.weight" for m in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                               "kv_a_layernorm", "kv_b_proj", "o_proj")]
    attn += [f"self_attn.indexer.{m}" for m in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                                                "weights_proj.weight")]
    common = ["input_layernorm.weight", "post_attention_layernorm.weight"] + attn
    dense = [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    moe = ["mlp.gate.weight", "mlp.gate.e_score_correction_bias"]
    moe += [f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
    moe += [f"mlp.experts.{e}.{p}_proj.weight" for e in range(cfg["n_routed_experts"]) for p in ("gate", "up", "down")]
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    n = cfg["num_hidden_layers"]
    for i in range(n + 1):
        mlp = dense if i < cfg["first_k_dense_replace"] else moe
        keys |= {f"model.layers.{i}.{k}" for k in common + mlp}
    keys |= {f"model.layers.{n}.{k}" for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                               "shared_head.norm.weight")}
    return keys


def split_state(state: dict, cfg) -> dict:
    """The folder's key -> shard file: the nextn layer in the last shard, the rest in the first."""
    pre = nextn_prefix(cfg)
    return {k: SHARDS[1] if k.startswith(pre) else SHARDS[0] for k in sorted(state)}


def load_folder(folder: Path) -> dict:
    return base.next_module().load_folder(Path(folder))


def load_into(lm, head, fused: dict) -> None:
    base.next_module().load_into(lm, head, fused)


# ---------------------------------------------------------------------------------------------
# train (torch + transformers only; CUDA when there is one)
# ---------------------------------------------------------------------------------------------
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
    out, dev, rng, train_ids, held_ids = base.open_run(args)
    if args.seq > shape_of(args)["index_topk"]:
        raise SystemExit(f"--seq {args.seq} > index_topk: the (untrained) indexer would make attention sparse")
    lm, head, config = build_torch_glm(shape_of(args))
    if getattr(args, "experts_implementation", None):
        lm.set_experts_implementation(args.experts_implementation)  # the head shares lm's config
    with torch.no_grad():
        gen = torch.Generator().manual_seed(args.seed + 1)
        if args.final_norm_spread > 1:
            gain = base.final_norm_gain(args.final_norm_spread, config.hidden_size, gen)
            lm.model.norm.weight.copy_(gain)  # GLM's norms are x * w
            head.shared_head.norm.weight.copy_(gain)  # feeds the same lm_head
        for mod in list(lm.modules()) + list(head.modules()):
            if isinstance(mod, GlmMoeDsaIndexer):  # never trained: give k_norm non-trivial values
                mod.k_norm.weight.copy_(1 + 0.1 * torch.randn(mod.k_norm.weight.shape, generator=gen))
                mod.k_norm.bias.copy_(0.1 * torch.randn(mod.k_norm.bias.shape, generator=gen))
    lm.to(dev).train()
    head.to(dev).train()
    n_params = base.param_count(lm, head)

    routers = [m for m in list(lm.modules()) + list(head.modules()) if isinstance(m, GlmMoeDsaTopkRouter)]
    loads = {id(r): torch.zeros(r.num_experts, device=dev) for r in routers}

    def count(module, _inputs, output):  # (router_logits, topk_weights, topk_indices)
        if module.training:
            loads[id(module)] += torch.bincount(output[2].flatten(), minlength=module.num_experts).float()

    for r in routers:
        r.register_forward_hook(count)

    opt = base.adamw(lm, head, args, dev)
    batch = base.window_sampler(train_ids, rng, args.seq, args.batch)
    evaluate = base.heldout_evaluator(lm, head, held_ids, args)

    def one_step(step, total):
        loss, main, mtp, _, st = base.forward_losses(lm, head, batch())
        gn = base.apply_gradients(opt, lm, head, loss, base.learning_rate(args, step, total), args.clip)
        with torch.no_grad():  # auxiliary-loss-free balancing: raise the bias of under-loaded experts
            imbalance = []
            for r in routers:
                load = loads[id(r)]
                r.e_score_correction_bias += bias_rate * torch.sign(load.mean() - load)
                imbalance.append(load.max() / load.mean().clamp_min(1))
                load.zero_()
        return loss.detach(), main.detach(), mtp.detach(), st, gn, torch.stack(imbalance).max()

    resume = out / "resume.pt"
    logged_args = base.run_args(args)
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
        base.print_run_header(dev, n_params, experts_implementation=config._experts_implementation)
        step, total = base.plan_steps(one_step, args, dev, t_call)
    saves, log_every = base.log_points(args, total)
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
        if base.is_log_step(step, total, saves, log_every):
            rec = base.step_record(step, base.learning_rate(args, step - 1, total), loss, main, mtp, st, gn,
                                   time.time() - t0, max_load_ratio=imb)
            base.log_record(rec, step, args, saves, log_every, evaluate, history)
        if step in saves:
            base.save_checkpoint(base.torch_state(lm, head, F32_SUFFIXES), out, step, saved)
    bias = {f"{i}": [round(float(x), 4) for x in r.e_score_correction_bias] for i, r in enumerate(routers)}
    base.finish_run(out, args, dev, n_params, total, t0, saved, history, e_score_correction_bias=bias)
    if resume.exists():
        resume.unlink()


# ---------------------------------------------------------------------------------------------
# acceptance (torch)
# ---------------------------------------------------------------------------------------------
def head_logits(lm, head, tokens, hidden: str = "post-norm"):
    """(backbone logits [B, L, V], head logits [B, L-1, V]); row t drafts token t+2 from (h_t, token t+1).

    ``hidden="pre-norm"`` feeds the head the backbone's state before ``model.norm`` (a broken converter's mistake).
    """
    import torch
    import torch.nn as nn

    with torch.no_grad():
        h = lm.model(input_ids=tokens).last_hidden_state
        h_in = h
        if hidden == "pre-norm":
            norm, lm.model.norm = lm.model.norm, nn.Identity()
            try:
                h_in = lm.model(input_ids=tokens).last_hidden_state
            finally:
                lm.model.norm = norm
        B, L = tokens.shape
        pe = lm.model.rotary_emb(h, base.head_positions(lm.config, B, L - 1, tokens.device))
        m = head(h_in[:, :-1], lm.model.embed_tokens(tokens[:, 1:]), pe)
        return lm.lm_head(h), lm.lm_head(m)


def bootstrap_ci(hits: np.ndarray, totals: np.ndarray, n: int = 2000, seed: int = 0) -> list:
    """95% percentile-bootstrap interval of sum(hits)/sum(totals), resampling the units (prompts)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, hits.size, size=(n, hits.size))
    est = hits[idx].sum(1) / np.maximum(totals[idx].sum(1), 1)
    return [round(float(np.percentile(est, 2.5)), 4), round(float(np.percentile(est, 97.5)), 4)]


def greedy_prompts(held: np.ndarray, eot: int = 0, prompt: int = 64, per_file: int = 3) -> list:
    """``per_file`` prompts of ``prompt`` held-out tokens from each held-out file, at 1/(per_file+1), 2/..., of it."""
    out = []
    for doc in np.split(held, np.flatnonzero(held == eot) + 1):
        if doc.size < 2 * prompt:
            continue
        for j in range(per_file):
            s = min(int(doc.size * (j + 1) / (per_file + 1)), doc.size - prompt)
            out.append(doc[s: s + prompt].astype(np.int64))
    return out


def continuations(lm, prompts: list, generate: int = 64, eot: int = 0):
    """The backbone's greedy continuations (``generate()``, KV cache, one batch) of the prompts:
    [P, prompt + generate]."""
    import torch

    lm.eval()
    ids = torch.from_numpy(np.stack(prompts))  # prompts of one length: one batch, no padding
    with torch.no_grad():
        return lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=generate,
                           min_new_tokens=generate, do_sample=False, eos_token_id=None, pad_token_id=eot)


def greedy_acceptance(lm, head, seqs, prompt: int, hidden: str = "post-norm") -> dict:
    """Share of generated tokens t+2 (t+1 the prompt's last token or later) that the head's argmax from (h_t, t+1)
    equals."""
    import torch

    lm.eval(), head.eval()
    _, mtp = head_logits(lm, head, seqs, hidden)
    draft = mtp.argmax(-1)  # [P, L-1]: row t drafts token t+2
    t = torch.arange(prompt - 1, seqs.shape[1] - 2)
    hits = (draft[:, t] == seqs[:, t + 2]).sum(1).numpy()
    totals = np.full(hits.size, t.numel())
    return {"greedy": round(float(hits.sum() / max(totals.sum(), 1)), 4), "greedy_ci95": bootstrap_ci(hits, totals),
            "greedy_drafts": int(totals.sum()), "greedy_by_prompt": [round(h / t, 4) for h, t in zip(hits, totals)]}


def teacher_forced(lm, head, held: np.ndarray, seq: int, batch: int = 16) -> dict:
    """Share of positions t of held-out windows where the head's argmax (h_t, true t+1) equals the backbone's
    argmax at t+1."""
    import torch

    lm.eval(), head.eval()
    starts = np.arange(0, held.size - seq, seq)
    hits = []
    for i in range(0, len(starts), batch):
        tokens = torch.from_numpy(np.stack([held[s: s + seq] for s in starts[i: i + batch]]).astype(np.int64))
        logits, mtp = head_logits(lm, head, tokens)
        hits += (mtp[:, :-1].argmax(-1) == logits[:, 1:-1].argmax(-1)).sum(1).tolist()
    hits = np.array(hits)
    totals = np.full(hits.size, seq - 2)
    return {"teacher_forced": round(float(hits.sum() / totals.sum()), 4),
            "teacher_forced_ci95": bootstrap_ci(hits, totals),
            "teacher_forced_positions": int(totals.sum()), "teacher_forced_windows": int(hits.size)}


def swapped_halves(head):
    """A context manager: eh_proj's two input halves swapped (a bad conversion's concat order [hnorm(h), enorm(e)])."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def cm():
        w = head.eh_proj.weight
        H = w.shape[0]
        keep = w.detach().clone()
        with torch.no_grad():
            w.copy_(torch.cat([keep[:, H:], keep[:, :H]], dim=1))
        try:
            yield
        finally:
            with torch.no_grad():
                w.copy_(keep)
    return cm()


def acceptance_glm(lm, head, held: np.ndarray, seq: int, eot: int = 0, prompt: int = 64, generate: int = 64,
                   per_file: int = 3, broken: bool = True) -> dict:
    """Torch measurements of the head on held-out text (the stage's heldout.npy):

    greedy          ``per_file`` ``prompt``-token prompts from each held-out file (at 1/4, 1/2 and 3/4 of it),
                    continued greedily by the backbone (``generate()``, KV cache, the prompts in one batch) for
                    ``generate`` tokens; share of the generated tokens t+2 (t+1 the prompt's last token or later)
                    that the head's argmax from (h_t, t+1) equals: the greedy acceptance of one draft per step
                    (k=1). 95% interval: percentile bootstrap over prompts (2000 resamples)
    teacher_forced  every window of ``seq`` held-out tokens: share of positions t where the head's argmax (from h_t
                    and the true token t+1) equals the backbone's argmax at t+1 (its greedy token t+2); the
                    training log's "agree". Interval: bootstrap over windows
    broken          the greedy measurement with the head fed wrongly: eh_proj's halves swapped (concat order
                    reversed), and the backbone's pre-final-norm state as h_t
    """
    t0 = time.time()
    prompts = greedy_prompts(held, eot, prompt, per_file)
    seqs = continuations(lm, prompts, generate, eot)
    out = {**greedy_acceptance(lm, head, seqs, prompt), **teacher_forced(lm, head, held, seq),
           "prompts": len(prompts), "prompt_tokens": prompt, "generated_tokens": generate}
    if broken:
        with swapped_halves(head):
            sw = greedy_acceptance(lm, head, seqs, prompt)
        pre = greedy_acceptance(lm, head, seqs, prompt, hidden="pre-norm")
        out["broken"] = {"eh_proj_halves_swapped": {k: sw[k] for k in ("greedy", "greedy_ci95")},
                         "pre_norm_hidden": {k: pre[k] for k in ("greedy", "greedy_ci95")}}
    out["seconds"] = round(time.time() - t0, 1)
    out["method"] = acceptance_glm.__doc__.split("\n\n", 1)[1].strip()
    return out


# ---------------------------------------------------------------------------------------------
# mlx-lm against transformers (float32)
# ---------------------------------------------------------------------------------------------
def mlx_lm_parity(folder: Path, hf, ids: np.ndarray, prefill: int = 16) -> dict:
    """mlx-lm's ``load_model`` (strict; it drops layer N itself) on the folder, float32, against transformers' logits.

    ``full``: one forward over the ids. ``incremental``: ``prefill`` ids, then one id at a time through mlx-lm's
    cache (the absorbed-MLA decode path) against the same rows of transformers' full forward.
    """
    import mlx.core as mx
    import torch
    from mlx.utils import tree_map
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    import mlx_lm

    model, _ = load_model(Path(folder), strict=True)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids.astype(np.int64))[None], use_cache=False).logits[0].float().numpy()
    full = np.array(model(mx.array(ids[None].astype(np.int32)))[0])
    cache = make_prompt_cache(model)
    rows = [np.array(model(mx.array(ids[None, :prefill].astype(np.int32)), cache=cache)[0])]
    for i in range(prefill, ids.size):
        rows.append(np.array(model(mx.array(ids[None, i: i + 1].astype(np.int32)), cache=cache)[0]))
    inc = np.concatenate(rows)
    return {"mlx_lm": mlx_lm.__version__, "tokens": int(ids.size), "logit_scale": round(float(np.abs(ref).max()), 2),
            "full_max_abs_diff": float(f"{np.abs(full - ref).max():.3g}"),
            "incremental_max_abs_diff": float(f"{np.abs(inc - ref).max():.3g}"),
            "argmax_agreement": round(float((full.argmax(-1) == ref.argmax(-1)).mean()), 4),
            "method": mlx_lm_parity.__doc__.split("\n\n", 1)[1].strip()}


# ---------------------------------------------------------------------------------------------
# export and parity
# ---------------------------------------------------------------------------------------------
def check_folder(folder: Path, cfg: dict) -> dict:
    """The folder's tensors, checked: the release's key set, dtypes (bf16, F32 bias), shards; returns them."""
    import torch

    raw = load_folder(folder)
    expected = expected_keys(cfg)
    if set(raw) != expected:
        raise SystemExit(f"layout: extra {sorted(set(raw) - expected)[:5]}, missing {sorted(expected - set(raw))[:5]}")
    bad = {k: str(v.dtype) for k, v in raw.items()
           if v.dtype != (torch.float32 if k.endswith(F32_SUFFIXES) else torch.bfloat16)}
    assert not bad, f"dtypes: {bad}"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == split_state(raw, cfg), "shards: the nextn layer is not alone in the last shard"
    pre = nextn_prefix(cfg)
    assert not {pre + "embed_tokens.weight", pre + "shared_head.head.weight"} & set(raw)
    assert raw[pre + "eh_proj.weight"].shape == (cfg["hidden_size"], 2 * cfg["hidden_size"])
    return raw


def export_glm(args) -> None:
    import torch

    set_threads(getattr(args, "threads", None))
    stage, run = Path(args.stage), Path(args.run)
    out = Path(args.out or FIXTURE)
    log = json.loads((run / "log.json").read_text())
    ckpt = args.checkpoint or log["checkpoints"][-1]
    shape = shape_of(log["args"])
    cfg = glm_config(shape)
    state = {k: (v.float() if k.endswith(F32_SUFFIXES) else v.to(torch.bfloat16)).contiguous()
             for k, v in raw_names(base.load_checkpoint(run / ckpt), cfg).items()}
    expected = expected_keys(cfg)
    if set(state) != expected:
        raise SystemExit(f"layout differs from the release's: extra {sorted(set(state) - expected)[:5]}, "
                         f"missing {sorted(expected - set(state))[:5]}")
    total = base.write_shards(out, state, split_state(state, cfg), SHARDS)
    for shard in SHARDS:
        (out / shard).chmod(0o644)  # safetensors writes 0600; the fixture's files are for everyone to read
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    base.write_tokenizer_and_generation(out, stage)
    check_folder(out, cfg)

    from transformers import GlmMoeDsaForCausalLM

    held = np.load(stage / "heldout.npy")
    lm, head, _ = build_torch_glm(shape)  # the acceptance of what was written
    load_into(lm, head, fused_names(load_folder(out), cfg))
    acc = acceptance_glm(lm, head, held, seq=getattr(args, "seq", None) or log["args"]["seq"])
    hf = GlmMoeDsaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    mlx = mlx_lm_parity(out, hf, held[: getattr(args, "tokens", 128)])
    manifest = json.loads((stage / "manifest.json").read_text())
    step = base.checkpoint_step(ckpt)
    record = {
        **base.provenance("tools/train_text_fixture_glm.py", args.commands, manifest, log, ckpt),
        "acceptance": dict(acc, measured_with={"torch": torch.__version__,
                                               "transformers": __import__("transformers").__version__}),
        "parity": {"mlx_lm_vs_transformers_float32": mlx},
        "final": base.logged_at(log, step),
        "e_score_correction_bias": log.get("e_score_correction_bias"),
        "history": log["history"],
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    write_readme(out, record, manifest, sum(v.numel() for v in state.values()), cfg)
    size = sum(f.stat().st_size for f in out.iterdir())
    b = acc["broken"]
    print(f"wrote {out} ({size / 1e6:.2f} MB in all, {total / 1e6:.2f} MB of tensors, "
          f"{sum(v.numel() for v in state.values()) / 1e6:.2f} M parameters, step {step}); acceptance: "
          f"greedy {acc['greedy']:.4f} {acc['greedy_ci95']} ({acc['greedy_drafts']} drafts), "
          f"teacher-forced {acc['teacher_forced']:.4f}; broken: swapped halves "
          f"{b['eh_proj_halves_swapped']['greedy']:.4f}, pre-norm h {b['pre_norm_hidden']['greedy']:.4f}; "
          f"mlx-lm vs transformers f32: {mlx['full_max_abs_diff']:.2e} "
          f"(incremental {mlx['incremental_max_abs_diff']:.2e})")


def write_readme(out: Path, record: dict, manifest: dict, n_params: int, cfg: dict) -> None:
    acc, par = record["acceptance"], record["parity"]["mlx_lm_vs_transformers_float32"]
    a = record["training"]["args"]
    held = ", ".join(f["path"] for f in manifest["heldout_files"])
    script_note = ("`tools/train_text_fixture_glm.py` (this repository; `tools/train_text_fixture.py --variant glm5`\n"
                   "reaches the same code)")
    method = base.readme_method(record, script_note, "python tools/train_text_fixture_glm.py",
                                hidden_args=("device", "variant"))
    b = acc["broken"]
    sw, pre = b["eh_proj_halves_swapped"], b["pre_norm_hidden"]
    n = cfg["num_hidden_layers"]
    pct = lambda x: f"{x:.0%}"  # noqa: E731
    vlm = record.get("acceptance_mlx_vlm")
    vlm_text = "" if not vlm else f"""

Cross-checked in MLX: mlx-vlm {vlm['mlx_vlm']}'s `glm_moe_dsa_mtp` drafter, loading this folder as its drafter
root (`--draft-model FOLDER`, split in memory; run on a float32 copy, as mlx's CPU `gather_mm` takes float32
only), accepts {pct(vlm['acceptance'])} of its greedy drafts on the same prompts ({vlm['accepted']} of
{vlm['proposed']}, one draft per round; 95% interval {pct(vlm['acceptance_ci95'][0])}-{pct(vlm['acceptance_ci95'][1])}),
and its output equals plain greedy decoding: {str(vlm['lossless']).lower()}."""
    text = f"""# text-glm5-mtp

A small GLM-5.x model (`glm_moe_dsa`, transformers' `GlmMoeDsaForCausalLM`) with an MTP ("nextn") head,
{n_params / 1e6:.2f} M parameters, hidden {cfg['hidden_size']}. {n} layers: layer 0 dense, layers 1-{n - 1} MoE
({cfg['n_routed_experts']} routed experts, top {cfg['num_experts_per_tok']}, sigmoid `noaux_tc` routing whose
`e_score_correction_bias` was balanced during training, {cfg['n_shared_experts']} shared expert); MLA attention
({cfg['num_attention_heads']} heads, q_lora {cfg['q_lora_rank']}, kv_lora {cfg['kv_lora_rank']}, nope / rope / v
{cfg['qk_nope_head_dim']} / {cfg['qk_rope_head_dim']} / {cfg['v_head_dim']}) and a DSA indexer in every layer.
It was trained for mtpconvert's tests of the GLM-5 family.

It is in GLM-5's raw release layout: flat `model.*` keys; every expert one by one
(`mlp.experts.{{e}}.{{gate,up,down}}_proj.weight`); `e_score_correction_bias` in F32 and every other tensor in
bf16; the nextn layer at `model.layers.{n}.*` (`enorm`, `hnorm`, `eh_proj` [H, 2H], `shared_head.norm` and a
whole MoE decoder block with its own indexer; no `embed_tokens` and no `shared_head.head`, the head borrows the
backbone's) alone in the last shard; `num_nextn_predict_layers: 1` in config.json.

The head is `eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])` on the backbone's post-final-norm state, the
decoder block, `shared_head.norm` and the backbone's `lm_head`. It accepts a realistic share of greedy drafts,
measured in torch on held-out text: {pct(acc['greedy'])} of the tokens of greedy continuations (k=1; 95% interval
{pct(acc['greedy_ci95'][0])}-{pct(acc['greedy_ci95'][1])} over {acc['prompts']} prompts), {pct(acc['teacher_forced'])}
teacher-forced. With `eh_proj`'s two input halves swapped it collapses to {pct(sw['greedy'])}. Fed the
backbone's pre-final-norm state instead, it still accepts {pct(pre['greedy'])}: `hnorm` absorbs most of the
final norm's per-channel gain, so acceptance alone does not catch that mistake (`acceptance` in
training.json says how each number was measured).{vlm_text}

Loaders: `GlmMoeDsaForCausalLM.from_pretrained` loads the backbone (it reports the nextn layer's keys as
unexpected and skips them). mlx-lm {par['mlx_lm']}'s `load_model` loads the folder strictly (its sanitize drops
layer {n}); its float32 logits differ from transformers' by at most {par['full_max_abs_diff']:.1e} over
{par['tokens']} held-out tokens ({par['incremental_max_abs_diff']:.1e} decoding one token at a time; logits up to
{par['logit_scale']}).

The indexers are untrained: transformers computes them under `no_grad`, so they keep their initialisation
(`k_norm` weight and bias drawn around 1 and 0). With `index_topk` {cfg['index_topk']} they select every key
up to {cfg['index_topk']} tokens, so attention is dense at the lengths the fixture is meant for; past that they
would pick keys arbitrarily. The model was trained on windows of {a['seq']} tokens (prompt plus continuation
in the tests is shorter). The q_a / kv_a layernorms use transformers' eps 1e-6 (mlx-lm's `deepseek_v32` too);
`rms_norm_eps` 1e-5 applies to the other norms.

## Licence of the training text

Trained on the pure-Python modules of CPython {manifest['python']}'s standard library, as installed with the
interpreter ({len(manifest['train_files'])} files, {manifest['train_tokens']} tokens; each file's path and SHA-256 \
are in training.json). That text is under the {manifest['licence']}. The tokenizer
(byte-level BPE, vocabulary {manifest['vocab_size']}, the Qwen3.5 text fixtures' own) was trained on the same
files. Held out of training (prompts of the tests and benchmarks): {held}.

{method}"""
    (out / "README.md").write_text(text)


def parity_glm(args) -> None:
    """The folder checked: layout, transformers' from_pretrained and save_pretrained, this script's model, mlx-lm."""
    import tempfile

    import torch
    from safetensors import safe_open
    from transformers import GlmMoeDsaForCausalLM

    set_threads(getattr(args, "threads", None))
    src = Path(args.folder)
    cfg = json.loads((src / "config.json").read_text())
    raw = check_folder(src, cfg)
    print(f"layout: {len(raw)} tensors, the release's key set; bf16 but e_score_correction_bias (F32); "
          f"nextn layer {cfg['num_hidden_layers']} alone in {SHARDS[1]}")
    hf, info = GlmMoeDsaForCausalLM.from_pretrained(src, dtype=torch.float32, output_loading_info=True)
    hf.eval()
    pre = nextn_prefix(cfg)
    missing, mismatched, unexpected = base.loading_problems(info, pre)
    print(f"from_pretrained: {len(missing)} missing, {len(mismatched)} mismatched, {len(unexpected)} unexpected "
          f"keys outside layer {cfg['num_hidden_layers']}")
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        saved = {}
        for f in Path(tmp).glob("*.safetensors"):
            with safe_open(str(f), "pt") as fh:
                saved.update({k: fh.get_slice(k).get_dtype() for k in fh.keys()})
    backbone = {k for k in raw if not k.startswith(pre)}
    same_names = set(saved) == backbone
    print(f"save_pretrained writes the folder's backbone names: {same_names}"
          + ("" if same_names else
             f" (extra {sorted(set(saved) - backbone)[:4]}, missing {sorted(backbone - set(saved))[:4]})"))
    lm, head, _ = build_torch_glm({k: cfg[k] for k in GLM_SHAPE})
    load_into(lm, head, fused_names(raw, cfg))
    lm.eval(), head.eval()
    held, ids = base.parity_ids(args, cfg["vocab_size"])
    tokens = torch.from_numpy(ids.astype(np.int64))[None]
    with torch.no_grad():
        a = hf(input_ids=tokens, use_cache=False).logits[0]
        b = lm(input_ids=tokens, use_cache=False).logits[0]
    diff = float((a - b).abs().max())
    print(f"backbone logits: max |from_pretrained - this script's model| = {diff:.2e}")
    mlx = mlx_lm_parity(src, hf, ids)
    print(f"mlx-lm {mlx['mlx_lm']} vs transformers, float32, {mlx['tokens']} tokens: "
          f"max |diff| {mlx['full_max_abs_diff']:.2e} "
          f"full, {mlx['incremental_max_abs_diff']:.2e} incremental (logit scale {mlx['logit_scale']}), "
          f"argmax agreement {mlx['argmax_agreement']:.4f}")
    if held is not None and args.acceptance:
        rec = src / "training.json"  # teacher-forced windows of the training length, as export measures them
        seq = json.loads(rec.read_text())["training"]["args"]["seq"] if rec.exists() else 128
        acc = acceptance_glm(lm, head, held, seq=seq)
        bk = acc["broken"]
        print(f"acceptance: greedy {acc['greedy']:.4f} {acc['greedy_ci95']} ({acc['greedy_drafts']} drafts), "
              f"teacher-forced {acc['teacher_forced']:.4f}; broken: swapped halves "
              f"{bk['eh_proj_halves_swapped']['greedy']:.4f}, pre-norm h {bk['pre_norm_hidden']['greedy']:.4f}")
    ok = not missing and not mismatched and not unexpected and same_names and diff < 1e-4 and \
        mlx["full_max_abs_diff"] < 1e-3 and mlx["argmax_agreement"] == 1.0
    sys.exit(0 if ok else 1)


# ---------------------------------------------------------------------------------------------
# mlx-vlm 0.7.10: the folder's head as the glm_moe_dsa_mtp drafter (no torch)
# ---------------------------------------------------------------------------------------------
def mlx_vlm_check(args) -> None:
    """Greedy MTP decoding with mlx-vlm's glm_moe_dsa target and ``load_drafter(FOLDER, kind="mtp")`` (the root-folder
    route of ``--draft-model FOLDER``), on a float32 copy of the folder (mlx's CPU gather_mm takes float32 only)."""
    import shutil
    import tempfile
    from importlib.metadata import version

    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    sys.path.insert(0, str(base.REPO / "interop/probes"))
    from _common import generated_ids  # the probes' reading of a generate_step stream

    src = Path(args.folder)
    held = np.load(Path(args.stage) / "heldout.npy")
    prompts = greedy_prompts(held, 0, args.prompt, args.per_file)

    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32"
        f32.mkdir()
        for f in src.iterdir():
            if f.suffix == ".safetensors":
                mx.save_safetensors(str(f32 / f.name), {k: v.astype(mx.float32) for k, v in mx.load(str(f)).items()},
                                    metadata={"format": "pt"})
            elif f.is_file():
                shutil.copy(f, f32 / f.name)
        model = load_model(f32)
        drafter, kind = load_drafter(str(f32), kind="mtp")
        proposed = accepted = 0
        same = True
        per_prompt = []
        t0 = time.time()
        for p in prompts:
            ids = mx.array(p[None].astype(np.int32))
            plain, _ = generated_ids(generate_step(ids, model, None, None, max_tokens=args.generate,
                                                   temperature=0.0), args.generate)
            spec, _ = generated_ids(generate_step(ids, model, None, None, max_tokens=args.generate, temperature=0.0,
                                                  draft_model=drafter, draft_kind=kind), args.generate)
            same &= plain == spec
            d, a = sum(drafter.draft_lens or []), sum(drafter.accept_lens or [])
            proposed, accepted = proposed + d, accepted + a
            per_prompt.append([a, d])
    hits, totals = np.array([a for a, _ in per_prompt]), np.array([d for _, d in per_prompt])
    res = {"mlx_vlm": version("mlx-vlm"), "mlx": version("mlx"), "drafter": type(drafter).__name__, "kind": kind,
           "prompts": len(prompts), "prompt_tokens": args.prompt, "generated_tokens": args.generate,
           "proposed": int(proposed), "accepted": int(accepted), "acceptance": round(accepted / max(proposed, 1), 4),
           "acceptance_ci95": bootstrap_ci(hits, totals), "lossless": bool(same),
           "seconds": round(time.time() - t0, 1),
           "method": "the torch greedy prompts; mlx_vlm.generate.generate_step at temperature 0 with and without "
                     "the drafter (one draft per round); accepted / proposed drafts from the drafter's "
                     "accept_lens / draft_lens, pooled over prompts; 95% interval: bootstrap over prompts"}
    print(json.dumps(res))
    if args.record:
        rec_path = src / "training.json"
        record = json.loads(rec_path.read_text())
        record["acceptance_mlx_vlm"] = res
        line = (f"MLX_VLM_VENV/bin/python tools/train_text_fixture_glm.py mlx-vlm {args.folder} --stage {args.stage} "
                f"--record  # mlx-vlm {res['mlx_vlm']}, mlx {res['mlx']} (the venv of interop/setup.sh), same CPU")
        record["commands"] = [c for c in record["commands"] if " mlx-vlm " not in c] + [line]
        rec_path.write_text(json.dumps(record, indent=1) + "\n")
        manifest = {"python": record["corpus"]["python"], "licence": record["corpus"]["licence"],
                    "train_files": record["corpus"]["train_files"], "heldout_files": record["corpus"]["heldout_files"],
                    "train_tokens": record["corpus"]["train_tokens"], "vocab_size": record["tokenizer"]["vocab_size"]}
        cfg = json.loads((src / "config.json").read_text())
        index = json.loads((src / "model.safetensors.index.json").read_text())
        n_params = sum(math.prod(v.shape) for f in set(index["weight_map"].values())
                       for v in mx.load(str(src / f)).values())
        write_readme(src, record, manifest, n_params, cfg)
        print(f"recorded in {rec_path} and README.md")


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def add_train_args(p) -> None:
    p.add_argument("--stage", required=True)
    p.add_argument("--out", required=True)
    base.add_optimisation_args(p, seq=128, seq_help="at most index_topk (dense indexer)")
    p.add_argument("--hidden-size", type=int, default=None, help=f"default {GLM_SHAPE['hidden_size']}")
    p.add_argument("--layers", type=int, default=None,
                   help=f"backbone layers (default {GLM_SHAPE['num_hidden_layers']})")
    p.add_argument("--experts", type=int, default=None,
                   help=f"routed experts (default {GLM_SHAPE['n_routed_experts']})")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"experts per token (default {GLM_SHAPE['num_experts_per_tok']})")
    p.add_argument("--expert-size", type=int, default=None,
                   help=f"moe_intermediate_size (default {GLM_SHAPE['moe_intermediate_size']})")
    p.add_argument("--index-topk", type=int, default=None, help=f"default {GLM_SHAPE['index_topk']}")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="e_score_correction_bias step per training step")
    p.add_argument("--final-norm-spread", type=float, default=3.0,
                   help="final norms' gains start log-uniform in [1/S, S] (1: all ones)")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--experts-implementation", default=None,
                   help="transformers' experts kernel (grouped_mm, batched_mm, eager; default: its choice)")
    p.add_argument("--chunk-seconds", type=float, default=None,
                   help="stop after this many seconds, saving OUT/resume.pt (exit 3); run again to continue")
    base.add_logging_args(p)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    p = sub.add_parser("train", help="train the GLM-5 model and its head (torch)")
    add_train_args(p)
    p.set_defaults(func=train_glm, variant="glm5")

    p = sub.add_parser("export", help="checkpoint -> raw GLM-5 layout folder, acceptance, mlx-lm parity, records")
    p.add_argument("--stage", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--checkpoint", default=None, help="file in RUN (default: the last)")
    p.add_argument("--out", default=None, help=f"default {FIXTURE.relative_to(base.REPO)}")
    p.add_argument("--seq", type=int, default=None, help="teacher-forced windows (default: the training --seq)")
    p.add_argument("--tokens", type=int, default=128, help="held-out tokens of the mlx-lm comparison")
    p.add_argument("--commands", nargs="*", help="the commands that made it, recorded in training.json")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=export_glm)

    p = sub.add_parser("parity", help="check a folder: layout, transformers, mlx-lm (and acceptance)")
    p.add_argument("folder")
    p.add_argument("--stage", default=None, help="take the tokens from STAGE's held-out ids")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--acceptance", action="store_true", help="also measure the head's acceptance (STAGE)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=parity_glm)

    p = sub.add_parser("mlx-vlm", help="the head as mlx-vlm's glm_moe_dsa_mtp drafter: greedy acceptance (no torch)")
    p.add_argument("folder")
    p.add_argument("--stage", required=True)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--generate", type=int, default=64)
    p.add_argument("--per-file", type=int, default=3)
    p.add_argument("--record", action="store_true", help="add the result to the folder's training.json and README.md")
    p.set_defaults(func=mlx_vlm_check)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
