"""The plain-decoding baseline: mlx-lm's own ``generate_step`` on the folder's stock backbone.

``bench`` and the demo compare MTP decoding against this, not against our ``plain_generate``:
mlx-lm builds the next step's graph while the current one runs (``mx.async_eval`` on its
generation stream), and a synchronous loop is up to ~1.5x slower on a GPU (issue #17), which
would inflate every speedup. Same sampler settings through ``mlx_lm.sample_utils.make_sampler``.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..decoding.load import MTPModel
from ..decoding.sampling import Sampling
from ..decoding.speculative import DecodeStats

DECODER = "mlx_lm.generate.generate_step"


def mlx_lm_sampler(sampling: Sampling) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler for our settings. mlx-lm spells "no nucleus filter" top_p=0, we spell it 1.

    mlx-lm applies top-p before top-k (we apply top-k first): with both set the two samplers'
    distributions can differ slightly; either one alone, and greedy, agree.
    """
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(temp=sampling.temperature, top_p=sampling.top_p if sampling.top_p < 1 else 0.0,
                        top_k=sampling.top_k)


def mlx_lm_generate(
    m: MTPModel, prompt: Sequence[int], max_tokens: int, sampling: Sampling = Sampling(),
    seed: Optional[int] = None, eos: Sequence[int] = (), on_tokens: Optional[Callable[[int], None]] = None,
    logits_processors: Optional[list] = None,
) -> Tuple[List[int], DecodeStats]:
    """Decode ``max_tokens`` tokens with ``generate_step``; returns (tokens, stats) timed like ours.

    prefill_s runs to the first token, decode_s from there to the last one. mlx-lm samples from
    MLX's global random state, so ``seed`` seeds it (its draws are not our keyed draws).
    ``logits_processors`` go to ``generate_step`` as they are (the reference for batched rows' processors).
    """
    from mlx_lm.generate import generate_step

    if seed is not None:
        mx.random.seed(seed)
    stats = DecodeStats(prompt_tokens=len(prompt))
    out: List[int] = []
    t0 = time.perf_counter()
    steps = generate_step(mx.array(list(prompt)), m.model, max_tokens=max_tokens, sampler=mlx_lm_sampler(sampling),
                          logits_processors=logits_processors)
    for token, _ in steps:
        if not out:
            stats.prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
        elif on_tokens:
            on_tokens(1)
        out.append(int(token))
        if out[-1] in eos:
            break
    steps.close()  # the generator holds one step in flight; closing it lets that finish unused
    stats.decode_s = time.perf_counter() - t0
    stats.emitted = len(out)
    return out, stats
