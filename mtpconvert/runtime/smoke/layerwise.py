"""Layer-by-layer MTP acceptance check: the smoke test for models that do not fit in memory.

``mtpconvert smoke`` loads the whole model and decodes; a 27B-397B conversion on a 16 GB
runner cannot. This check streams the folder one decoder layer at a time over a short batch
of real text and measures the head **teacher-forced**:

    backbone   x_0 = embed(tokens); x_i = layer_i(x_{i-1}); h = norm(x_n)     (all prompts, all positions)
    head       s_t = mtp(h_t, embed(token_{t+1}))   (fresh KV cache over the whole sequence)
    compare    argmax lm_head(mtp.norm(s_t))  ==  argmax lm_head(h_{t+1})    for t = 0 .. L-2

that is, the head's guess for token t+2 against the backbone's greedy prediction of the same
token given the true t+1. That is exactly the question the first draft of every greedy decode
step asks, so on a correct head it is the greedy acceptance, and on a broken head (norms not
shifted, experts out of order, wrong hidden state) it collapses.

What is resident when (everything else stays on disk):

1. headers of every shard, and the folder's tensors as *lazy* ``mx.load`` arrays (``mx.load``
   reads a tensor's bytes only when that array is evaluated, straight into its buffer);
2. the embedding rows of the prompts' distinct tokens, copied out of the file (a quantized
   table is gathered row-wise and dequantized by mlx's own ``QuantizedEmbedding``), never the
   table;
3. one decoder layer at a time: built from the backbone library's own class (the family's adapter,
   ``runtime.backbone``), quantized from config.json exactly as ``mlx_lm.utils.load_model`` does,
   filled with only its tensors (after the library's ``sanitize``), run over every prompt, then
   dropped (``mx.clear_cache`` returns its buffers);
4. the MTP head's first layer with ``fc`` and its norms (located by ``locate_mtp``: a root
   ``mtp.safetensors`` sidecar or the family's head prefix inside the shards);
5. ``lm_head`` (or the tied embedding) a block of vocabulary rows at a time, for the backbone's
   and the head's states together, keeping a running argmax.

Activations are the prompts' hidden states (``tokens x hidden``, a few MB for a 27B model).

``exact=True`` runs every layer with the stock modules, so the predictions are the ones the
fully loaded model makes (the tests check this bit for bit). mlx's CPU backend multiplies
quantized matrices by many rows slowly (~0.1 GFLOP/s here against ~1-2 for a float GEMM), so
``exact=None`` (the default) runs on the CPU with every affine-quantized ``Linear`` (and every
``lm_head`` block) as a ``BlockLinear``: dequantized a block of rows at a time and multiplied in
floating point, the same predictions up to rounding (float32 where this machine's float32 GEMM
is faster, see ``fast_float_dtype``). On the CPU, unquantized MoE experts stay as stored and run
in float32 a bounded group of experts at a time, because mlx's CPU ``gather_mm`` is float32-only
(``runtime.decoding.experts.bound_float_experts``: bit-identical to casting the whole stack, as
the full-model loader does with ``runtime.decoding.load.float32_experts_on_cpu``). See docs/smoke.md
for measured memory and time.

Where each part lives: reading the folder a piece at a time (items 1-5) in ``runtime.smoke.shards``;
running a loaded layer, exact or block by block, in ``runtime.smoke.compute``; the teacher-forced
pass and its ``LayerwiseResult`` in ``runtime.smoke.teacher_forced``; whether a folder needs this
check at all (its weights against the memory available) in ``runtime.smoke.sizing``. This module
picks the prompts and runs the pass over a whole folder (``layerwise_acceptance``, or
``python -m mtpconvert.runtime.smoke.layerwise``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from ...errors import LayoutError
from ..decoding.locate import HeadTensors, locate_mtp
from .floors import LAYERWISE_MIN_ACCEPTANCE, MIN_MLP_GAIN
from .shards import _Folder
from .teacher_forced import DEFAULT_VOCAB_BLOCK_BYTES, LayerwiseResult, TeacherForcedPass

# Written for this check (not from any corpus): plain prose, code and a list, so that a head is
# scored on the kinds of text it will draft for. Each prompt is cut to ``max_prompt_tokens``.
DEFAULT_PROMPTS = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small "
    "oil lamp, a notebook and a thermos of tea, and he wrote down the colour of the sky, the height "
    "of the waves and the names of the ships that passed. After forty years the notebooks filled a "
    "whole shelf, and the town's children came to read them on rainy afternoons, looking for the "
    "day they were born and the weather their parents had seen that morning.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    i = j = 0\n"
    "    out = []\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n"
    "            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n\n\n"
    "def test_merge_sorted():\n    assert merge_sorted([1, 4, 9], [2, 3, 10]) == [1, 2, 3, 4, 9, 10]\n",
    "How to repot a houseplant, step by step:\n1. Water the plant a day before, so the roots hold "
    "together.\n2. Choose a pot one size larger, with a drainage hole.\n3. Put a layer of fresh soil "
    "at the bottom.\n4. Turn the old pot over, support the stem between two fingers and tap the rim "
    "until the plant slides out.\n5. Loosen the outer roots gently and set the plant in the new pot "
    "at the same depth as before.\n6. Fill the sides with soil, press lightly and water well.",
)
DEFAULT_MAX_PROMPT_TOKENS = 96


def encode(path: Path, prompts: Optional[Sequence[str]] = None,
           max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> List[List[int]]:
    """The prompts (default ``DEFAULT_PROMPTS``) through the folder's tokenizer, each cut to
    ``max_prompt_tokens``."""
    from .decode import encode_prompts

    return [ids[:max_prompt_tokens] for ids in encode_prompts(Path(path), list(prompts or DEFAULT_PROMPTS))]


def require_head(path: Path, config: dict, head_tensors: Optional[HeadTensors]) -> HeadTensors:
    """The head the check scores, or a LayoutError saying why there is none."""
    from ...families import family_for

    tc = config.get("text_config", config)
    family = family_for(config)
    count_key = family.mtp_count_key
    if head_tensors is None or not int(tc.get(count_key, 0) or 0):
        raise LayoutError(
            "no MTP head: " + (f"no mtp.safetensors and no {family.head_prefix}* tensors" if head_tensors is None
                               else f"config says {count_key}=0"),
            file=path,
            hint="convert the original release with `mtpconvert convert` (stock mlx_lm.convert drops mtp.*)",
        )
    return head_tensors


def prompt_token_ids(path: Path, prompts: Optional[Sequence[str]], token_ids: Optional[Sequence[Sequence[int]]],
                     max_prompt_tokens: int) -> List[List[int]]:
    """``token_ids`` as lists of ints, else ``prompts`` through the folder's tokenizer; prompts
    shorter than two tokens are dropped (nothing to compare)."""
    if token_ids is None:
        token_ids = encode(path, prompts, max_prompt_tokens)
    token_ids = [list(map(int, ids)) for ids in token_ids if len(ids) >= 2]
    if not token_ids:
        raise ValueError("no prompt has two tokens or more")
    return token_ids


def layerwise_acceptance(
    path: Path,
    prompts: Optional[Sequence[str]] = None,
    token_ids: Optional[Sequence[Sequence[int]]] = None,
    *,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    hidden: str = "post-norm",
    min_acceptance: float = LAYERWISE_MIN_ACCEPTANCE,
    exact: Optional[bool] = None,
    vocab_block_bytes: int = DEFAULT_VOCAB_BLOCK_BYTES,
    compute_dtype: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
    min_mlp_gain: Optional[float] = MIN_MLP_GAIN,
) -> LayerwiseResult:
    """Teacher-forced greedy MTP acceptance of ``path``, one layer resident at a time.

    ``token_ids`` (lists of ids) replaces tokenizing ``prompts``; ``exact`` is described in the
    module docstring (None: stock quantized kernels off the CPU, dequantized Linears on it).
    ``compute_dtype`` (only without ``exact``): "float32" runs the activations and the dequantized
    matmuls in float32; None picks it on the CPU when its float32 GEMM is faster
    (``fast_float_dtype``), else keeps the model's dtype. ``min_mlp_gain``: the floor of the head's
    MLP gain (``runtime.smoke.mlp_gain``; None: reported, not gated).
    """
    if hidden not in ("post-norm", "pre-norm"):
        raise ValueError(f"hidden must be post-norm or pre-norm, not {hidden!r}")
    t0 = time.perf_counter()
    path = Path(path)
    folder = _Folder(path)
    try:
        head_tensors = require_head(path, folder.config, locate_mtp(path, folder.headers))
        ids = prompt_token_ids(path, prompts, token_ids, max_prompt_tokens)
        run = TeacherForcedPass(folder, ids, hidden=hidden, min_acceptance=min_acceptance, exact=exact,
                                compute_dtype=compute_dtype, progress=progress, min_mlp_gain=min_mlp_gain)
        run.embed()
        while run.next_layer < run.layers:
            run.run_layer()
        result = run.finish(head_tensors, vocab_block_bytes)
        result.seconds = time.perf_counter() - t0
        return result
    finally:
        folder.close()
        mx.clear_cache()


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Layer-by-layer teacher-forced MTP acceptance of a converted folder.")
    ap.add_argument("path", type=Path)
    ap.add_argument("--prompt", "-p", action="append", help="prompt text (repeatable)")
    ap.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS)
    ap.add_argument("--min-acceptance", type=float, default=LAYERWISE_MIN_ACCEPTANCE)
    ap.add_argument("--min-mlp-gain", type=float, default=MIN_MLP_GAIN,
                    help="floor of the head's acceptance with its MLP minus without it (docs/runtime.md)")
    ap.add_argument("--mtp-hidden", choices=["post-norm", "pre-norm"], default="post-norm")
    ap.add_argument("--exact", action="store_true", default=None,
                    help="stock quantized kernels everywhere (bit-identical to the loaded model; slow on the CPU)")
    ap.add_argument("--compute-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="activations and dequantized matmuls (default: float32 where its GEMM is faster)")
    ap.add_argument("--vocab-block-mb", type=float, default=DEFAULT_VOCAB_BLOCK_BYTES / 2**20)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    say = (lambda msg: None) if args.quiet else (lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}",
                                                                   file=sys.stderr, flush=True))
    r = layerwise_acceptance(args.path, args.prompt, max_prompt_tokens=args.max_prompt_tokens,
                             hidden=args.mtp_hidden, min_acceptance=args.min_acceptance, exact=args.exact,
                             compute_dtype=args.compute_dtype, vocab_block_bytes=int(args.vocab_block_mb * 2**20), progress=say,
                             min_mlp_gain=args.min_mlp_gain)
    print(json.dumps(r.to_json()))
    return 0 if r.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
