"""How much MTP precision matters: acceptance of the fixture's head at several MTP policies.

Converts the bundled raw fixture with the backbone at 4 bits and the MTP head kept bf16,
matched (4-bit), or quantized to 8/3/2 bits, then measures draft acceptance with greedy
decoding and with sampling (temperature 1, where acceptance ~ 1 - TV(p, q) and so reacts to
any drift in the head's distribution), for both hidden-state conventions.

    python -m benchmarks.mtp_precision [--variant dense|moe] [--max-tokens 96] [--prompts 6]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from mtpconvert.demo import fixture_prompts
from mtpconvert.execute import execute
from mtpconvert.fixture import fixture_path
from mtpconvert.options import ConvertOptions
from mtpconvert.plan import build_plan
from mtpconvert.options import QuantOptions
from mtpconvert.runtime.smoke.decode import encode_prompts
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.decoding.sampling import Sampling
from mtpconvert.runtime.decoding.speculative import DecodeStats, mtp_generate
from mtpconvert.io.checkpoint import open_checkpoint

POLICIES = [
    ("keep (bf16)", dict(mtp="keep")),
    ("match (4-bit)", dict(mtp="match")),
    ("--mtp-bits 8", dict(mtp_bits=8)),
    ("--mtp-bits 3", dict(mtp_bits=3)),
    ("--mtp-bits 2", dict(mtp_bits=2)),
]


def measure(path: Path, prompts, max_tokens: int, sampling: Sampling, hidden: str, seeds: int) -> DecodeStats:
    m = load(path)
    total = DecodeStats()
    for i, ids in enumerate(encode_prompts(path, prompts)):
        for s in range(seeds):
            _, st = mtp_generate(m, ids, max_tokens, sampling=sampling, hidden=hidden, seed=100 * i + s)
            total.add(st)
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=["dense", "moe"], default="dense")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=6)
    args = ap.parse_args(argv)
    prompts = fixture_prompts(args.prompts)
    print(f"| MTP policy (backbone 4-bit g32, {args.variant}) | greedy post-norm | greedy pre-norm "
          f"| sampled T=1 post-norm | sampled T=1 pre-norm |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, policy in POLICIES:
            out = Path(tmp) / label.replace(" ", "_")
            ckpt = open_checkpoint(fixture_path(args.variant))
            q = QuantOptions(bits=4, group_size=32, **policy)
            execute(build_plan(ckpt, ConvertOptions(dtype="bfloat16", quant=q)), ckpt, out)
            cells = []
            for sampling, seeds in ((Sampling(), 1), (Sampling(temperature=1.0), 3)):
                for hidden in ("post-norm", "pre-norm"):
                    st = measure(out, prompts, args.max_tokens, sampling, hidden, seeds)
                    cells.append(f"{st.acceptance:.1%} ({sum(st.accepted)}/{sum(st.proposed)})")
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
