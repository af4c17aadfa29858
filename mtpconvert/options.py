"""The options a conversion, a pull and a bench take, and the one vocabulary of their choices.

The CLI builds its choices from these tuples, the recipes validate against them, the
plan checks them: a new mode or dtype is added here once. Each options value checks its
own ranges and combinations when it is made (``QuantOptions`` when ``validated``), and
refuses with an ``OptionsError`` naming the command-line option; the CLI only parses text.
Standard library only at import: the publish workflow imports the recipes, and so this
module, before anything is installed (``PublishOptions`` asks huggingface_hub when made).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Tuple

from .errors import OptionsError

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# mode -> (allowed bits, default group size, allowed group sizes)
MODES = {
    "affine": ((2, 3, 4, 5, 6, 8), 64, (32, 64, 128)),
    "mxfp4": ((4,), 32, (32,)),
    "nvfp4": ((4,), 16, (16,)),
    "mxfp8": ((8,), 32, (32,)),
}
MTP_POLICIES = ("keep", "match", "bits", "drop")
# Where the MTP head is written (docs/interop.md says which runtime reads which):
#   sidecar   root mtp.safetensors (mtp.* keys) + mtp/weights.safetensors link + manifest; the
#             model shards hold no mtp.* key, so no mlx-lm version shifts the backbone twice
#   in-model  language_model.mtp.* inside the model shards (mlx-lm PR #990, oMLX)
MTP_LAYOUTS = ("sidecar", "in-model")
DEFAULT_MAX_SHARD_BYTES = 5 << 30
DEFAULT_HUB_TIMEOUT = 30.0  # seconds without an answer before a Hub metadata call fails
DEFAULT_PREFETCH_SHARDS = 1  # raw shards a streamed pull downloads ahead of the one being read
# the backbone state fed to the MTP head: after the final norm or before it (bench measures both)
HIDDEN_STATES = ("post-norm", "pre-norm")


@dataclass(frozen=True)
class QuantOptions:
    bits: Optional[int] = None  # None: no quantization at all
    group_size: Optional[int] = None
    mode: str = "affine"
    mtp: str = "keep"
    mtp_bits: Optional[int] = None

    def validated(self) -> "QuantOptions":
        if self.mode not in MODES:
            raise OptionsError(f"--q-mode must be one of {sorted(MODES)}, got {self.mode!r}")
        allowed_bits, default_group, allowed_groups = MODES[self.mode]
        group = self.group_size
        if self.bits is not None:
            if self.bits not in allowed_bits:
                raise OptionsError(f"--bits {self.bits} is not valid for mode {self.mode} (allowed: {allowed_bits})")
            group = group or default_group
            if group not in allowed_groups:
                raise OptionsError(
                    f"--group-size {group} is not valid for mode {self.mode} (allowed: {allowed_groups})"
                )
        if self.mtp not in MTP_POLICIES:
            raise OptionsError(f"--mtp must be one of {MTP_POLICIES}, got {self.mtp!r}")
        if self.bits is None and self.mode != "affine":
            raise OptionsError(f"--q-mode {self.mode} needs --bits {allowed_bits[0]} (without --bits nothing is "
                               "quantized)")
        mtp = self.mtp
        if self.mtp_bits is not None:
            if self.mtp_bits not in MODES["affine"][0]:
                raise OptionsError(f"--mtp-bits {self.mtp_bits} is not a valid affine bit width")
            if mtp not in ("keep", "bits"):
                raise OptionsError(f"--mtp-bits conflicts with --mtp {mtp}")
            mtp = "bits"
        elif mtp == "bits":
            raise OptionsError("--mtp bits needs --mtp-bits N")
        if mtp == "match" and self.bits is None:
            raise OptionsError("--mtp match needs --bits (there is no backbone quantization to match)")
        return QuantOptions(self.bits, group, self.mode, mtp, self.mtp_bits)


@dataclass(frozen=True)
class ConvertOptions:
    dtype: Optional[str] = None  # None: the source's float dtype (config "dtype"/"torch_dtype")
    quant: QuantOptions = QuantOptions()
    keep_vision: bool = False
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    mtp_layout: str = "sidecar"


@dataclass(frozen=True)
class ExecuteOptions:
    """How ``execute`` writes OUT: whether an existing OUT is replaced, whether shards an interrupted run of
    the same plan finished are reused, what the index records beside the plan, and the pipeline's sizes (the
    bytes written do not depend on ``workers`` or ``block_bytes``: tests and benchmarks vary them)."""

    overwrite: bool = False
    resume: bool = False
    extra_metadata: Optional[dict] = None  # entries of the index's metadata.mtpconvert beside the plan's
    workers: Optional[int] = None  # MLX CPU streams; None: one per core, at most 8
    block_bytes: Optional[int] = None  # a block's source bytes at most (one row at least); None: the default

    def __post_init__(self):
        for name, value in (("workers", self.workers), ("block_bytes", self.block_bytes)):
            if value is not None and value < 1:
                raise OptionsError(f"{name} must be 1 or more, not {value!r}")


@dataclass(frozen=True)
class HubSource:
    """A release on the Hub and how to reach it. ``revision`` (a branch, tag or commit; None: main) is pinned
    to its commit. ``token`` (None: HF_TOKEN or the saved login) goes to huggingface_hub only: it is left out
    of this value's repr. ``cache_dir`` is huggingface_hub's cache (None: HF_HOME's); ``local_dir`` a folder
    to download into instead (a streamed pull stages its raw shards there, and leaves it)."""

    repo_id: str
    revision: Optional[str] = None
    token: Optional[str] = field(default=None, repr=False)
    cache_dir: Optional[Path] = None
    local_dir: Optional[Path] = None
    timeout: float = DEFAULT_HUB_TIMEOUT

    def __post_init__(self):
        if not _positive_number(self.timeout):
            raise OptionsError(f"--timeout must be a number of seconds above 0, not {self.timeout!r}")
        for name in ("cache_dir", "local_dir"):  # a str given: kept as a Path; an empty one: none
            folder = getattr(self, name)
            object.__setattr__(self, name, Path(folder) if folder else None)


@dataclass(frozen=True)
class RawPolicy:
    """How much of the raw release a pull holds on disk. Without ``stream`` every file is downloaded first.
    With ``stream`` each raw shard is fetched when first needed and deleted after its last use,
    ``prefetch_shards`` of them downloaded ahead of the one being read (None: ``DEFAULT_PREFETCH_SHARDS``;
    0: one on disk at a time); or, with ``raw_window_gb``, byte ranges instead of shards: each block's
    source just before it is made, freed once it is written, at most that many GB ahead, whatever the
    shard size."""

    stream: bool = False
    prefetch_shards: Optional[int] = None
    raw_window_gb: Optional[float] = None

    def __post_init__(self):
        for flag, value in (("--prefetch-shards", self.prefetch_shards), ("--raw-window", self.raw_window_gb)):
            if value is not None and not self.stream:
                raise OptionsError(f"{flag} needs --stream (a plain pull downloads every shard first)")
        if self.prefetch_shards is not None and self.raw_window_gb is not None:
            raise OptionsError("--prefetch-shards and --raw-window exclude each other: whole shards or byte ranges")
        if self.raw_window_gb is not None and not _positive_number(self.raw_window_gb):
            raise OptionsError(f"--raw-window must be a number of GB above 0, not {self.raw_window_gb!r}",
                               hint="e.g. 1: raw byte ranges fetched at most 1 GB ahead of the conversion")
        prefetch = self.prefetch_shards
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0):
            raise OptionsError(f"--prefetch-shards must be 0 or more, not {prefetch!r}",
                               hint="0: one raw shard on disk at a time; 1 (default): the next one downloads while "
                               "one converts")

    @property
    def shards_held(self) -> int:
        """Raw shards a streamed pull may hold at once: the one read, plus those downloaded ahead."""
        return 1 + (DEFAULT_PREFETCH_SHARDS if self.prefetch_shards is None else self.prefetch_shards)

    @property
    def window_bytes(self) -> Optional[int]:
        """The byte window (decimal GB, like the runner sizes it is chosen against); None: whole shards."""
        return None if self.raw_window_gb is None else int(self.raw_window_gb * 1e9)

    def record(self) -> Optional[dict]:
        """The index record's ``stream`` entry (``provenance.command_args`` reads it back): the window, or a
        prefetch depth other than the default; None where the record reads as a plain pull's."""
        if self.raw_window_gb is not None:
            return {"raw_window_gb": self.raw_window_gb}
        if self.prefetch_shards not in (None, DEFAULT_PREFETCH_SHARDS):
            return {"prefetch_shards": self.prefetch_shards}
        return None

    def describe(self) -> str:
        """What is on disk of the raw release at once, in words: "1 GB window", "2 shards", "every shard"."""
        if not self.stream:
            return "every shard"
        if self.raw_window_gb is not None:
            return f"{self.raw_window_gb:g} GB window"
        return f"{self.shards_held} shard{'s' if self.shards_held != 1 else ''}"


@dataclass(frozen=True)
class PublishOptions:
    """Where a pull's result goes: the Hub repository ``repo_id`` (created if absent, as ``private``), with
    its model card, in one commit."""

    repo_id: str
    private: bool = False

    def __post_init__(self):
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(self.repo_id)
        except HFValidationError:
            raise OptionsError(f"--upload-repo must be a Hub repo id like me/Qwen3.5-27B-4bit-mtp, got "
                               f"{self.repo_id!r}") from None


def checked_prompts(prompts: Optional[Sequence[str]]) -> Optional[Sequence[str]]:
    """Prompts as given (None: the default ones), refused when one is blank."""
    if prompts is not None and any(not p.strip() for p in prompts):
        raise OptionsError("--prompt must not be empty")
    return prompts


@dataclass(frozen=True)
class BenchOptions:
    """What ``bench`` measures: ``max_tokens`` decoded per prompt (None: the smoke's prompts), per number of
    chained drafts in ``depths`` and per backbone state in ``hiddens`` (``HIDDEN_STATES``; with ``concurrency``
    the first only), sampled at ``temperature`` (0: greedy), ``top_p`` and ``top_k`` (0: off) from ``seed``.

    ``concurrency``: numbers of concurrent streams to bench batched MTP at, against mlx-lm's BatchGenerator,
    instead of one stream at a time. ``oracle``: acceptance rates P (greedy only): every row once per P,
    each draft replaced by the true greedy token with probability P (with ``concurrency``: kept with
    probability P). ``cuda_qmv``: on a CUDA device, the multi-row quantized matvec where it measures faster.
    ``warmup_tokens``: tokens of each untimed warm-up decode (None: ``max_tokens``); ``cross_check``: time our
    plain loop beside mlx-lm's; ``step_costs``: time a step of each kind. Sequences given as lists are kept as
    tuples."""

    prompts: Optional[Tuple[str, ...]] = None
    max_tokens: int = 128
    depths: Tuple[int, ...] = (1,)
    hiddens: Tuple[str, ...] = HIDDEN_STATES
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    concurrency: Optional[Tuple[int, ...]] = None
    oracle: Tuple[float, ...] = ()
    cuda_qmv: bool = False
    warmup_tokens: Optional[int] = None
    cross_check: bool = True
    step_costs: bool = True

    def __post_init__(self):
        for name in ("prompts", "depths", "hiddens", "concurrency", "oracle"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        checked_prompts(self.prompts)
        if self.max_tokens < 1:
            raise OptionsError(f"--max-tokens must be 1 or more, not {self.max_tokens}")
        if self.warmup_tokens is not None and self.warmup_tokens < 1:
            raise OptionsError(f"warmup_tokens must be 1 or more, not {self.warmup_tokens}")
        if not self.depths or any(d < 1 for d in self.depths):
            raise OptionsError("--depth must be >= 1")
        if not self.hiddens or any(h not in HIDDEN_STATES for h in self.hiddens):
            raise OptionsError(f"--mtp-hidden must be one of {HIDDEN_STATES}, not {self.hiddens}")
        if self.temperature < 0:
            raise OptionsError(f"--temp must be 0 (greedy) or more, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise OptionsError(f"--top-p must be above 0 and at most 1, not {self.top_p}")
        if self.top_k < 0:
            raise OptionsError(f"--top-k must be 0 (off) or more, not {self.top_k}")
        if self.concurrency is not None and (not self.concurrency or any(c < 1 for c in self.concurrency)):
            raise OptionsError(f"--concurrency must list stream counts >= 1, e.g. 1,2,4,8, not "
                               f"{','.join(map(str, self.concurrency))!r}")
        if self.oracle and (not self.greedy or any(not 0 <= p <= 1 for p in self.oracle)):
            raise OptionsError("--oracle-acceptance takes rates in [0, 1] and needs greedy decoding (--temp 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _positive_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0
