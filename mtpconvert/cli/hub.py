"""`upload` and `add-mtp`: the commands that meet the Hub with an existing folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from .. import api
from ..gate import Gate
from ..provenance import checked_repo_id
from . import options as o
from .errors import handled
from .helpfmt import Command
from .progress import rich_events
from .render import human_bytes

console = Console(stderr=True)

UPLOAD_EPILOG = """Examples:

  mtpconvert upload out/ me/Qwen3.5-27B-4bit-mtp --private

  mtpconvert upload out/ me/Qwen3.5-27B-4bit-mtp --base-model Qwen/Qwen3.5-27B   # a local conversion's source
"""

ADD_MTP_EPILOG = """Examples:

  mtpconvert add-mtp Qwen/Qwen3.5-27B mlx-community-Qwen3.5-27B-4bit/

  mtpconvert add-mtp ~/models/Qwen3.5-27B my-mlx-4bit/   # offline: the head from a local raw folder
"""


@handled
def upload(
    path: Annotated[Path, typer.Argument(help="Converted MLX folder.")],
    repo_id: Annotated[str, typer.Argument(help="Target Hub repository (created if absent).")],
    token: o.Token = None,
    private: o.Private = False,
    no_smoke: Annotated[bool, typer.Option("--no-smoke", help="Do not measure acceptance for the card.")] = False,
    base_model: o.BaseModel = None,
):
    """Verify a folder, write its model card, and upload it with huggingface_hub."""
    with rich_events(console) as events:
        url = api.upload(path, repo_id, token=token, private=private,
                         checks=Gate(smoke=not no_smoke, min_acceptance=0.0, min_mlp_gain=None), events=events,
                         base_model=checked_repo_id(base_model))
    console.print(f"[green]uploaded[/green] {repo_id}: {url}")


@handled
def add_mtp(
    source_repo: Annotated[str, typer.Argument(help="The original release: a Hub repo id (e.g. Qwen/Qwen3.5-27B) "
                                               "or a local raw folder.")],
    mlx_dir: Annotated[Path, typer.Argument(help="Existing MLX folder without an MTP head (e.g. from "
                                            "mlx_lm.convert).")],
    revision: o.Revision = None,
    mtp: Annotated[o.MtpPolicy, typer.Option("--mtp", help="keep (float) or match the folder's quantization.")]
    = o.DEFAULTS["mtp"],
    mtp_bits: o.MtpBits = None,
    mtp_layout: o.MtpLayout = o.DEFAULTS["mtp_layout"],
    token: o.Token = None,
    no_smoke: o.NoSmoke = False,
    min_acceptance: o.MinAcceptance = o.DEFAULTS["min_acceptance"],
    min_mlp_gain: o.MinMlpGain = o.DEFAULTS["min_mlp_gain"],
):
    """Graft the MTP head onto an existing MLX folder (from the Hub, reading only the mtp.* byte ranges)."""
    with rich_events(console) as events:
        info = api.add_mtp(source_repo, mlx_dir, revision=revision, mtp=mtp.value, mtp_bits=mtp_bits, token=token,
                           mtp_layout=mtp_layout.value, checks=o.checks(False, no_smoke, min_acceptance,
                                                                          o.SmokeModeChoice.auto, min_mlp_gain),
                           events=events)
    from .convert import print_checked_smoke

    print_checked_smoke(info["checks"], console)
    console.print(f"[green]added[/green] {info['added']} MTP tensors to {mlx_dir} from {source_repo}@"
                  f"{info['sha'][:12]} (read {human_bytes(info['fetched_bytes'])} of "
                  f"{human_bytes(info['source_bytes'])})")


def register(app: typer.Typer) -> None:
    app.command("upload", cls=Command, epilog=UPLOAD_EPILOG)(upload)
    app.command("add-mtp", cls=Command, epilog=ADD_MTP_EPILOG)(add_mtp)
