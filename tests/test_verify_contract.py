"""mtplx_runtime.json: written after passing checks from what the full smoke measured, never claimed
otherwise; the compat row predicts mtplx's label from it (issue #30 item 2; docs/interop.md)."""

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.checkpoints import convert_folder, without_shift
from mtpconvert import api
from mtpconvert.gate import GateFailed, GateRecord, Gate, run_gate
from mtpconvert.compat import read_folder
from mtpconvert.compat import mtplx as mtplx_compat
from mtpconvert.compat.folder import Folder
from mtpconvert.demo import fixture_prompts
from mtpconvert.fixture import fixture_path
from mtpconvert.fixture.text import text_fixture_path
from mtpconvert.verify.contract import build, write
from mtpconvert.options import ConvertOptions, QuantOptions

CONTRACT = "mtplx_runtime.json"
# mtplx 2.12.2 backends/registry.py:668-680, RuntimeContract.from_dict: "runtime contract missing required keys"
MTPLX_REQUIRED_KEYS = ("mtplx_version", "arch_id", "mtp_depth_max", "recommended_profile", "exactness_baseline",
                       "verified_on")
MTPLX_PYTHON = Path(os.environ.get("MTPCONVERT_INTEROP_CACHE") or Path.home() / ".cache" / "mtpconvert" / "interop"
                    ) / "venvs" / "mtplx" / "bin" / "python"


def checks(mode: str = "full", **kw) -> Gate:
    return Gate(smoke_mode=mode, prompts=tuple(fixture_prompts(3)), **kw)


def head_reason(path: Path) -> str:
    return api.runtimes(path).get("mtplx").head_usable.reason


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The dense fixture converted with a full smoke: (folder, its GateRecord)."""
    out = tmp_path_factory.mktemp("contract") / "o"
    result = api.convert(fixture_path("dense"), out, ConvertOptions(dtype="bfloat16"), checks=checks())
    return out, result.checks


def test_written_after_a_full_smoke_with_what_it_measured(converted):
    out, record = converted
    data = json.loads((out / CONTRACT).read_text())
    smoke = record.smoke
    assert record.smoke_mode == "full" and smoke.ok and smoke.identical
    assert set(MTPLX_REQUIRED_KEYS) <= set(data) and mtplx_compat.contract_error(data) is None
    assert data["arch_id"] == "qwen3-next-mtp"
    # the smoke decodes at depth 1 (gated) and again at mtplx's default depth 3: both equal plain greedy here
    assert smoke.deep.depth == 3 and not smoke.deep_mismatches and data["mtp_depth_max"] == 3
    assert data["exactness_baseline"]["deep_depth"] == 3
    assert data["recommended_profile"] == "sustained"  # mtplx's default, said so in "notes"
    assert "not a measurement" in data["notes"] and "mtplx did not run" in data["verified_on"]["runtime"]
    base = data["exactness_baseline"]
    assert base["status"] == "passed" and base["identical_to_plain_greedy"] is True
    assert base["acceptance"] == round(smoke.acceptance, 4) and base["prompts"] == 3
    assert (base["proposed"], base["accepted"]) == (sum(smoke.mtp.proposed), sum(smoke.mtp.accepted))
    assert base["generated_tokens"] == smoke.plain.emitted and base["mtp_hidden"] == "post-norm"
    assert base["mlp_gain"] == round(smoke.mlp_gain, 4)
    assert data["verified_on"]["tool"].startswith("mtpconvert ") and data["verified_on"]["mlx"]
    assert any(n.startswith(f"{CONTRACT}: written") for n in record.notes)
    # the compat row predicts mtplx's label; the head verdict itself does not change
    row = api.runtimes(out).get("mtplx")
    assert row.head_usable.ok and "mtplx labels it verified: mtplx_runtime.json" in row.head_usable.reason


def test_without_the_file_the_row_says_unverified_and_still_usable(converted, tmp_path):
    out, _ = converted
    folder = read_folder(out)
    assert mtplx_compat.mtplx_tier(folder)[0] == "verified"
    folder.manifests.pop(CONTRACT)  # the same folder without the file
    assert mtplx_compat.mtplx_tier(folder) == ("family-compatible-unverified", f"no {CONTRACT}")
    snapshot = Folder(config=folder.config, headers=folder.headers, index=folder.index, path="(planned)")
    row = mtplx_compat.compat(snapshot, "sidecar")
    assert row.head_usable.ok and "family-compatible-unverified: no mtplx_runtime.json (it drafts all the same)" \
        in row.head_usable.reason


@pytest.mark.parametrize("kw, note", [(dict(smoke=False), "not written (no smoke ran)"), (dict(mode="layerwise"),
                                       "teacher-forced: it measures acceptance, not exact decoding")])
def test_no_file_without_a_full_smoke(tmp_path, kw, note):
    out = tmp_path / "o"
    mode = kw.pop("mode", "full")
    result = api.convert(fixture_path("dense"), out, ConvertOptions(dtype="bfloat16"), checks=checks(mode, **kw))
    assert not (out / CONTRACT).exists()
    assert any(note in n for n in result.checks.notes), result.checks.notes


def test_no_file_without_a_head(tmp_path):
    out = tmp_path / "o"
    result = api.convert(fixture_path("dense"), out, ConvertOptions(quant=QuantOptions(mtp="drop")), checks=checks())
    assert not (out / CONTRACT).exists() and not result.checks.notes


def test_add_mtp_writes_it_after_its_smoke(tmp_path):
    out = tmp_path / "o"
    api.convert(fixture_path("dense"), out, ConvertOptions(quant=QuantOptions(mtp="drop")), checks=checks())
    (out / CONTRACT).write_text('{"stale": true}')  # whatever was there describes a folder without this head
    info = api.add_mtp(str(fixture_path("dense")), out, checks=checks())
    data = json.loads((out / CONTRACT).read_text())
    assert data["exactness_baseline"]["acceptance"] == round(info["checks"].smoke.acceptance, 4)


def test_a_failed_smoke_writes_nothing(tmp_path):
    out = tmp_path / "noshift"
    convert_folder(fixture_path("dense"), out, edit=without_shift(), dtype="bfloat16")
    with pytest.raises(GateFailed):
        run_gate(out, checks(verify=False), GateRecord(), has_mtp=True, contract=True)
    assert not (out / CONTRACT).exists()


def _record(identical=True, acceptance=0.9, gain=0.1, mode="full"):
    smoke = SimpleNamespace(identical=identical, mismatched_prompts=[] if identical else [1], acceptance=acceptance,
                            mlp_gain=gain, per_prompt=[acceptance] * 2, hidden="post-norm", min_acceptance=0.0,
                            plain=SimpleNamespace(emitted=96), mtp=SimpleNamespace(depth=1, proposed=[40],
                                                                                   accepted=[36]))
    return SimpleNamespace(smoke=smoke, smoke_mode=mode)


@pytest.mark.parametrize("record, why", [
    (_record(identical=False), "differed from plain greedy on prompt(s) [1]"),
    (_record(acceptance=0.05), "below the default floors"),  # upload's floor is 0: exact, but no head to vouch for
    (_record(gain=0.0), "below the default floors"),
    (_record(mode="layerwise"), "teacher-forced"),
    (SimpleNamespace(smoke=None, smoke_mode=None), "no smoke ran"),
])
def test_nothing_is_claimed_that_was_not_measured(converted, record, why):
    config = json.loads((converted[0] / "config.json").read_text())
    contract, reason = build(config, record)
    assert contract is None and why in reason
    assert build({"model_type": "llama"}, _record())[0] is None  # no mtplx arch id for the family


def test_a_stale_file_goes_when_nothing_here_measured_it(converted, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "config.json").write_text((converted[0] / "config.json").read_text())
    (out / CONTRACT).write_text((converted[0] / CONTRACT).read_text())  # e.g. a partial folder's leftover
    note = write(out, SimpleNamespace(smoke=None, smoke_mode=None))
    assert not (out / CONTRACT).exists() and "not written (no smoke ran); the earlier one was removed" in note


@pytest.mark.parametrize("edit, tier, why", [
    (lambda d: d.pop("verified_on"), "architecture-compatible-but-unverified", "missing required keys: verified_on"),
    (lambda d: d.update(recommended_profile="fast"), "architecture-compatible-but-unverified", "unknown MTPLX profile"),
    (lambda d: d.update(recommended_profile="default"), "verified", ""),  # an alias of sustained
    (lambda d: d.update(mtp_depth_max=0), "architecture-compatible-but-unverified", "must be positive"),
    (lambda d: d["exactness_baseline"].update(status="pending_full_load"), "architecture-compatible-but-unverified",
     "exactness_baseline status is pending_full_load"),
    (lambda d: d["exactness_baseline"].update(status="needs-reverify"), "architecture-compatible-but-unverified",
     "status is needs-reverify"),
    (lambda d: d.update(speed_evidence={"verdict": "no_mtp_depth_beat_ar"}), "architecture-compatible-but-unverified",
     "speed_evidence verdict"),
])
def test_tier_follows_mtplx_rules(converted, edit, tier, why):
    folder = read_folder(converted[0])
    data = json.loads((converted[0] / CONTRACT).read_text())
    edit(data)
    folder.manifests = {**folder.manifests, CONTRACT: data}
    got, reason = mtplx_compat.mtplx_tier(folder)
    assert got == tier and why in reason


def test_qwen3_next_row_reads_the_contract_too(tmp_path):
    out = tmp_path / "next"
    convert_folder(text_fixture_path("next"), out, dtype="float32")
    assert "family-compatible-unverified" in head_reason(out)
    contract, _ = build(json.loads((out / "config.json").read_text()), _record())
    assert contract["arch_id"] == "qwen3-next-mtp"
    (out / CONTRACT).write_text(json.dumps(contract))
    reason = head_reason(out)
    assert "mtplx labels it verified" in reason and api.runtimes(out).get("mtplx").head_usable.ok


@pytest.mark.skipif(not MTPLX_PYTHON.exists(), reason="the interop mtplx venv is not installed (interop/setup.sh)")
def test_real_mtplx_accepts_it_and_labels_the_folder_verified(converted):
    script = ("import json, sys; from mtplx.backends.registry import RuntimeContract; "
              "from mtplx.artifacts import inspect_model; "
              "c = RuntimeContract.from_dict(json.load(open(sys.argv[1] + '/mtplx_runtime.json'))); "
              "print(json.dumps([c.arch_id, c.mtp_depth_max, inspect_model(sys.argv[1]).compatibility['tier']]))")
    done = subprocess.run([str(MTPLX_PYTHON), "-c", script, str(converted[0])], capture_output=True, text=True,
                          timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["qwen3-next-mtp", 3, "verified"]


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """A loopback Hub serving the dense fixture (as tests/test_hub.py's ``hub``, less its other repos)."""
    from tests.hubserver import served_hub

    with served_hub(tmp_path, monkeypatch) as h:
        h.add_folder("Qwen/Tiny-MTP", fixture_path("dense"))
        yield h


@pytest.mark.parametrize("stream", [True, False])
def test_the_file_reaches_the_hub_with_the_folder(hub, tmp_path, stream):
    """Streamed publish commits the partial folder after the checks (``hub.publish.committer``); a plain
    pull uploads OUT: either way the file written after the smoke is in the one commit."""
    from typer.testing import CliRunner

    from mtpconvert.cli import app

    out = tmp_path / "out"
    args = ["pull-and-quantize", "Qwen/Tiny-MTP", str(out), "--upload-repo", "me/c", "--bits", "8", "--group-size",
            "32", "--smoke-mode", "full", *(["--stream"] if stream else [])]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    repo = hub.repos["me/c"]
    assert len(repo.commits) == 1 and repo.files[CONTRACT] == (out / CONTRACT).read_bytes()
    assert json.loads(repo.files[CONTRACT])["exactness_baseline"]["status"] == "passed"
