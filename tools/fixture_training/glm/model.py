"""GLM-5's configuration and model (backbone and nextn head), and its raw release layout: names, key set, shards."""

from __future__ import annotations

from tools.fixture_training.corpus import EOS_ID, PAD_ID, VOCAB
from tools.fixture_training.folders import REPO, fuse_experts, split_experts

FIXTURE = REPO / "mtpconvert/fixture/data/text-glm5-mtp"
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
        "eos_token_id": EOS_ID,  # <|im_end|>
        "first_k_dense_replace": 1,
        "head_dim": s["qk_rope_head_dim"],  # GLM-5's config has head_dim = qk_rope_head_dim (transformers sets it so)
        "hidden_act": "silu",
        "hidden_size": s["hidden_size"],
        "index_head_dim": s["index_head_dim"],
        "index_n_heads": s["index_n_heads"],
        "index_topk": s["index_topk"],
        "indexer_rope_interleave": True,
        "initializer_range": 0.02,  # as the Qwen3.5 text fixtures'
        "intermediate_size": s["intermediate_size"],
        "kv_lora_rank": s["kv_lora_rank"],
        "max_position_embeddings": 4096,
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
        "pad_token_id": PAD_ID,  # <|endoftext|>
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
        "vocab_size": VOCAB,
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
    return split_experts(renamed)


def fused_names(raw: dict, cfg) -> dict:
    """The inverse of raw_names."""
    pre = nextn_prefix(cfg)
    fused = fuse_experts(raw)
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
