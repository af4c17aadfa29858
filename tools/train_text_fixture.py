"""Train the *text* fixtures: small Qwen3.5 models (dense and MoE) with an MTP head, on real text.

The bundled ``tiny-qwen35-*`` fixtures learn a synthetic Markov language that every head, even
a broken one, drafts at ~100% greedy acceptance. These learn Python source code and its
docstrings: the pure-Python modules of CPython's standard library (PSF License), which every
CPython 3.10-3.12 install has on disk, so the corpus needs no download. Their MTP heads accept
a realistic share of drafts, and a broken conversion shows.

Steps (each a sub-command):

    prepare   read the corpus from this interpreter's stdlib, train a byte-level BPE tokenizer
              (``tokenizers``), write token ids and a manifest (file list, SHA-256s) to STAGE
    train     train one variant with PyTorch and transformers' own Qwen3.5 classes (CUDA when
              there is one), the MTP head trained next to the backbone; write checkpoints
              (bf16, A_log and the gated norm in f32, as the release stores them) and a log.
              Needs only torch, transformers, safetensors and numpy: it runs on an MLX-free box.
    export    write a checkpoint as the raw Hugging Face layout (``model.language_model.*``,
              top-level ``mtp.*``, zero-centred norms, ``[C,1,K]`` conv1d; the MoE backbone's
              experts fused and the MTP layer's per expert, as Qwen3.5 MoE is published) plus
              config, tokenizer and training.json
    parity    transformers' forward (torch, CPU) of the raw folder against MLX on its conversion

``--variant next`` trains, exports and checks a Qwen3-Next MoE model instead (transformers'
``Qwen3NextForCausalLM``, same tokenizer and stage, the published flat ``model.*`` layout in two
shards with ``mtp.*`` in the last): tools/train_text_fixture_next.py holds its specifics.
``--variant glm5`` (train, export) and ``parity`` of a ``glm_moe_dsa`` folder hand over to
tools/train_text_fixture_glm.py: a GLM-5.x model (transformers' ``GlmMoeDsaForCausalLM``, MLA, MoE, DSA
indexer) with a nextn head, same stage, GLM-5's raw layout (its own command line has more options).

The MTP head is ``fc(concat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])``, one
full-attention decoder layer (dense MLP or MoE, like the backbone's), ``norm``, and the shared
``lm_head``; ``h_t`` is the backbone's post-final-norm state. Loss: next-token cross-entropy
plus the head's cross-entropy on token t+2 (plus a small router load-balancing term for MoE).

    python tools/train_text_fixture.py prepare --stage /tmp/stage
    python tools/train_text_fixture.py train --stage /tmp/stage --variant dense --out /tmp/run-dense --time-budget 330
    python tools/train_text_fixture.py export --stage /tmp/stage --run /tmp/run-dense --variant dense \\
        --out mtpconvert/fixture/data/text-qwen35-mtp
    python tools/train_text_fixture.py parity mtpconvert/fixture/data/text-qwen35-mtp
    python tools/train_text_fixture.py train --stage /tmp/stage --variant next --out /tmp/run-next --steps 1000
    python tools/train_text_fixture.py export --stage /tmp/stage --run /tmp/run-next --variant next
    python tools/train_text_fixture.py parity mtpconvert/fixture/data/text-qwen3next-mtp --stage /tmp/stage
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

SCRIPT = "tools/train_text_fixture.py"
REPO = Path(__file__).resolve().parents[1]
FIXTURES = {"dense": REPO / "mtpconvert/fixture/data/text-qwen35-mtp",
            "moe": REPO / "mtpconvert/fixture/data/text-qwen35-moe-mtp",
            "next": REPO / "mtpconvert/fixture/data/text-qwen3next-mtp",
            "glm5": REPO / "mtpconvert/fixture/data/text-glm5-mtp"}

# ---------------------------------------------------------------------------------------------
# Corpus: pure-Python modules of the standard library present in CPython 3.10, 3.11 and 3.12
# under the same path (modules removed in 3.12, added after 3.10, or turned into packages are
# left out), and in the stdlib package of Debian/Ubuntu builds (no test/, idlelib, tkinter,
# lib2to3, distutils, venv). Their text differs a little between versions: the manifest records
# the SHA-256 of every file that was read. Licence: PSF License Agreement (the interpreter's).
# ---------------------------------------------------------------------------------------------
_TOP = """
__future__ _aix_support _bootsubprocess _collections_abc _compat_pickle _compression _markupbase
_osx_support _py_abc _pydecimal _pyio _sitebuiltins _strptime _threading_local _weakrefset abc aifc
argparse ast base64 bdb bisect bz2 cProfile cgi cgitb chunk code codecs codeop colorsys compileall
configparser contextlib contextvars copy copyreg crypt csv dataclasses datetime decimal dis doctest
enum filecmp fnmatch ftplib functools genericpath getopt getpass gettext glob gzip hashlib hmac
imaplib imghdr inspect io ipaddress keyword linecache locale lzma mailbox mailcap mimetypes
modulefinder nntplib ntpath nturl2path numbers opcode operator optparse os pathlib pdb pickle
pickletools pipes pkgutil platform plistlib poplib posixpath profile pstats pty py_compile pyclbr
pydoc queue quopri random reprlib rlcompleter runpy secrets selectors shelve shutil signal site
smtplib sndhdr socket socketserver ssl stat statistics string stringprep struct subprocess sunau
symtable sysconfig tabnanny tarfile telnetlib tempfile threading timeit token tokenize trace
traceback tracemalloc tty turtle types typing uu uuid warnings wave weakref webbrowser xdrlib
zipapp zipimport
"""
_PACKAGES = {
    "asyncio": "__init__ __main__ base_events base_futures base_subprocess base_tasks constants coroutines events "
               "exceptions format_helpers futures locks log mixins proactor_events protocols queues runners "
               "selector_events sslproto staggered streams subprocess tasks threads transports trsock unix_events "
               "windows_events windows_utils",
    "collections": "__init__ abc",
    "concurrent/futures": "__init__ _base process thread",
    "email": "__init__ _encoded_words _header_value_parser _parseaddr _policybase base64mime charset contentmanager "
             "encoders errors feedparser generator header headerregistry iterators message parser policy "
             "quoprimime utils",
    "email/mime": "__init__ application audio base image message multipart nonmultipart text",
    "json": "__init__ decoder encoder scanner tool",
    "http": "__init__ client cookiejar cookies server",
    "urllib": "__init__ error parse request response robotparser",
    "logging": "__init__ config handlers",
    "xml/dom": "NodeFilter __init__ domreg expatbuilder minicompat minidom pulldom xmlbuilder",
    "xml/etree": "ElementInclude ElementPath ElementTree __init__ cElementTree",
    "xml/sax": "__init__ _exceptions expatreader handler saxutils xmlreader",
    "multiprocessing": "__init__ connection context forkserver heap managers pool popen_fork popen_forkserver "
                       "popen_spawn_posix popen_spawn_win32 process queues reduction resource_sharer "
                       "resource_tracker shared_memory sharedctypes spawn synchronize util",
    "unittest": "__init__ __main__ _log async_case case loader main mock result runner signals suite util",
    "wsgiref": "__init__ handlers headers simple_server util validate",
    "dbm": "__init__ dumb gnu ndbm",
    "html": "__init__ entities parser",
    "xmlrpc": "__init__ client server",
    "sqlite3": "__init__ dbapi2 dump",
    "ctypes": "__init__ _aix _endian util wintypes",
    "curses": "__init__ ascii has_key panel textpad",
    "pydoc_data": "__init__ topics",  # the language reference's topics: prose, as pydoc shows it
}
TRAIN_FILES = tuple([f"{m}.py" for m in _TOP.split()]
                    + [f"{pkg}/{m}.py" for pkg, mods in _PACKAGES.items() for m in mods.split()])
# Held out of training: the prompts of benchmarks/fixture_acceptance.py and the validation loss.
HELDOUT_FILES = tuple(f"{m}.py" for m in "calendar cmd difflib fileinput fractions graphlib heapq netrc pprint "
                      "sched shlex textwrap".split())
LICENCE = "PSF License Agreement (Python Software Foundation License), the licence of CPython's standard library"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_files(names, root: Path | None = None):
    """[(name, text, sha256 of the bytes)] in the order given; fails on a missing file."""
    root = root or stdlib_root()
    out = []
    for name in names:
        data = (root / name).read_bytes()
        out.append((name, data.decode("utf-8").replace("\r\n", "\n"), hashlib.sha256(data).hexdigest()))
    return out


# ---------------------------------------------------------------------------------------------
# Model configuration (the raw config.json, shaped like the Qwen3.5 releases')
# ---------------------------------------------------------------------------------------------
VOCAB = 2048
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
    eos_token_id=2,
    pad_token_id=0,
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


# ---------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------
def build_text_tokenizer(texts, vocab_size: int):
    """A Qwen-style byte-level BPE (same pre-tokenizer and specials as the Markov fixture's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    sys.path.insert(0, str(REPO))
    from mtpconvert.fixture.language import PRETOKENIZE_REGEX, SPECIALS

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok, SPECIALS


TOKENIZER_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "model_max_length": 4096,
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
}


def prepare(args) -> None:
    stage = Path(args.stage)
    stage.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train = read_files(TRAIN_FILES)
    held = read_files(HELDOUT_FILES)
    tok, specials = build_text_tokenizer([t for _, t, _ in train], args.vocab)
    tok.save(str(stage / "tokenizer.json"))
    (stage / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    eot = tok.token_to_id(specials[0])

    def ids(files):
        out = []
        for _, text, _ in files:
            out.extend(tok.encode(text).ids)
            out.append(eot)  # documents separated by <|endoftext|>
        return np.array(out, dtype=np.uint16)

    train_ids, held_ids = ids(train), ids(held)
    np.save(stage / "train.npy", train_ids)
    np.save(stage / "heldout.npy", held_ids)
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": str(stdlib_root()),
        "licence": LICENCE,
        "vocab_size": tok.get_vocab_size(),
        "train_files": [{"path": n, "sha256": h, "chars": len(t)} for n, t, h in train],
        "heldout_files": [{"path": n, "sha256": h, "chars": len(t)} for n, t, h in held],
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(held_ids.size),
        "train_chars": sum(len(t) for _, t, _ in train),
        "tokenizer_sha256": hashlib.sha256((stage / "tokenizer.json").read_bytes()).hexdigest(),
    }
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(train)} train files, {manifest['train_chars'] / 1e6:.2f} M chars -> "
          f"{train_ids.size / 1e6:.2f} M tokens "
          f"({manifest['train_chars'] / train_ids.size:.2f} chars/token); held out {held_ids.size} tokens; "
          f"{time.time() - t0:.1f} s")


# ---------------------------------------------------------------------------------------------
# train (torch + transformers only)
# ---------------------------------------------------------------------------------------------
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
    """(backbone Qwen3_5[Moe]ForCausalLM / Qwen3NextForCausalLM, MTP head module, transformers config)."""
    if variant == "next":
        return next_module().build_torch_next(shape)
    LM, Config, Layer, Norm = torch_classes(variant)
    cfg = {k: v for k, v in text_config(variant, shape).items() if k != "model_type"}
    return build_with(LM, Config(**cfg), Layer, Norm)


def next_module():
    """tools/train_text_fixture_next.py (Qwen3-Next specifics), sharing this module even when it runs as __main__."""
    sys.modules.setdefault("train_text_fixture", sys.modules[__name__])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import train_text_fixture_next

    return train_text_fixture_next


def glm_module():
    """tools/train_text_fixture_glm.py (GLM-5 / glm_moe_dsa specifics), sharing this module like next_module."""
    sys.modules.setdefault("train_text_fixture", sys.modules[__name__])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import train_text_fixture_glm

    return train_text_fixture_glm


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


def torch_state(lm, head, f32_suffixes=F32_SUFFIXES) -> dict:
    """Backbone under transformers' names, head under mtp.*, as the release stores them (bf16; Qwen3.5 keeps
    A_log and the gated norm in f32, Qwen3-Next stores everything in bf16)."""
    import torch

    sd = {k: v for k, v in lm.state_dict().items()}
    sd.update({f"mtp.{k}": v for k, v in head.state_dict().items()})
    return {k: (v.detach().float() if k.endswith(tuple(f32_suffixes)) else v.detach().to(torch.bfloat16)).cpu()
            .contiguous() for k, v in sorted(sd.items())}


# ---------------------------------------------------------------------------------------------
# the training scaffold both trainers run (this file's train and train_text_fixture_glm.train_glm)
# ---------------------------------------------------------------------------------------------
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


def heldout_evaluator(lm, head, held_ids, args, router_logits=None, aux_coef=0.0):
    """A function that returns forward_losses' losses and stats, averaged over the first --eval-batches batches
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
            _, main, mtp, _, st = forward_losses(lm, head, held_ids[s[:, None] + offsets], router_logits, aux_coef)
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


def train(args) -> None:
    if args.variant == "glm5":
        return glm_module().train_glm(args)
    import torch

    out, dev, rng, train_ids, held_ids = open_run(args)
    lm, head, config = build_torch(args.variant, moe_shape(args))
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
    f32_suffixes = () if args.variant == "next" else F32_SUFFIXES

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


def load_checkpoint(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


# what the exports and parity checks of all variants (this file's, _next's, _glm's) share
def checkpoint_step(name: str) -> int:
    """The step of a checkpoint file, step-NNNNNN.safetensors."""
    return int(name.split("-")[1].split(".")[0])


def provenance(script: str, commands, manifest: dict, log: dict, ckpt: str) -> dict:
    """training.json's opening keys: what made the fixture, from which corpus, tokenizer, run and checkpoint."""
    return {
        "script": script,
        "commands": commands or [],
        "corpus": {"source": "CPython standard library, pure-Python modules (stdlib path of the interpreter)",
                   "licence": manifest["licence"], "python": manifest["python"],
                   "train_files": manifest["train_files"], "heldout_files": manifest["heldout_files"],
                   "train_tokens": manifest["train_tokens"], "heldout_tokens": manifest["heldout_tokens"]},
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_size": manifest["vocab_size"],
                      "sha256": manifest["tokenizer_sha256"]},
        "training": {k: log[k] for k in ("variant", "device", "gpu", "torch", "transformers", "params", "steps",
                                         "tokens_seen", "wall_s", "args")},
        "checkpoint": {"file": ckpt, "step": checkpoint_step(ckpt)},
    }


def logged_at(log: dict, step: int):
    """The run's log line of ``step``, or None where it wrote none."""
    return next((h for h in reversed(log["history"]) if h["step"] == step), None)


def write_tokenizer_and_generation(out: Path, stage: Path) -> None:
    """A fixture folder's generation_config.json (greedy, <|im_end|> ends) and the stage's tokenizer files."""
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 2}, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((stage / f).read_bytes())


def write_shards(out: Path, state: dict, weight_map: dict, shards) -> int:
    """OUT's model*.safetensors* replaced by ``state`` split as ``weight_map`` says (key -> one of ``shards``),
    and its index; returns the tensors' bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    for shard in shards:
        save_file({k: state[k] for k, s in weight_map.items() if s == shard}, str(out / shard),
                  metadata={"format": "pt"})
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def readme_method(record: dict, script_note: str, command: str, hidden_args=("device",)) -> str:
    """A fixture README's "How it was made" section: ``script_note`` names the script, then the commands run, the
    ``train`` run's options as ``command train ...`` (without ``hidden_args``) and where it ran."""
    tr = record["training"]
    opts = " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in tr["args"].items() if v is not None and k not in hidden_args)
    where = f"{tr['gpu']} (torch {tr['torch']}, transformers {tr['transformers']})" if tr["gpu"] else \
        f"the CPU (torch {tr['torch']}, transformers {tr['transformers']})"
    commands = "\n".join(record["commands"])
    return f"""## How it was made

Script: {script_note}. Commands, as run:

```
{commands}
```

Arguments of the `train` run exactly as parsed (`training.args` in training.json; `--out` was the
run folder where it ran):

```
{command} train {opts}
```

{tr['steps']} steps, {tr['tokens_seen']} tokens seen, {tr['wall_s']} s on {where};
exported checkpoint `{record['checkpoint']['file']}`. The loss history and held-out losses are in
training.json.
"""


def parity_ids(args, vocab_size: int):
    """(the stage's held-out ids or None, the first --tokens of them, or --tokens random ids without a stage)."""
    held = np.load(Path(args.stage) / "heldout.npy") if args.stage else None
    ids = held[: args.tokens] if held is not None else np.random.default_rng(0).integers(3, vocab_size, args.tokens)
    return held, ids


def loading_problems(info: dict, head_prefix: str):
    """from_pretrained's loading info: (missing, mismatched, unexpected keys but the head's, under ``head_prefix``)."""
    missing = info.get("missing_keys") or []
    mismatched = info.get("mismatched_keys") or []
    unexpected = [k for k in info.get("unexpected_keys") or [] if not k.startswith(head_prefix)]
    return missing, mismatched, unexpected


def export(args) -> None:
    if args.variant == "next":
        return next_module().export_next(args)
    if args.variant == "glm5":
        return glm_module().export_glm(args)
    import mlx.core as mx

    sys.path.insert(0, str(REPO))
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
    if json.loads((Path(args.folder) / "config.json").read_text())["model_type"] == "qwen3_next":
        return next_module().parity_next(args)
    if json.loads((Path(args.folder) / "config.json").read_text())["model_type"] == "glm_moe_dsa":
        return glm_module().parity_glm(args)
    import subprocess
    import tempfile

    import mlx.core as mx
    import torch

    sys.path.insert(0, str(REPO))
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    p = sub.add_parser("prepare", help="corpus -> tokenizer and token ids")
    p.add_argument("--stage", required=True)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.set_defaults(func=prepare)

    p = sub.add_parser("train", help="train one variant (torch)")
    p.add_argument("--stage", required=True)
    p.add_argument("--variant", choices=sorted(VARIANTS) + ["next", "glm5"], default="dense")
    p.add_argument("--out", required=True)
    add_optimisation_args(p)
    p.add_argument("--experts", type=int, default=None, help="MoE: routed experts (default: the variant's)")
    p.add_argument("--top-k", type=int, default=None, help="MoE: experts per token")
    p.add_argument("--expert-size", type=int, default=None, help="MoE: each routed expert's intermediate size")
    p.add_argument("--shared-expert-size", type=int, default=None, help="MoE: the shared expert's intermediate size")
    p.add_argument("--final-norm-spread", type=float, default=3.0,
                   help="final norms' gains start log-uniform in [1/S, S] (1: all ones)")
    p.add_argument("--device", default=None)
    p.add_argument("--experts-implementation", default=None,
                   help="MoE: transformers' experts kernel (grouped_mm, batched_mm, eager; default: its choice)")
    add_logging_args(p)
    p.set_defaults(func=train)

    p = sub.add_parser("export", help="checkpoint -> raw Hugging Face fixture folder")
    p.add_argument("--stage", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--variant", choices=sorted(VARIANTS) + ["next", "glm5"], default="dense")
    p.add_argument("--checkpoint", default=None, help="file in RUN (default: the last)")
    p.add_argument("--out", default=None)
    p.add_argument("--commands", nargs="*", help="the commands that made it, recorded in training.json")
    p.set_defaults(func=export)

    p = sub.add_parser("parity", help="transformers vs MLX on a raw folder (Qwen3-Next: vs the trained model, torch only)")
    p.add_argument("folder")
    p.add_argument("--stage", default=None, help="take the tokens from STAGE's held-out ids")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--run", default=None, help="Qwen3-Next: also compare with this train run's checkpoint")
    p.add_argument("--checkpoint", default=None, help="file in RUN (default: the one training.json names)")
    p.add_argument("--acceptance", action="store_true", help="Qwen3-Next: also measure the head's acceptance (STAGE)")
    p.set_defaults(func=parity)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
