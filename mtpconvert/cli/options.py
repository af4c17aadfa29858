"""Option aliases shared by the commands, and their choices, built from ``mtpconvert.options``."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, List, Optional

import typer

from ..gate import SMOKE_MODES, Gate
from ..options import FLOAT_DTYPES, HIDDEN_STATES, MODES, MTP_LAYOUTS, MTP_POLICIES, ConvertOptions, QuantOptions

DType = Enum("DType", {d: d for d in FLOAT_DTYPES}, type=str)
QMode = Enum("QMode", {m: m for m in MODES}, type=str)
MtpPolicy = Enum("MtpPolicy", {p: p for p in MTP_POLICIES if p != "bits"}, type=str)  # bits: via --mtp-bits
MtpLayoutChoice = Enum("MtpLayoutChoice", {m: m for m in MTP_LAYOUTS}, type=str)
Hidden = Enum("Hidden", {h: h for h in HIDDEN_STATES}, type=str)
SmokeModeChoice = Enum("SmokeModeChoice", {m: m for m in SMOKE_MODES}, type=str)
BenchHidden = Enum("BenchHidden", {**{h: h for h in HIDDEN_STATES}, "both": "both"}, type=str)

_AFFINE = ", ".join(map(str, MODES["affine"][0]))

Bits = Annotated[Optional[int], typer.Option(
    "--bits", "-q", help=f"Quantize the backbone to this many bits (affine: {_AFFINE}; mxfp4/nvfp4: 4; mxfp8: 8).",
    show_default=False)]
GroupSize = Annotated[Optional[int], typer.Option(
    "--group-size", help="Quantization group size (affine: 32, 64, 128, default 64; fixed for the fp modes).",
    show_default=False)]
QModeOpt = Annotated[QMode, typer.Option("--q-mode", help="Quantization mode (needs --bits).")]
DTypeOpt = Annotated[Optional[DType], typer.Option("--dtype", help="Float dtype of the output (default: the "
                                                   "source's).", show_default=False)]
Mtp = Annotated[MtpPolicy, typer.Option("--mtp", help="MTP head: keep at --dtype, match the backbone's "
                                        "quantization, or drop.")]
MtpBits = Annotated[Optional[int], typer.Option("--mtp-bits", help=f"Quantize the MTP head to N bits (affine: "
                                                f"{_AFFINE}).", show_default=False)]
MtpLayout = Annotated[MtpLayoutChoice, typer.Option(
    "--mtp-layout", help="Where the head goes: sidecar (mtp.safetensors + mtp/; read by mlx-vlm, mtplx, rapid-mlx, "
    "vllm-mlx, safe with every mlx-lm) or in-model (language_model.mtp.* in the shards; mlx-lm PR #990).")]
KeepVision = Annotated[bool, typer.Option("--keep-vision", help="Keep the vision tower (mlx-vlm naming).")]
MaxShardSize = Annotated[float, typer.Option("--max-shard-size", help="Largest output shard, in GB.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")]
Resume = Annotated[bool, typer.Option("--resume", help="Reuse shards an interrupted run finished (re-hashed "
                                      "first).")]
NoVerify = Annotated[bool, typer.Option("--no-verify", help="Skip verifying the output before it is committed.")]
NoSmoke = Annotated[bool, typer.Option("--no-smoke", help="Skip the MTP decode smoke test.")]
SmokeMode = Annotated[SmokeModeChoice, typer.Option(
    "--smoke-mode", help="full: load the model and decode; layerwise: teacher-forced, one layer in memory at a "
    "time; auto: full when the weights fit in the memory available.")]
MinAcceptance = Annotated[Optional[float], typer.Option(
    "--min-acceptance", help="Smoke floor for greedy draft acceptance (default: 0.4 for the decoding smoke, 0.3 for "
    "the layerwise one, whose teacher-forced acceptance reads lower).", show_default=False)]
MinMlpGain = Annotated[Optional[float], typer.Option(
    "--min-mlp-gain", help="Smoke floor for the head's MLP gain: acceptance with its MLP minus without it "
    "(default 0.035; a head whose experts are misordered drafts like one with no MLP: docs/runtime.md). "
    "-1 reports it without gating (e.g. random test weights).", show_default=False)]
Token = Annotated[Optional[str], typer.Option("--token", help="Hub token (default: HF_TOKEN or the saved login).",
                                              show_default=False)]
Revision = Annotated[Optional[str], typer.Option("--revision", help="Branch, tag or commit (pinned to its sha).",
                                                 show_default=False)]
Private = Annotated[bool, typer.Option("--private", help="Create the Hub repository as private.")]
Concurrency = Annotated[Optional[str], typer.Option(
    "--concurrency", help="Concurrent streams to bench batched MTP at, comma-separated (e.g. 1,2,4,8), against "
    "mlx-lm's BatchGenerator.", show_default=False)]
OracleAcceptance = Annotated[Optional[List[float]], typer.Option(
    "--oracle-acceptance", help="Replace each greedy draft by the true next greedy token with probability P (else "
    "a wrong one; with --concurrency: keep each draft with probability P): MTP measured at acceptance P on any "
    "model, random weights too; the head still runs. Repeatable; every table row and JSON row is labelled with P.",
    show_default=False, metavar="P")]
CudaQmv = Annotated[bool, typer.Option(
    "--cuda-qmv", help="On a CUDA device: use mtpconvert's multi-row 4-bit quantized matvec for the verify passes "
    "where it measures faster than MLX's and within tolerance (docs/cuda.md).")]
Prompts = Annotated[Optional[List[str]], typer.Option("--prompt", "-p", help="Prompt text (repeatable).",
                                                      show_default=False)]
BaseModel = Annotated[Optional[str], typer.Option(
    "--base-model", help="Hub repo id of the source release (e.g. Qwen/Qwen3.5-27B), recorded for the model card.",
    show_default=False)]
PrefetchShards = Annotated[Optional[int], typer.Option(
    "--prefetch-shards", help="With --stream: raw shards downloaded ahead of the one being converted (default 1; "
    "0: one raw shard on disk at a time, each download waits for the previous shard to be deleted).",
    show_default=False)]
RawWindow = Annotated[Optional[float], typer.Option(
    "--raw-window", help="With --stream: fetch raw data in byte ranges (each block's source just before it is "
    "converted, freed once written), at most this many GB of it on disk, whatever the shard size; instead of "
    "whole shards (--prefetch-shards).", show_default=False, metavar="GB")]
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds to wait for the Hub before failing.")]

DEFAULTS = dict(q_mode=QMode.affine, mtp=MtpPolicy.keep, mtp_layout=MtpLayoutChoice.sidecar, max_shard_gb=5.0,
                min_acceptance=None, min_mlp_gain=None, smoke_mode=SmokeModeChoice.auto)


def convert_options(*, dtype: Optional[DType], bits: Optional[int], group_size: Optional[int], q_mode: QMode,
                    mtp: MtpPolicy, mtp_bits: Optional[int], keep_vision: bool, max_shard_gb: float,
                    mtp_layout: MtpLayoutChoice = MtpLayoutChoice.sidecar) -> ConvertOptions:
    """The shared conversion options of `convert` and `pull-and-quantize`."""
    return ConvertOptions(
        dtype=dtype.value if dtype else None,
        quant=QuantOptions(bits, group_size, q_mode.value, mtp.value, mtp_bits),
        keep_vision=keep_vision,
        max_shard_bytes=int(max_shard_gb * (1 << 30)),
        mtp_layout=mtp_layout.value,
    )


def checks(no_verify: bool, no_smoke: bool, min_acceptance: float, smoke_mode: SmokeModeChoice,
           min_mlp_gain: Optional[float] = None) -> Gate:
    """The post-checks the shared options ask for (``min_mlp_gain`` None: the default floor)."""
    gain = {} if min_mlp_gain is None else {"min_mlp_gain": min_mlp_gain}
    return Gate(verify=not no_verify, smoke=not no_smoke, min_acceptance=min_acceptance, **gain,
                  smoke_mode=smoke_mode.value)
