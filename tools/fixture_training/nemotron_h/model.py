"""The Nemotron-H fixture's configuration and model (backbone and MTP prediction module), and its release layout:
names, key set, shards."""

from __future__ import annotations

from tools.fixture_training.corpus import EOS_ID, PAD_ID, VOCAB
from tools.fixture_training.folders import REPO

FIXTURE = REPO / "mtpconvert/fixture/data/text-nemotronh-mtp"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")  # backbone, MTP head
F32_SUFFIXES = ("e_score_correction_bias",)  # stored F32 in the releases; every other tensor bf16
NAMES = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}  # transformers' legacy block names

# The model's sizes (config keys); train's options override them and the run's logged args carry them to export.
# The latent MoE's latent size equals hidden_size so that a converter transposing fc1/fc2_latent_proj writes a head
# that still loads (and must be caught by its acceptance, not by a shape error).
SHAPE = dict(
    hidden_size=128,
    hybrid_override_pattern="MEM*EME",  # Super's block kinds: Mamba2, latent MoE, one attention block
    mtp_hybrid_override_pattern="*E",  # Super's head: attention, then the latent MoE
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=32,
    n_groups=2,
    conv_kernel=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    moe_latent_size=128,
    moe_shared_expert_intermediate_size=128,
)

SHAPE_OPTS = {"hidden_size": "hidden_size", "pattern": "hybrid_override_pattern",
              "mtp_pattern": "mtp_hybrid_override_pattern", "experts": "n_routed_experts",
              "top_k": "num_experts_per_tok", "expert_size": "moe_intermediate_size", "latent_size": "moe_latent_size",
              "shared_expert_size": "moe_shared_expert_intermediate_size"}


def shape_of(given) -> dict:
    """The model's sizes: SHAPE with train's options (argparse namespace or a run's logged args) over it."""
    given = given if isinstance(given, dict) else vars(given)
    return dict(SHAPE, **{key: given[opt] for opt, key in SHAPE_OPTS.items() if given.get(opt) is not None})


def nemotron_config(shape: dict = None) -> dict:
    """The release's config.json (Super's spelling: pattern strings; the keys NemotronHConfig and mlx-lm's ModelArgs
    read), sorted."""
    import transformers

    s = dict(SHAPE, **(shape or {}))
    cfg = {
        "architectures": ["NemotronHForCausalLM"],
        "attention_bias": False,
        "chunk_size": 128,
        "conv_kernel": s["conv_kernel"],
        "dtype": "bfloat16",
        "eos_token_id": EOS_ID,
        "head_dim": s["head_dim"],
        "hidden_size": s["hidden_size"],
        "hybrid_override_pattern": s["hybrid_override_pattern"],
        "initializer_range": 0.02,
        "intermediate_size": 4 * s["hidden_size"],  # the '-' blocks' (none here; mlx-lm's ModelArgs requires it)
        "layer_norm_epsilon": 1e-05,
        "mamba_head_dim": s["mamba_head_dim"],
        "mamba_hidden_act": "silu",
        "mamba_num_heads": s["mamba_num_heads"],
        "mamba_proj_bias": False,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "model_type": "nemotron_h",
        "moe_intermediate_size": s["moe_intermediate_size"],
        "moe_latent_size": s["moe_latent_size"],
        "moe_shared_expert_intermediate_size": s["moe_shared_expert_intermediate_size"],
        "mtp_hybrid_override_pattern": s["mtp_hybrid_override_pattern"],
        "n_group": 1,
        "n_groups": s["n_groups"],
        "n_routed_experts": s["n_routed_experts"],
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": s["num_attention_heads"],
        "num_experts_per_tok": s["num_experts_per_tok"],
        "num_hidden_layers": len(s["hybrid_override_pattern"]),
        "num_key_value_heads": s["num_key_value_heads"],
        "num_nextn_predict_layers": 1,
        "pad_token_id": PAD_ID,
        "routed_scaling_factor": 2.5,
        "ssm_state_size": s["ssm_state_size"],
        "tie_word_embeddings": False,
        # transformers clamps dt at time_step_min whatever time_step_limit says (modeling_nemotron_h.py:415), mlx-lm
        # and mlx-vlm at time_step_limit: stating the same lower bound in both makes every reader compute what was
        # trained. The upper bound is finite (no dt comes near it): JSON has no infinity, transformers 5 tags one as
        # {"__float__": "Infinity"} and mlx-lm 0.31 passes that dict on to mx.clip
        "time_step_limit": [0.001, 1.0e30],
        "time_step_min": 0.001,
        "topk_group": 1,
        "transformers_version": transformers.__version__,
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "vocab_size": VOCAB,
    }
    unknown = set(shape or {}) - set(cfg)
    if unknown:
        raise ValueError(f"not Nemotron-H config keys: {sorted(unknown)}")
    return cfg


def build_torch(shape: dict = None):
    """(NemotronHForCausalLM, MTP prediction module, config): the config is the one config.json loads into.

    The module is transformers' own ``NemotronHModel`` over the head's pattern (its blocks are the release's
    ``mtp.layers.{j}``, its ``norm_f`` the last block's ``final_layernorm``; no embedding of its own) plus ``enorm``,
    ``hnorm`` and ``eh_proj``: the forward every consumer runs, ``eh_proj(cat[enorm(e), hnorm(h)])``, the blocks,
    the final norm."""
    import torch
    import torch.nn as nn
    from transformers import NemotronHConfig, NemotronHForCausalLM
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHModel, NemotronHRMSNorm

    config = NemotronHConfig.from_dict(nemotron_config(shape))
    config._attn_implementation = "sdpa"
    lm = NemotronHForCausalLM(config)
    own = {k: v for k, v in nemotron_config(shape).items() if k != "hybrid_override_pattern"}
    blocks = NemotronHConfig.from_dict({**own, "layers_block_type": [NAMES[c] for c in
                                                                     own["mtp_hybrid_override_pattern"]]})
    blocks._attn_implementation = "sdpa"

    class PredictionModule(nn.Module):
        def __init__(self):
            super().__init__()
            H, eps = config.hidden_size, config.layer_norm_epsilon
            self.enorm = NemotronHRMSNorm(H, eps=eps)
            self.hnorm = NemotronHRMSNorm(H, eps=eps)
            self.eh_proj = nn.Linear(2 * H, H, bias=False)
            self.model = NemotronHModel(blocks)
            self.model.embeddings = None  # it reads the backbone's

        def forward(self, hidden, next_embeddings):
            """Row t: (h_t, embedding of token t+1) -> the state whose lm_head logits draft token t+2."""
            x = self.eh_proj(torch.cat([self.enorm(next_embeddings), self.hnorm(hidden)], dim=-1))
            return self.model(inputs_embeds=x).last_hidden_state

    head = PredictionModule()
    for m in head.modules():  # the backbone's init (normal 0.02, norms at 1, router bias 0)
        lm._init_weights(m)
    return lm, head, config


# ---------------------------------------------------------------------------------------------
# names: the training checkpoint (transformers' fused experts, head under mtp.*) <-> the release's raw layout
# ---------------------------------------------------------------------------------------------
def head_names(state: dict, last: int) -> dict:
    """The prediction module's state (``enorm``, ``model.layers.{j}.*``, ``model.norm_f``) -> the release's
    ``mtp.layers.{j}.*`` with per-expert experts."""
    out = {}
    for k, v in state.items():
        if k.startswith(("enorm.", "hnorm.", "eh_proj.")):
            out[f"mtp.layers.0.{k}"] = v
        elif k == "model.norm_f.weight":
            out[f"mtp.layers.{last}.final_layernorm.weight"] = v
        elif k.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):
            for e in range(v.shape[0]):
                out[f"mtp.{k[len('model.'):]}".replace(".experts.", f".experts.{e}.") + ".weight"] = v[e].contiguous()
        else:
            out["mtp." + k[len("model."):]] = v
    return out


def module_names(raw: dict, last: int) -> dict:
    """The inverse of head_names: the release's ``mtp.*`` -> the prediction module's state."""
    import re

    import torch

    out, experts = {}, {}
    for k, v in raw.items():
        rest = k[len("mtp."):]
        if m := re.match(r"^layers\.0\.(enorm|hnorm|eh_proj)\.weight$", rest):
            out[f"{m[1]}.weight"] = v
        elif rest == f"layers.{last}.final_layernorm.weight":
            out["model.norm_f.weight"] = v
        elif m := re.match(r"^(layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$", rest):
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = v
        else:
            out["model." + rest] = v
    for (pre, proj), d in experts.items():
        out[f"model.{pre}.{proj}"] = torch.stack([d[e] for e in range(len(d))])
    return out


def split_state(state: dict) -> dict:
    """The folder's key -> shard file: the head in the last shard, the rest in the first."""
    return {k: SHARDS[1] if k.startswith("mtp.") else SHARDS[0] for k in sorted(state)}
