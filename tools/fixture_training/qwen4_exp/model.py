"""The qwen4_exp fixture's configuration, its model (transformers' ``Qwen4ExpForCausalLM``) and MTP head (the
release's design from transformers' own modules), the forward both train on, and the indexers' dense shortcut."""

from __future__ import annotations

import copy

from tools.fixture_training.corpus import EOS_ID, PAD_ID, VOCAB
from tools.fixture_training.folders import REPO

FIXTURE = REPO / "mtpconvert/fixture/data/text-qwen4_exp-mtp"

# The text model's sizes (transformers' Qwen4ExpTextConfig keys). Layers 0-2 GatedDeltaNet, layer 3 indexed (sparse)
# attention; layer 1 (``ple_layer_ids`` counts from 1) has the per-layer n-gram embedding; MoE everywhere.
TEXT = dict(
    vocab_size=VOCAB, hidden_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    norm_topk_prob=True, router_aux_loss_coef=0.01,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    hc_count=4, hc_lowrank=32,
    ple_layer_ids=[2], ple_embed_dim=64, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2,
    ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4, seed=1234,
    # the indexer keeps every key up to indexer_budget of them: dense attention at the fixture's lengths (the
    # indexers are not trained: their selection has no gradient)
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=256, indexer_compress_ratio=4,
    output_gate_type="sigmoid", hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096,
    initializer_range=0.02, attention_bias=False, attention_dropout=0.0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
)
# the release is a VLM: a tiny vision tower (never trained; text decoding does not use it) keeps model.visual.*
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, num_position_embeddings=16)

SHAPE_OPTS = {"hidden_size": "hidden_size", "experts": "num_experts", "top_k": "num_experts_per_tok",
              "expert_size": "moe_intermediate_size", "ngram_base": "ngram_vocab_size_base"}


def shape_of(given) -> dict:
    """TEXT with train's size options (an argparse namespace or a run's logged args) over it."""
    given = given if isinstance(given, dict) else vars(given)
    return dict(copy.deepcopy(TEXT), **{key: given[opt] for opt, key in SHAPE_OPTS.items()
                                        if given.get(opt) is not None})


def text_config(shape: dict = None):
    from transformers import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(**(shape or copy.deepcopy(TEXT)))
    config._attn_implementation = "sdpa"
    return config


def release_config(shape: dict = None) -> dict:
    """config.json as the release writes it: the VLM config, ``full_attention`` where transformers says
    ``indexed_attention`` (mlx-vlm reads only the former), one MTP layer sharing the embedding, bf16."""
    from transformers import Qwen4ExpConfig

    text = dict(shape or copy.deepcopy(TEXT))
    config = Qwen4ExpConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=text["hidden_size"]),
                            tie_word_embeddings=False).to_dict()
    tc = config["text_config"]
    tc["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in tc["layer_types"]]
    tc.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, dtype="bfloat16")
    config.pop("dtype", None)
    config["architectures"] = ["Qwen4ExpForConditionalGeneration"]
    return config


def dense_indexers() -> None:
    """Skip the indexers' per-query loop where its answer is known: with at most ``indexer_budget`` keys every
    complete block is among the top ``budget / compress_ratio`` and the tail is kept, so the selection is every
    visible key, the attention mask itself (``modeling_qwen4_exp.py:709-815``). The same mask, computed at once;
    ``check_dense_indexer`` compares the two."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    if getattr(Qwen4ExpTextQSAIndexer.forward, "_dense_shortcut", False):
        return
    full = Qwen4ExpTextQSAIndexer.forward

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        if attention_mask.shape[-1] <= self.token_budget:
            visible = attention_mask if attention_mask.dtype.is_floating_point is False else attention_mask == 0
            return visible.expand(hidden_states.shape[0], 1, *visible.shape[-2:])
        return full(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)

    forward._dense_shortcut = True
    forward._full = full
    Qwen4ExpTextQSAIndexer.forward = forward


def check_dense_indexer(lm, tokens) -> None:
    """The shortcut's mask equals transformers' own selection on ``tokens`` (the first indexed layer)."""
    import torch
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    seen = {}
    layer = next(m for m in lm.modules() if isinstance(m, Qwen4ExpTextQSAIndexer))
    hook = layer.register_forward_hook(lambda m, args, out: seen.update(args=args, out=out))
    with torch.no_grad():
        lm(input_ids=tokens, use_cache=False)
        hook.remove()
        full = Qwen4ExpTextQSAIndexer.forward._full(layer, *seen["args"])
    assert torch.equal(full, seen["out"].expand_as(full)), "the dense indexer shortcut differs from transformers'"


def make_head(config):
    """The release's MTP head from transformers' qwen4_exp modules, as mlx-vlm's drafter runs it
    (``speculative/drafters/qwen4_exp_mtp/qwen4_exp_mtp.py:31-117``):

        x_k = fc_embedding(pre_fc_norm_embedding(embed(t+1))) + fc_hidden(stream_k(pre_fc_norm_hidden(h_t)))
        y   = decoder_layer(x)        indexed attention, MoE, hyper-connections; no n-gram embedding
        logits(t+2) = lm_head(hyper_connection_mixer(y))

    ``h_t``: the backbone's last layer output before its ``hyper_connection_mixer``, all hc streams [hc * H];
    ``pre_fc_norm_hidden`` is one RMS norm over all of them."""
    import torch
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (Qwen4ExpTextDecoderLayer, Qwen4ExpTextGatedResidual,
                                                                  Qwen4ExpTextRMSNorm, Qwen4ExpTextRotaryEmbedding)

    class MTPHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cfg = copy.deepcopy(config)
            cfg.num_hidden_layers, cfg.layer_types, cfg.ple_layer_ids = 1, ["indexed_attention"], []
            H, hc, eps = cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps
            self.config = cfg
            self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(H, eps=eps)
            self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(hc * H, eps=eps)
            self.fc_embedding = torch.nn.Linear(H, H, bias=False)
            self.fc_hidden = torch.nn.Linear(H, H, bias=False)
            self.layers = torch.nn.ModuleList([Qwen4ExpTextDecoderLayer(cfg, 0)])
            self.hyper_connection_mixer = Qwen4ExpTextGatedResidual(cfg, use_combine=False)
            self.rotary_emb = Qwen4ExpTextRotaryEmbedding(cfg)  # no parameters: not in the state dict

        def forward(self, next_embeddings, hidden):
            """Pairs (h_t, embed(t+1)) at positions t = 0..L-1 (a fresh cache): the head's state before its mixer."""
            H, hc = self.config.hidden_size, self.config.hc_count
            a = self.fc_embedding(self.pre_fc_norm_embedding(next_embeddings))
            streams = self.pre_fc_norm_hidden(hidden).unflatten(-1, (hc, H))
            x = (a.unsqueeze(-2) + self.fc_hidden(streams)).flatten(-2)
            B, L = x.shape[:2]
            positions = torch.arange(L, device=x.device).view(1, 1, -1).expand(3, B, -1)
            mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None, None]
            return self.layers[0](x, position_embeddings=self.rotary_emb(x, positions), attention_mask=mask,
                                  conv_mask=None, cache=None)

        def logits_of(self, state, lm_head):
            return lm_head(self.hyper_connection_mixer(state))

    return MTPHead()


def build(shape: dict = None):
    """(Qwen4ExpForCausalLM, MTP head, text config): the head initialised as transformers initialises the
    backbone (normal 0.02, zero-centred norms at 0)."""
    from transformers import Qwen4ExpForCausalLM

    dense_indexers()
    config = text_config(shape)
    lm = Qwen4ExpForCausalLM(config)
    head = make_head(config)
    for m in head.modules():
        lm._init_weights(m)
    return lm, head, config


def forward(lm, head, tokens):
    """(backbone logits [B, L, V], head logits [B, L-2, V]: row t drafts token t+2 from h_t and token t+1, the
    router logits of every MoE layer, backbone's and head's)."""
    captured, routers = {}, []
    mixer = lm.model.hyper_connection_mixer
    hooks = [mixer.register_forward_pre_hook(lambda m, args: captured.__setitem__("hidden", args[0]))]
    for name, mod in list(lm.named_modules()) + list(head.named_modules()):
        if name.endswith("mlp.gate"):
            hooks.append(mod.register_forward_hook(lambda m, args, out: routers.append(out[0])))
    try:
        logits = lm(input_ids=tokens, use_cache=False).logits
        state = head(lm.model.embed_tokens(tokens[:, 1:-1]), captured["hidden"][:, :-2])
        head_logits = head.logits_of(state, lm.lm_head)
    finally:
        for h in hooks:
            h.remove()
    return logits, head_logits, routers
