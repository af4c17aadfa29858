"""Per-model conversion recipes: small TOML files naming one published variant.

The recipes ship inside the package (``mtpconvert/data/recipes``, ``recipes/`` in a checkout
links there), so ``recipe list`` and ``recipe run NAME`` work from a plain ``pip install``.

A recipe is validated as a whole before anything runs: known keys only, a Qwen3.5/3.6
repository, and options that QuantOptions/ConvertOptions accept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .errors import OptionsError
from .options import FLOAT_DTYPES, ConvertOptions, QuantOptions

BUNDLED = Path(__file__).parent / "data" / "recipes"
REPO = re.compile(r"^Qwen/Qwen3\.[56]-[0-9A-Za-z.-]+$")
KEYS = {"repo", "revision", "bits", "group_size", "dtype", "mtp", "mtp_bits", "q_mode", "upload_repo", "keep_vision"}


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

    @property
    def quant(self) -> QuantOptions:
        return QuantOptions(self.bits, self.group_size, self.q_mode, self.mtp, self.mtp_bits)

    @property
    def options(self) -> ConvertOptions:
        return ConvertOptions(dtype=self.dtype, quant=self.quant, keep_vision=self.keep_vision)

    def cli_args(self) -> List[str]:
        """The equivalent `mtpconvert pull-and-quantize` arguments."""
        args = ["pull-and-quantize", self.repo, "--revision", self.revision]
        for flag, value in (("--bits", self.bits), ("--group-size", self.group_size), ("--dtype", self.dtype),
                            ("--mtp-bits", self.mtp_bits)):
            if value is not None:
                args += [flag, str(value)]
        args += ["--mtp", self.mtp, "--q-mode", self.q_mode]
        if self.keep_vision:
            args.append("--keep-vision")
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
             "upload_repo": str, "keep_vision": bool, "dtype": str}
    for key, want in types.items():
        if key in data and (not isinstance(data[key], want) or (want is int and isinstance(data[key], bool))):
            raise OptionsError(f"{key} must be a {want.__name__}", file=path, key=key)
    if data.get("mtp", "keep") not in ("keep", "match", "drop"):
        raise OptionsError("mtp must be keep, match or drop", file=path, key="mtp")
    if "upload_repo" in data and data["upload_repo"].count("/") != 1:
        raise OptionsError("upload_repo must be owner/name", file=path, key="upload_repo")
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
