"""Per-model conversion recipes: small TOML files naming one published variant.

The recipes ship inside the package (``mtpconvert/data/recipes``, ``recipes/`` in a checkout
links there), so ``recipe list`` and ``recipe run NAME`` work from a plain ``pip install``.

A recipe is validated as a whole before anything runs: known keys only, a Qwen3.5/3.6
repository, options that QuantOptions/ConvertOptions accept, and the runner size it needs
(``runner``: a key of ``RUNNERS``; the publish workflow runs each recipe on that size).

    python -m mtpconvert.recipes matrix 'recipes/Qwen3.5-27B-*.toml' [--runner SIZE]

prints the publish workflow's job matrix (stdlib only: the workflow runs it before installing).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .errors import OptionsError
from .options import FLOAT_DTYPES, ConvertOptions, QuantOptions

BUNDLED = Path(__file__).parent / "data" / "recipes"
REPO = re.compile(r"^Qwen/Qwen3\.[56]-[0-9A-Za-z.-]+$")
KEYS = {"repo", "revision", "bits", "group_size", "dtype", "mtp", "mtp_bits", "q_mode", "upload_repo", "keep_vision",
        "runner", "max_shard_gb", "prefetch_shards"}


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
    """What sizes a publish job, per source release (tests/data/layouts: SOURCE.md gives the shard
    counts, the tensor tables the rest; tools/layouts.py reads them)."""

    raw_shards: int  # safetensors shards of the release (bf16): a raw shard is params * 2 / raw_shards
    hidden: int  # lm_head is vocab x hidden
    head_gb: float  # the MTP head's fc, norms and layer 0 in bf16: the sidecar on disk (--mtp keep)
    layer_b: float  # parameters of the largest decoder layer, in billions
    moe: bool = False  # the head's layer has routed experts

    @property
    def head_cpu_gb(self) -> float:
        """The head as the layerwise smoke holds it on the CPU: as stored, plus one group of float
        experts in float32 and the stored copy it is cast from (runtime.experts)."""
        return self.head_gb + (SMOKE_FLOAT32_EXPERT_GB if self.moe else 0.0)


RELEASES: Dict[str, Release] = {
    "Qwen3.5-27B": Release(11, 5120, 0.85, 0.38),
    "Qwen3.6-27B": Release(15, 5120, 0.85, 0.38),
    "Qwen3.5-35B-A3B": Release(14, 2048, 1.69, 0.84, moe=True),
    "Qwen3.6-35B-A3B": Release(26, 2048, 1.69, 0.84, moe=True),
    "Qwen3.5-122B-A10B": Release(39, 3072, 5.05, 2.51, moe=True),
    "Qwen3.5-397B-A17B": Release(94, 4096, 13.19, 6.58, moe=True),
}
# runtime.experts.FLOAT32_EXPERT_BUDGET_BYTES (mlx is not imported here: the workflow runs this module
# before installing; a test keeps the two equal): float32 experts the smoke casts at once, plus the
# bf16 gather they are cast from (half as much again).
SMOKE_FLOAT32_EXPERT_BYTES = 512 << 20
SMOKE_FLOAT32_EXPERT_GB = SMOKE_FLOAT32_EXPERT_BYTES * 1.5 / 1e9
VOCAB = 248320
STREAM_SHARD_GB = 1.0  # output shard size of a recipe run (max_shard_gb): two of them are on disk at once
MARGIN_GB = 1.0  # config, tokenizer, index, logs, filesystem slack


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
    prefetch_shards: int = 1  # --stream --prefetch-shards: raw shards downloaded ahead of the one read

    @property
    def params_b(self) -> float:
        """Total parameters in billions, from the repository name (Qwen3.5-122B-A10B: 122)."""
        return float(re.search(r"-(\d+(?:\.\d+)?)B", self.repo).group(1))

    @property
    def release(self) -> Release:
        return RELEASES[self.repo.split("/")[1]]

    def _gb_at_bits(self, params_b: float) -> float:
        """Stored GB of ``params_b`` billion parameters at the recipe's bits (scale and bias per group)."""
        bits = (self.bits or 16) + (32 / (self.group_size or 64) if self.bits else 0)
        return params_b * bits / 8

    @property
    def raw_shard_gb(self) -> float:
        """One raw (bf16) shard of the release: its size / its shard count."""
        return self.params_b * 2 / self.release.raw_shards

    def disk_needed_gb(self) -> float:
        """Peak disk of ``recipe run --stream`` with upload and smoke: each output shard is uploaded
        and freed once the streamed smoke has run its layers, so the peak is ``1 + prefetch_shards``
        raw shards (one read, the rest downloading ahead; no output tensor of a Qwen3.5/3.6 release
        reads two shards, tests/test_recipes.py), two output shards (one uploading, one being
        written), the MTP sidecar (kept to the end: linked and committed), the smoke's copy of
        ``lm_head`` (read after the last layer) and a margin. The output's total size does not enter."""
        r = self.release
        return ((1 + self.prefetch_shards) * self.raw_shard_gb + 2 * self.max_shard_gb + r.head_gb
                + self._gb_at_bits(VOCAB * r.hidden / 1e9) + MARGIN_GB)

    def memory_needed_gb(self) -> float:
        """Peak memory of the layerwise smoke (docs/smoke.md): the larger of the largest decoder layer at
        the recipe's bits and the MTP head as held on the CPU (as stored, float experts cast to float32 one
        bounded group at a time: ``Release.head_cpu_gb``), plus ~0.5 GB of activations and lm_head block
        and ~1 GB for the converter running beside it."""
        r = self.release
        return max(self._gb_at_bits(r.layer_b), r.head_cpu_gb) + 1.5

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
            args += ["--stream", "--prefetch-shards", str(self.prefetch_shards)]
        return args


def load_recipe(path: Path) -> Recipe:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise OptionsError(f"cannot read recipe: {e}", file=path) from e
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise OptionsError(f"unknown recipe key {unknown[0]!r}", file=path, key=unknown[0])
    if not isinstance(data.get("repo"), str) or not REPO.match(data["repo"]):
        raise OptionsError("repo must name a Qwen/Qwen3.5-* or Qwen/Qwen3.6-* repository", file=path, key="repo")
    types = {"revision": str, "bits": int, "group_size": int, "mtp_bits": int, "mtp": str, "q_mode": str,
             "upload_repo": str, "keep_vision": bool, "dtype": str, "runner": str}
    for key, want in types.items():
        if key in data and (not isinstance(data[key], want) or (want is int and isinstance(data[key], bool))):
            raise OptionsError(f"{key} must be a {want.__name__}", file=path, key=key)
    if "prefetch_shards" in data and (type(data["prefetch_shards"]) is not int or data["prefetch_shards"] < 0):
        raise OptionsError("prefetch_shards must be an integer, 0 or more", file=path, key="prefetch_shards")
    if "max_shard_gb" in data and (isinstance(data["max_shard_gb"], bool) or not isinstance(data["max_shard_gb"], (int, float))
                                   or data["max_shard_gb"] <= 0):
        raise OptionsError("max_shard_gb must be a positive number", file=path, key="max_shard_gb")
    if data.get("repo", "").split("/")[-1] not in RELEASES:
        raise OptionsError(f"no runner sizing for {data['repo']}: add it to recipes.RELEASES", file=path, key="repo")
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
    own size, or ``runner`` for all of them) and the raw shards its streamed pull holds at once
    (``1 + prefetch_shards``: ``recipe run --stream`` applies the recipe's own, this shows it)."""
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
        jobs.append({"recipe": f, "size": size, "runs_on": labels[size], "raw_shards": 1 + recipe.prefetch_shards})
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
