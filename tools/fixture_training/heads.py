"""The Qwen-style MTP head around a transformers backbone, and the losses every variant trains on.

The head (``build_with``) is ``fc(concat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])``, one
full-attention decoder layer of the backbone's kind, ``norm``, and the backbone's ``lm_head``; GLM's nextn head
(glm/model.py) takes the same arguments, so ``forward_losses`` trains either.
"""

from __future__ import annotations


def build_with(LM, config, Layer, Norm):
    """The backbone LM(config) and an MTP head of Layer/Norm (one full-attention layer), initialised alike."""
    import torch.nn as nn

    config._attn_implementation = "sdpa"
    lm = LM(config)
    full_idx = config.layer_types.index("full_attention")

    class MTPHead(nn.Module):
        def __init__(self):
            super().__init__()
            H, eps = config.hidden_size, config.rms_norm_eps
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.pre_fc_norm_hidden = Norm(H, eps=eps)
            self.pre_fc_norm_embedding = Norm(H, eps=eps)
            self.layers = nn.ModuleList([Layer(config, layer_idx=full_idx)])
            self.norm = Norm(H, eps=eps)

        def forward(self, hidden, next_embeddings, position_embeddings):
            x = self.fc(torch_cat([self.pre_fc_norm_embedding(next_embeddings), self.pre_fc_norm_hidden(hidden)]))
            out = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
            out = out[0] if isinstance(out, tuple) else out
            return self.norm(out)

    head = MTPHead()
    for m in head.modules():  # the backbone's init (normal 0.02, zero-centred norms at 0, ...)
        lm._init_weights(m)
    return lm, head, config


def torch_cat(xs):
    import torch

    return torch.cat(xs, dim=-1)


def forward_losses(lm, head, tokens, router_logits=None, aux_coef=0.0):
    """Mean cross-entropies (main next token, MTP token t+2) and MTP/backbone stats on [B, L] tokens."""
    import torch
    import torch.nn.functional as F

    inner = lm.model
    B, L = tokens.shape
    h = inner(input_ids=tokens).last_hidden_state  # after the final norm
    logits = lm.lm_head(h)
    main = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    pe = inner.rotary_emb(h, head_positions(lm.config, B, L - 1, tokens.device))
    m = head(h[:, :-1], inner.embed_tokens(tokens[:, 1:]), pe)  # pair (h_t, t+1) at position t
    mtp_logits = lm.lm_head(m)[:, :-1]
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), tokens[:, 2:].flatten())
    with torch.no_grad():
        mtp_arg = mtp_logits.argmax(-1)
        stats = {
            "main_acc": (logits[:, :-1].argmax(-1) == tokens[:, 1:]).float().mean(),
            "mtp_acc": (mtp_arg == tokens[:, 2:]).float().mean(),
            # teacher-forced proxy of greedy acceptance: the head's t+2 guess vs the backbone's
            # own next-token argmax one position later
            "agree": (mtp_arg == logits[:, 1:-1].argmax(-1)).float().mean(),
        }
    loss = main + mtp
    aux = torch.zeros((), device=tokens.device)
    if router_logits:
        aux = sum(load_balancing(r, lm.config.num_experts, lm.config.num_experts_per_tok) for r in router_logits)
        aux = aux / len(router_logits)
        loss = loss + aux_coef * aux
        router_logits.clear()
    return loss, main, mtp, aux, stats


def head_positions(config, batch: int, n: int, device=None):
    """Position ids 0..n-1 of the head's pairs (h_t, t+1) at t: (t, h, w) triples for Qwen3.5's M-RoPE."""
    import torch

    pos = torch.arange(n, device=device)[None].expand(batch, -1)
    mrope = (getattr(config, "rope_parameters", None) or {}).get("mrope_section")
    return pos[None].expand(3, -1, -1) if mrope else pos


def is_moe(config) -> bool:
    return bool(getattr(config, "num_experts", 0))


def load_balancing(router_logits, n_experts: int, top_k: int):
    """Switch-Transformer balance loss: E * sum_e (share of tokens routed to e) * (mean router prob of e)."""
    import torch

    probs = torch.softmax(router_logits.float(), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    share = torch.zeros(n_experts, device=probs.device).scatter_add_(
        0, chosen.flatten(), torch.ones(chosen.numel(), device=probs.device)) / chosen.numel()
    return n_experts * (share * probs.mean(0)).sum()


def torch_state(lm, head, f32_suffixes) -> dict:
    """Backbone under transformers' names, head under mtp.*, as the release stores them (bf16; Qwen3.5 keeps
    A_log and the gated norm in f32, Qwen3-Next stores everything in bf16)."""
    import torch

    sd = {k: v for k, v in lm.state_dict().items()}
    sd.update({f"mtp.{k}": v for k, v in head.state_dict().items()})
    return {k: (v.detach().float() if k.endswith(tuple(f32_suffixes)) else v.detach().to(torch.bfloat16)).cpu()
            .contiguous() for k, v in sorted(sd.items())}
