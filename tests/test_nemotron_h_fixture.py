"""The trained Nemotron-H fixture (``text-nemotronh-mtp``, Super's blocks and head): converted, our runtime drafts
with its head at a realistic acceptance and its output stays plain greedy's (drafts rejected mid-way: the Mamba2
rollback at work), the smoke gate passes it, and mlx-vlm's drafter accepts what ours does.

Broken the ways a converter can break this head (eh_proj's input halves swapped, the two blocks run in the other
order, the latent projections transposed), the folder still loads, verifies and decodes to plain greedy's output,
but its acceptance collapses and the smoke gate refuses it. The fixture's head was retrained so that the last two
collapse as they would on a real Super (the fixture's README: a head whose blocks nearly commute could not tell them
from a correct conversion)."""

import json
import os
import shutil

import mlx.core as mx
import pytest

from tests.checkpoints import convert_folder
from mtpconvert.fixture.text import heldout_prompts, text_fixture_path

FIXTURE = "text-nemotronh-mtp"
FLOOR = 0.55  # greedy decode acceptance of the correct head on these prompts (float32, k=1)
COLLAPSE = 0.25  # a broken head's acceptance on them is at most this (and the correct head's at least FLOOR)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("nemotron-text")
    out = {"f32": base / "f32", "q4": base / "q4"}
    convert_folder(text_fixture_path(FIXTURE), out["f32"], dtype="float32")
    convert_folder(text_fixture_path(FIXTURE), out["q4"], dtype="float32", bits=4, group_size=32, mtp="match")
    return out


@pytest.fixture(scope="module")
def prompts():
    return heldout_prompts(text_fixture_path(FIXTURE), per_file=1, prompt_tokens=48, files=6)[1]


def decode_acceptance(folder, prompts, depth: int = 1, tokens: int = 32):
    """(accepted / proposed drafts over the prompts, whether every output equals plain greedy's)."""
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import DecodeStats, mtp_generate, plain_generate

    m = load(folder)
    total, same = DecodeStats(), True
    for p in prompts:
        out, stats = mtp_generate(m, p, tokens, depth=depth)
        same &= out == plain_generate(m, p, tokens)[0]
        total.add(stats)
    return total, same


@pytest.mark.parametrize("name, depth", [("f32", 1), ("f32", 2), ("q4", 1)])
def test_our_runtime_drafts_at_a_realistic_acceptance_and_stays_plain_greedy(folders, prompts, name, depth):
    stats, same = decode_acceptance(folders[name], prompts, depth)
    assert same  # partial acceptance: Mamba2 states and KV caches rolled back to every kept prefix
    assert stats.acceptance_by_depth[0] >= FLOOR, stats.to_json()
    assert 0 < sum(stats.accepted) < sum(stats.proposed)


def test_the_layerwise_smoke_gate_passes_it(folders):
    from mtpconvert.gate import Gate, GateRecord, smoke_folder

    result = smoke_folder(folders["q4"], Gate(smoke_mode="layerwise"), GateRecord())
    assert result.ok, result.to_json()


def test_mlx_vlm_drafts_it_from_out_mtp_as_our_runtime_does(folders, prompts):
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    from interop.probes._common import generated_ids

    folder = folders["f32"]
    target = load_model(folder)
    drafter, kind = load_drafter(str(folder / "mtp"), kind="mtp")
    accepted = proposed = 0
    for p in prompts:
        ids = mx.array([p])
        plain, _ = generated_ids(generate_step(ids, target, None, None, max_tokens=32, temperature=0.0), 32)
        spec, _ = generated_ids(generate_step(ids, target, None, None, max_tokens=32, temperature=0.0,
                                              draft_model=drafter, draft_kind=kind), 32)
        assert spec == plain
        accepted, proposed = accepted + sum(drafter.accept_lens), proposed + sum(drafter.draft_lens)
    ours, _ = decode_acceptance(folder, prompts)
    assert accepted / proposed >= FLOOR and abs(accepted / proposed - ours.acceptance) < 0.1


# ------------------------------------------------------------------ broken conversions


def _eh_halves_swapped(head: dict, config: dict) -> None:
    w = head["mtp.layers.0.eh_proj.weight"]
    half = w.shape[1] // 2
    head["mtp.layers.0.eh_proj.weight"] = mx.concatenate([w[:, half:], w[:, :half]], axis=1)


def _blocks_swapped(head: dict, config: dict) -> None:
    """The two blocks' norms and mixers exchanged (and the pattern with them), block 0's fusion and the last block's
    final norm left where every loader looks for them: a head that loads and runs the MoE block first."""
    extras = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")
    moved = {}
    for k in list(head):
        for a, b in (("mtp.layers.0.", "mtp.layers.1."), ("mtp.layers.1.", "mtp.layers.0.")):
            if k.startswith(a) and not k.endswith(extras):
                moved[b + k[len(a):]] = head.pop(k)
                break
    head.update(moved)
    config["mtp_hybrid_override_pattern"] = config["mtp_hybrid_override_pattern"][::-1]


def _latent_transposed(head: dict, config: dict) -> None:
    """Each latent projection replaced by the other's transpose (square in the fixture, so the head still loads)."""
    p = "mtp.layers.1.mixer."
    fc1, fc2 = head[p + "fc1_latent_proj.weight"], head[p + "fc2_latent_proj.weight"]
    head[p + "fc1_latent_proj.weight"], head[p + "fc2_latent_proj.weight"] = fc2.T, fc1.T


BROKEN = {"blocks_swapped": _blocks_swapped, "eh_proj_halves_swapped": _eh_halves_swapped,
          "latent_transposed": _latent_transposed}


def broken_copy(good, out, edit):
    """A copy of ``good`` whose head (mtp.safetensors and its mtp/ link) and configs ``edit`` rewrote."""
    shutil.copytree(good, out)
    head = dict(mx.load(str(out / "mtp.safetensors")))
    config = json.loads((out / "config.json").read_text())
    edit(head, config)
    for f in (out / "mtp.safetensors", out / "mtp" / "weights.safetensors"):
        f.unlink()
    mx.save_safetensors(str(out / "mtp.safetensors"), head, metadata={"format": "mlx"})
    os.link(out / "mtp.safetensors", out / "mtp" / "weights.safetensors")
    for f in (out / "config.json", out / "mtp" / "config.json"):
        f.write_text(json.dumps(config, indent=2))
    return out


@pytest.mark.parametrize("breakage", sorted(BROKEN))
def test_broken_conversions_collapse_the_acceptance_and_the_gate_refuses_them(folders, prompts, tmp_path, breakage):
    from mtpconvert.gate import Gate, GateFailed, GateRecord, smoke_folder
    from mtpconvert.verify import verify

    folder = broken_copy(folders["f32"], tmp_path / breakage, BROKEN[breakage])
    assert verify(folder).ok  # nothing in the headers tells: the acceptance has to
    good, _ = decode_acceptance(folders["f32"], prompts)
    bad, same = decode_acceptance(folder, prompts)
    assert same  # a bad head costs speed, never output
    assert good.acceptance >= FLOOR and bad.acceptance <= COLLAPSE, (breakage, bad.acceptance, good.acceptance)
    with pytest.raises(GateFailed, match="greedy draft acceptance"):
        smoke_folder(folder, Gate(smoke_mode="layerwise"), GateRecord())
