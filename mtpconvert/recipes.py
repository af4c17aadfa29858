"""Per-model conversion recipes: small TOML files naming one published variant.

The recipes ship inside the package (``mtpconvert/data/recipes``, ``recipes/`` in a checkout
links there), so ``recipe list`` and ``recipe run NAME`` work from a plain ``pip install``.

A recipe is validated as a whole before anything runs: known keys only, a repository among the releases
sized in ``data/releases.toml``, options that QuantOptions/ConvertOptions accept, and the runner size it needs
(``runner``: a key of ``RUNNERS``; the publish workflow runs each recipe on that size).

    python -m mtpconvert.recipes matrix 'recipes/Qwen3.5-27B-*.toml' [--runner SIZE]

prints the publish workflow's job matrix (stdlib only: the workflow runs it before installing).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .errors import OptionsError
from .options import (DEFAULT_PREFETCH_SHARDS, FLOAT_DTYPES, ConvertOptions, HubSource, PublishOptions,
                      QuantOptions, RawPolicy)

BUNDLED = Path(__file__).parent / "data" / "recipes"
RELEASES_FILE = Path(__file__).parent / "data" / "releases.toml"
KEYS = {"repo", "revision", "bits", "group_size", "dtype", "mtp", "mtp_bits", "q_mode", "upload_repo", "keep_vision",
        "runner", "max_shard_gb", "prefetch_shards", "raw_window_gb"}


@dataclass(frozen=True)
class Runner:
    """A GitHub-hosted Linux runner size: what a job can use, and its default label (a larger
    runner's label is chosen by the organisation that creates it: the workflow reads overrides
    from the MTPCONVERT_RUNNER_LABELS repository variable)."""

    memory_gb: int
    disk_gb: int  # free disk a job can fill: the SSD less the image and a margin
    label: str


# GitHub's published sizes: the standard runner (16 GB RAM, 14 GB of SSD free), then the larger
# Linux runners with 150, 300 and 600 GB SSDs (about 85% of each counted free here).
RUNNERS: Dict[str, Runner] = {
    "standard": Runner(16, 14, "ubuntu-latest"),
    "large": Runner(16, 125, "ubuntu-latest-4-cores"),
    "xlarge": Runner(32, 255, "ubuntu-latest-8-cores"),
    "2xlarge": Runner(64, 510, "ubuntu-latest-16-cores"),
}


@dataclass(frozen=True)
class Release:
    """What sizes a publish job, per source release (``data/releases.toml``; tests/data/layouts: SOURCE.md gives
    the shard counts, the configs and tensor tables the rest; tools/layouts.py reads them, tests/test_recipes.py
    recomputes every field)."""

    repo: str  # its Hub repository
    hidden: int  # lm_head is vocab x hidden; the MTP head's fc (GLM: eh_proj) is hidden x 2 hidden
    # the MTP head in bf16: the sidecar on disk (--mtp keep). Qwen: mtp.fc, norms and mtp.layers.0; GLM: the whole
    # nextn layer model.layers.{num_hidden_layers} (eh_proj, norms, its decoder layer and, in GLM-4.x, its own
    # embed_tokens and shared_head.head, vocab x hidden each)
    head_gb: float
    layer_b: float  # parameters of the largest backbone decoder layer (not the head's), in billions
    tensor_b: float  # parameters of the largest output tensor, in billions: the shard holding it is at least that
    raw_shards: Optional[int] = None  # safetensors files of the release; None: not known (only a ranged fetch is sized)
    moe: bool = False  # the head's layer has routed experts (Qwen: num_experts; GLM: n_routed_experts)
    # raw data on the Hub, GB, where it is not 2 bytes a parameter: a block-FP8 release stores 1 byte per FP8
    # weight plus its BF16 scale per 128 x 128 block (about half)
    raw_gb: Optional[float] = None
    # the two largest raw files, GB rounded up, largest first, where the table gives every file's size (the FP8
    # releases: one file per decoder layer, mtp.safetensors, outside.safetensors); else shards count at the mean
    largest_raw_gb: Tuple[float, ...] = ()
    vocab: int = 248320  # lm_head is vocab x hidden (Qwen3.5/3.6/3.8: 248,320; Qwen3-Next: 151,936; GLM: its config's)
    # total parameters in billions where the repository's name does not give them (GLM-4.7-Flash, GLM-4.5-Air)
    params_b: Optional[float] = None
    # the head has an input projection that is never quantized (Qwen's mtp.fc, GLM's eh_proj: 2 x hidden^2);
    # DeepSeek-V4's e_proj / h_proj are quantized like any linear
    fc: bool = True
    # routed experts stored as MXFP4 (DeepSeek-V4), carried as MLX's mxfp4 whatever the bits (4.25 bits a value):
    # three stacks of tensor_b in every layer and in the head, and the largest output tensor one of them
    mxfp4_experts: bool = False

    @property
    def head_b(self) -> float:
        """The MTP head's parameters, in billions."""
        return self.head_gb / 2

    @property
    def fc_b(self) -> float:
        """``mtp.fc``'s (GLM: ``eh_proj``'s) parameters, in billions: never quantized (docs/transforms.md); 0 where the
        head has none (``fc``)."""
        return 2 * self.hidden * self.hidden / 1e9 if self.fc else 0.0

    @property
    def mxfp4_b(self) -> float:  # one layer's (and the head's) MXFP4 routed experts, in billions
        return 3 * self.tensor_b if self.mxfp4_experts else 0.0


def read_releases(path: Path = RELEASES_FILE) -> Dict[str, Release]:
    """Every release a recipe can name, by release name (``data/releases.toml``: one table each, its repo id
    and the numbers ``Release`` holds)."""
    rows = tomllib.loads(path.read_text(encoding="utf-8"))
    out = {}
    for name, row in rows.items():
        row = dict(row)
        repo = row.pop("repo")
        row["largest_raw_gb"] = tuple(row.get("largest_raw_gb", ()))
        out[name] = Release(repo=repo, **row)
    return out


RELEASES: Dict[str, Release] = read_releases()
# runtime.decoding.experts.FLOAT32_EXPERT_BUDGET_BYTES (mlx is not imported here: the workflow runs this module
# before installing; a test keeps the two equal): float32 experts the smoke casts at once, plus the
# bf16 gather they are cast from (half as much again).
SMOKE_FLOAT32_EXPERT_BYTES = 512 << 20
SMOKE_FLOAT32_EXPERT_GB = SMOKE_FLOAT32_EXPERT_BYTES * 1.5 / 1e9
VOCAB = 248320  # Qwen3.5/3.6/3.8 (Release.vocab is each release's)
STREAM_SHARD_GB = 1.0  # output shard size of a recipe run (max_shard_gb, in GiB): two of them are on disk at once
RANGED_BLOCKS_GB = 0.25  # with a raw window: the converter's blocks in flight, beyond the window
MARGIN_GB = 1.0  # config, tokenizer, index, logs, filesystem slack
# Whole raw shards are counted at their release's mean size (the tables give shard counts, not sizes):
# a recipe streaming whole shards fits a runner only with this much disk to spare besides.
SHARD_SIZE_HEADROOM_GB = 1.0
MXFP4_BITS = 4 + 8 / 32  # a carried MXFP4 value: its E2M1 code and its share of an E8M0 byte per 32


@dataclass(frozen=True)
class Recipe:
    path: Path
    repo: str
    revision: str = "main"
    bits: Optional[int] = None
    group_size: Optional[int] = None
    dtype: Optional[str] = None
    mtp: str = "keep"
    mtp_bits: Optional[int] = None
    q_mode: str = "affine"
    upload_repo: Optional[str] = None
    keep_vision: bool = False
    runner: str = "standard"
    max_shard_gb: float = STREAM_SHARD_GB
    prefetch_shards: int = DEFAULT_PREFETCH_SHARDS  # --stream --prefetch-shards: raw shards downloaded ahead
    raw_window_gb: Optional[float] = None  # --stream --raw-window: raw bytes on disk, fetched by range (not shards)

    @property
    def params_b(self) -> float:
        """Total parameters in billions: the release's where it gives them (``Release.params_b``), else from the
        repository name (Qwen3.5-122B-A10B: 122)."""
        if self.release.params_b is not None:
            return self.release.params_b
        return float(re.search(r"-(\d+(?:\.\d+)?)B", self.repo).group(1))

    @property
    def release_name(self) -> str:
        return self.repo.split("/")[1]

    @property
    def release(self) -> Release:
        return RELEASES[self.release_name]

    def _float_gb(self, params_b: float) -> float:
        """Stored GB of ``params_b`` billion float parameters at the recipe's dtype (bf16/fp16: 2 bytes)."""
        return params_b * (4 if self.dtype == "float32" else 2)

    def _gb_at_bits(self, params_b: float, bits: Optional[int] = None, group_size: Optional[int] = None) -> float:
        """Stored GB of ``params_b`` billion parameters at ``bits`` and ``group_size`` (default: the recipe's;
        a scale and a bias per group), float where there are no bits."""
        if bits is None:
            bits, group_size = self.bits, self.group_size
        if not bits:
            return self._float_gb(params_b)
        return params_b * (bits + 32 / (group_size or 64)) / 8

    def _gb_quantized(self, params_b: float, bits: Optional[int] = None, group_size: Optional[int] = None) -> float:
        """``_gb_at_bits`` of a layer (or the head) whose MXFP4 experts are carried at 4.25 bits whenever quantized."""
        carried = self.release.mxfp4_b if (bits if bits is not None else self.bits) else 0.0
        return self._gb_at_bits(params_b - carried, bits, group_size) + carried * MXFP4_BITS / 8

    @property
    def largest_tensor_gb(self) -> float:
        """The largest output tensor at the recipe's bits (one stack of MXFP4 experts as carried, where there are)."""
        if self.release.mxfp4_experts and self.bits:
            return self.release.tensor_b * MXFP4_BITS / 8
        return self._gb_at_bits(self.release.tensor_b)

    @property
    def layer_gb(self) -> float:  # the largest decoder layer at the recipe's bits
        return self._gb_quantized(self.release.layer_b)

    @property
    def raw_release_gb(self) -> float:
        """The release's raw data: as stored where the release says (block-FP8: ~1 byte a parameter), else bf16."""
        return self.release.raw_gb if self.release.raw_gb is not None else self.params_b * 2

    @property
    def raw_shard_gb(self) -> float:
        """One raw shard of the release: its largest file where the table gives each file's size, else its raw data
        / its shard count (a mean); infinite where neither is known."""
        r = self.release
        if r.largest_raw_gb:
            return r.largest_raw_gb[0]
        return self.raw_release_gb / r.raw_shards if r.raw_shards else math.inf

    @property
    def shards_at_the_mean(self) -> bool:
        """Whether whole raw shards are counted at the release's mean size (they may be larger)."""
        return self.raw_window_gb is None and not self.release.largest_raw_gb

    @property
    def raw_gb(self) -> float:
        """Raw data on disk at once under ``--stream``: the window and the converter's blocks in flight when
        fetched by range, else ``1 + prefetch_shards`` whole raw shards: the largest and, per shard ahead, the
        second largest where the files' sizes are known, else the mean each."""
        if self.raw_window_gb is not None:
            return self.raw_window_gb + RANGED_BLOCKS_GB
        largest = self.release.largest_raw_gb
        if largest:
            return largest[0] + self.prefetch_shards * largest[-1]
        return (1 + self.prefetch_shards) * self.raw_shard_gb

    @property
    def output_shard_gb(self) -> float:
        """The largest output shard: ``max_shard_gb`` (GiB), or the largest output tensor at the recipe's bits
        where that is larger (a tensor, with its scales and biases, never spans shards: ``plan.build``)."""
        return max(self.max_shard_gb * (1 << 30) / 1e9, self.largest_tensor_gb)

    @property
    def head_gb(self) -> float:
        """The MTP head as written: float with ``mtp = "keep"``; with ``match`` at the backbone's bits, with
        ``mtp_bits`` at those bits (the recipe's group when affine, else 64, as ``plan.quant``), except ``mtp.fc``
        (GLM: ``eh_proj``), which stays float; a GLM-4.x head's own embed_tokens and shared_head.head are at those
        bits too. Its norms and routers (both float) are counted at the head's bits: under 0.01 GB."""
        r = self.release
        if self.mtp == "drop":
            return 0.0
        if self.mtp_bits is not None:
            bits, group = self.mtp_bits, (self.group_size if self.q_mode == "affine" and self.group_size else 64)
        elif self.mtp == "match":
            bits, group = self.bits, self.group_size
        else:
            return self._float_gb(r.head_b)
        return self._float_gb(r.fc_b) + self._gb_quantized(r.head_b - r.fc_b, bits, group)

    @property
    def head_cpu_gb(self) -> float:
        """The head as the layerwise smoke holds it on the CPU: as written, plus for float routed experts one
        group of them in float32 and the stored copy it is cast from (runtime.decoding.experts); quantized experts run
        as stored."""
        float_experts = self.release.moe and self.mtp == "keep" and self.mtp_bits is None
        return self.head_gb + (SMOKE_FLOAT32_EXPERT_GB if float_experts else 0.0)

    @property
    def lm_head_gb(self) -> float:
        """``lm_head`` (or the tied embedding) at the recipe's bits."""
        return self._gb_at_bits(self.release.vocab * self.release.hidden / 1e9)

    def disk_needed_gb(self) -> float:
        """Peak disk of ``recipe run --stream`` with upload and smoke: each output shard is uploaded and freed
        once the streamed smoke has read it (``runtime.smoke.streamed``: it runs the layers the shard completes and
        reads the layer still in progress, the final norm and ``lm_head`` into memory), so the peak is the raw
        data (``raw_gb``), two output shards (one uploading, one being written: ``output_shard_gb`` each), the
        MTP sidecar at its precision (kept to the end: linked and committed) and a margin. The output's total
        size does not enter."""
        return self.raw_gb + 2 * self.output_shard_gb + self.head_gb + MARGIN_GB

    def fits(self, runner: str) -> bool:
        """Whether ``runner`` has the disk and memory this recipe needs, with ``SHARD_SIZE_HEADROOM_GB`` to spare
        where whole raw shards are counted at their mean size."""
        size = RUNNERS[runner]
        spare = SHARD_SIZE_HEADROOM_GB if self.shards_at_the_mean else 0.0
        return self.disk_needed_gb() + spare <= size.disk_gb and self.memory_needed_gb() <= size.memory_gb

    def memory_needed_gb(self) -> float:
        """Peak memory of the streamed layerwise smoke (docs/smoke.md): the larger of the largest decoder layer at
        the recipe's bits and the MTP head as held on the CPU (``head_cpu_gb``), plus ``lm_head`` at the recipe's
        bits (held from its shard to the end), plus ~0.5 GB of activations and lm_head block and ~1 GB for the
        converter running beside it."""
        return max(self.layer_gb, self.head_cpu_gb) + self.lm_head_gb + 1.5

    @property
    def quant(self) -> QuantOptions:
        return QuantOptions(self.bits, self.group_size, self.q_mode, self.mtp, self.mtp_bits)

    @property
    def options(self) -> ConvertOptions:
        return ConvertOptions(dtype=self.dtype, quant=self.quant, keep_vision=self.keep_vision,
                              max_shard_bytes=int(self.max_shard_gb * (1 << 30)))

    def cli_args(self, stream: bool = False) -> List[str]:
        """The equivalent `mtpconvert pull-and-quantize` arguments (``stream``: as `recipe run --stream` runs it)."""
        args = ["pull-and-quantize", self.repo, "--revision", self.revision]
        for flag, value in (("--bits", self.bits), ("--group-size", self.group_size), ("--dtype", self.dtype),
                            ("--mtp-bits", self.mtp_bits)):
            if value is not None:
                args += [flag, str(value)]
        args += ["--mtp", self.mtp, "--q-mode", self.q_mode, "--max-shard-size", f"{self.max_shard_gb:g}"]
        if self.keep_vision:
            args.append("--keep-vision")
        if stream:
            args.append("--stream")
            args += (["--raw-window", f"{self.raw_window_gb:g}"] if self.raw_window_gb is not None
                     else ["--prefetch-shards", str(self.prefetch_shards)])
        return args

    def source(self, token: Optional[str] = None) -> HubSource:
        """The release the recipe converts, at its revision, read with ``token``."""
        return HubSource(self.repo, self.revision, token=token)

    @property
    def raw_policy(self) -> RawPolicy:
        """What ``recipe run --stream`` keeps of the raw release on disk: its byte window, else its whole shards
        (``describe()``: "1 GB window", "2 shards")."""
        if self.raw_window_gb is not None:
            return RawPolicy(stream=True, raw_window_gb=self.raw_window_gb)
        return RawPolicy(stream=True, prefetch_shards=self.prefetch_shards)

    @property
    def publish(self) -> Optional[PublishOptions]:
        """Where ``recipe run`` uploads the result; None: the recipe names no repository."""
        return PublishOptions(self.upload_repo) if self.upload_repo else None


def load_recipe(path: Path) -> Recipe:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise OptionsError(f"cannot read recipe: {e}", file=path) from e
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise OptionsError(f"unknown recipe key {unknown[0]!r}", file=path, key=unknown[0])
    if not isinstance(data.get("repo"), str) or data["repo"].count("/") != 1:
        raise OptionsError("repo must name a Hub repository (owner/name)", file=path, key="repo")
    types = {"revision": str, "bits": int, "group_size": int, "mtp_bits": int, "mtp": str, "q_mode": str,
             "upload_repo": str, "keep_vision": bool, "dtype": str, "runner": str}
    for key, want in types.items():
        if key in data and (not isinstance(data[key], want) or (want is int and isinstance(data[key], bool))):
            raise OptionsError(f"{key} must be a {want.__name__}", file=path, key=key)
    if "prefetch_shards" in data and (type(data["prefetch_shards"]) is not int or data["prefetch_shards"] < 0):
        raise OptionsError("prefetch_shards must be an integer, 0 or more", file=path, key="prefetch_shards")
    for key in ("max_shard_gb", "raw_window_gb"):
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], (int, float)) or data[key] <= 0):
            raise OptionsError(f"{key} must be a positive number", file=path, key=key)
    if "raw_window_gb" in data and "prefetch_shards" in data:
        raise OptionsError("raw_window_gb and prefetch_shards are exclusive (a ranged fetch holds no whole shard)",
                           file=path, key="raw_window_gb")
    if data["repo"] not in {r.repo for r in RELEASES.values()}:
        raise OptionsError(f"no runner sizing for {data['repo']}: add the release to mtpconvert/data/releases.toml",
                           file=path, key="repo")
    if data.get("mtp", "keep") not in ("keep", "match", "drop"):
        raise OptionsError("mtp must be keep, match or drop", file=path, key="mtp")
    if "upload_repo" in data and data["upload_repo"].count("/") != 1:
        raise OptionsError("upload_repo must be owner/name", file=path, key="upload_repo")
    if "runner" in data and data["runner"] not in RUNNERS:
        raise OptionsError(f"runner must be one of {', '.join(RUNNERS)}", file=path, key="runner")
    if data.get("dtype") not in (None,) + FLOAT_DTYPES:
        raise OptionsError(f"dtype must be one of {FLOAT_DTYPES}", file=path, key="dtype")
    recipe = Recipe(path=path, **data)
    try:
        recipe.quant.validated()
    except OptionsError as e:
        raise OptionsError(e.detail, file=path) from e
    return recipe


def list_recipes(folder: Path = BUNDLED) -> List[Recipe]:
    """Every recipe in ``folder``; a folder that is missing or holds none is an error, not an empty list."""
    folder = Path(folder)
    if not folder.is_dir():
        raise OptionsError(f"no recipe folder {folder}", hint="leave out --dir for the recipes that ship with "
                           "mtpconvert")
    files = sorted(folder.glob("*.toml"))
    if not files:
        raise OptionsError(f"no recipes (*.toml) in {folder}")
    return [load_recipe(p) for p in files]


def find_recipe(name_or_path: Path) -> Path:
    """A recipe file: a path as given, else the bundled recipe of that name (``Qwen3.5-27B-4bit-bf16[.toml]``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = BUNDLED / (path.name if path.suffix == ".toml" else f"{path.name}.toml")
    if path.parent == Path(".") and bundled.is_file():
        return bundled
    raise OptionsError(f"no recipe {name_or_path}", hint="`mtpconvert recipe list` shows the bundled ones; "
                       "a path must name an existing .toml file")


def runner_labels(overrides_json: str = "") -> Dict[str, str]:
    """Label of each runner size: the defaults, replaced by ``{"large": "my-label", ...}``."""
    labels = {name: r.label for name, r in RUNNERS.items()}
    overrides = json.loads(overrides_json) if overrides_json.strip() else {}
    unknown = sorted(set(overrides) - set(RUNNERS))
    if unknown:
        raise OptionsError(f"runner label for unknown size {unknown[0]!r}", key="MTPCONVERT_RUNNER_LABELS")
    return {**labels, **overrides}


def workflow_matrix(pattern: str, runner: str = "recipe", labels: Optional[Dict[str, str]] = None) -> List[dict]:
    """One job per recipe file matching ``pattern``: the file, the runner label it runs on (the recipe's
    own size, or ``runner`` for all of them) and what its streamed pull holds of the raw release at once
    (``raw``: "1 GB window" or "2 shards", ``Recipe.raw_policy``; ``recipe run --stream`` applies the
    recipe's own, this shows it)."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise OptionsError("no recipe matches", file=pattern)
    if runner != "recipe" and runner not in RUNNERS:
        raise OptionsError(f"runner must be recipe or one of {', '.join(RUNNERS)}", key="runner")
    labels = labels or runner_labels()
    jobs = []
    for f in files:
        recipe = load_recipe(Path(f))
        size = recipe.runner if runner == "recipe" else runner
        jobs.append({"recipe": f, "size": size, "runs_on": labels[size], "raw": recipe.raw_policy.describe()})
    return jobs


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="The publish workflow's job matrix, as a GitHub output line.")
    ap.add_argument("command", choices=["matrix"])
    ap.add_argument("pattern", help="recipe files, e.g. 'recipes/Qwen3.5-27B-*.toml'")
    ap.add_argument("--runner", default="recipe", help="recipe (each recipe's own size) or a size for all")
    args = ap.parse_args(argv)
    try:
        jobs = workflow_matrix(args.pattern, args.runner, runner_labels(os.environ.get("MTPCONVERT_RUNNER_LABELS", "")))
    except OptionsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("include=" + json.dumps(jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
