"""Every recipe parses and names a valid configuration; the publish workflow is well formed."""

import json
import math
import os
import re
import subprocess
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest
import yaml
from typer.testing import CliRunner

from tools import layouts

from mtpconvert import api
from mtpconvert.cli import app
from mtpconvert.errors import OptionsError
from mtpconvert.plan import build_plan
from mtpconvert.plan.fp8 import FP4_PACKED, scale_keys
from mtpconvert.io.checkpoint import MTP_FILE
from mtpconvert.io.header import dtype_itemsize
from mtpconvert.options import RawPolicy
from mtpconvert.recipes import (RELEASES, RUNNERS, SHARD_SIZE_HEADROOM_GB, VOCAB, list_recipes, load_recipe, runner_labels,
                                workflow_matrix)
from tests.test_layouts import DERIVED_FP8, FP8_TWINS, table_checkpoint

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
NEXT = ("Qwen3-Next-80B-A3B-Instruct", "Qwen3-Next-80B-A3B-Thinking")
# GLM releases with a recipe (zai-org/...): their tables are reconstructed from the config, every shard unknown
GLM = ("GLM-4.7-Flash", "GLM-4.5-Air")
# Nemotron-3 Super (nvidia/...): its table is reconstructed from the config, every shard unknown
NEMOTRON = ("NVIDIA-Nemotron-3-Super-120B-A12B-BF16",)
# releases with no vendored tensor table of their own: the one whose table they share (the same config, key for key)
SAME_TABLE = {"Qwen3-Next-80B-A3B-Thinking": "Qwen3-Next-80B-A3B-Instruct"}
# Qwen3.5 nested, Qwen3-Next and DeepSeek-V4 flat, Nemotron-H
LAYER = re.compile(r"(?:model\.(?:language_model\.)?|backbone\.)?layers\.(\d+)\.")
OUT_LAYER = re.compile(r"(?:(?:language_model\.)?model\.|backbone\.)layers\.(\d+)\.")
LM_HEADS = ("language_model.lm_head.weight", "lm_head.weight")
# A family release's recipe matrix: bits and dtype, and the short dtype its names use.
MATRIX = ((4, "bfloat16"), (4, "float16"), (6, "bfloat16"), (8, "bfloat16"))
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}


def _matrix_recipes(releases) -> list:
    """The recipes of ``releases``, asserted to be exactly MATRIX for each."""
    recipes = [r for r in list_recipes(ROOT / "recipes") if r.release_name in releases]
    assert sorted((r.release_name, r.bits, r.dtype) for r in recipes) == sorted(
        (n, b, d) for n in releases for b, d in MATRIX)
    return recipes


def release_checkpoint(name: str):
    """The release's published layout as a checkpoint: its own table, or the table of the release it shares one with
    (``SAME_TABLE``: the configs are equal)."""
    if name in SAME_TABLE:
        assert layouts.config(name) == layouts.config(SAME_TABLE[name])
        return table_checkpoint(SAME_TABLE[name])
    return table_checkpoint(name)


def test_every_recipe_is_valid():
    recipes = list_recipes(ROOT / "recipes")
    assert len(recipes) >= 18
    names = {r.repo for r in recipes}
    for model in ("Qwen3.5-27B", "Qwen3.5-35B-A3B", "Qwen3.5-122B-A10B", "Qwen3.5-397B-A17B", "Qwen3.6-27B",
                  "Qwen3.6-35B-A3B", "Qwen3.8-27B", *NEXT):
        assert f"Qwen/{model}" in names
        bits = {r.bits for r in recipes if r.repo == f"Qwen/{model}"}
        assert bits == {4, 6, 8}
    for model in GLM:
        assert {r.bits for r in recipes if r.repo == f"zai-org/{model}"} == {4, 6, 8}
    for model in NEMOTRON:
        assert {r.bits for r in recipes if r.repo == f"nvidia/{model}"} == {4, 6, 8}
    for r in recipes:
        r.quant.validated()
        text = r.path.read_text()
        assert "# Why:" in text, f"{r.path.name} must document its reasons"
        assert r.upload_repo and r.mtp_bits is None  # a head at other bits than the backbone's: vllm-mlx cannot load it
        assert r.mtp in ("keep", "match")
        if r.mtp == "match":  # the runtimes a float fc beside quantized layers shuts out are named
            assert "rapid-mlx" in text and "--mtp match" in text, r.path.name


@pytest.mark.parametrize("body, key", [
    ('repo = "meta/llama"\n', "repo"),
    ('repo = "Qwen/Qwen3.7-27B"\n', "repo"),  # no such release: 3.5, 3.6, 3.8 and Qwen3-Next only
    ('repo = "Qwen/Qwen3-Next-80B-A3B-Base"\n', "repo"),  # no runner sizing for it
    ('repo = "zai-org/GLM-4.6"\n', "repo"),  # a GLM family the converter knows, but no runner sizing for it
    ('repo = "THUDM/GLM-4.5-Air"\n', "repo"),  # GLM releases are zai-org's
    ('repo = "Qwen/Qwen3.5-27B"\nbits = 5\ngroup_size = 64\nq_mode = "mxfp4"\n', None),
    ('repo = "Qwen/Qwen3.5-27B"\nbits = "4"\n', "bits"),
    ('repo = "Qwen/Qwen3.5-27B"\ncolour = "red"\n', "colour"),
    ('repo = "Qwen/Qwen3.5-27B"\nmtp = "half"\n', "mtp"),
    ('repo = "Qwen/Qwen3.5-27B"\nprefetch_shards = -1\n', "prefetch_shards"),
    ('repo = "Qwen/Qwen3.5-27B"\nprefetch_shards = true\n', "prefetch_shards"),
    ('repo = "Qwen/Qwen3.5-27B"\nprefetch_shards = 0.5\n', "prefetch_shards"),
    ('repo = "Qwen/Qwen3.5-27B"\nraw_window_gb = 0\n', "raw_window_gb"),
    ('repo = "Qwen/Qwen3.5-27B"\nraw_window_gb = -1.5\n', "raw_window_gb"),
    ('repo = "Qwen/Qwen3.5-27B"\nraw_window_gb = true\n', "raw_window_gb"),
    ('repo = "Qwen/Qwen3.5-27B"\nraw_window_gb = "1"\n', "raw_window_gb"),
    ('repo = "Qwen/Qwen3.5-27B"\nraw_window_gb = 1\nprefetch_shards = 0\n', "raw_window_gb"),
    ('repo = ', None),
])
def test_bad_recipes_are_refused_with_file_and_key(tmp_path, body, key):
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(OptionsError) as e:
        load_recipe(f)
    assert e.value.file == str(f)
    if key:
        assert e.value.key == key


def test_recipe_cli_list_and_dry_run(tmp_path, monkeypatch):
    result = runner.invoke(app, ["recipe", "list", "--dir", str(ROOT / "recipes")])
    assert result.exit_code == 0 and "Qwen3.5-397B" in result.output


def test_the_checkouts_recipes_are_the_bundled_ones():
    """recipes/ in a checkout (README, CI) and the package's copy are one folder, so they cannot drift."""
    from mtpconvert.recipes import BUNDLED

    assert (ROOT / "recipes").resolve() == BUNDLED.resolve()
    assert BUNDLED.is_relative_to(ROOT / "mtpconvert") and len(list(BUNDLED.glob("*.toml"))) >= 18


def test_recipe_list_outside_the_checkout_lists_the_bundled_recipes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ here
    result = runner.invoke(app, ["recipe", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert result.output.count("Qwen/Qwen3.5-397B-A17B ") == 4 and "Qwen3.6-27B-4bit-bf16.toml" in result.output
    assert result.output.count("Qwen/Qwen3.5-397B-A17B-FP8 ") == 1


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_recipe_list_of_a_folder_without_recipes_is_an_error(tmp_path, make):
    folder = tmp_path / "nowhere"
    if make == "empty":
        folder.mkdir()
        (folder / "notes.txt").write_text("not a recipe")
    result = runner.invoke(app, ["recipe", "list", "--dir", str(folder)], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert str(folder) in result.output and "Traceback" not in result.output


def test_find_recipe_by_bundled_name_or_path(tmp_path, monkeypatch):
    from mtpconvert.recipes import BUNDLED, find_recipe

    monkeypatch.chdir(tmp_path)
    assert find_recipe("Qwen3.5-27B-4bit-bf16") == BUNDLED / "Qwen3.5-27B-4bit-bf16.toml"
    assert find_recipe("Qwen3.5-27B-4bit-bf16.toml") == BUNDLED / "Qwen3.5-27B-4bit-bf16.toml"
    own = tmp_path / "Qwen3.5-27B-4bit-bf16.toml"  # a file of the same name here wins: it is what was named
    own.write_text('repo = "Qwen/Qwen3.5-27B"\n')
    assert find_recipe(Path("Qwen3.5-27B-4bit-bf16.toml")) == Path("Qwen3.5-27B-4bit-bf16.toml")
    with pytest.raises(OptionsError, match="no recipe"):
        find_recipe("sub/Qwen3.5-27B-4bit-bf16.toml")  # a path that does not exist is not looked up by name
    with pytest.raises(OptionsError, match="no recipe"):
        find_recipe("Qwen9-1B")


def smallest_runner(r) -> Optional[str]:
    """The smallest runner size ``r`` fits, None where none does (or its raw data cannot be sized)."""
    return next((n for n in RUNNERS if r.fits(n)), None)


def test_every_recipe_runs_on_the_smallest_runner_with_the_disk_and_memory_it_needs():
    """--stream --upload-repo with the streamed smoke: disk is the raw data (1 + prefetch_shards whole shards, or a
    window fetched by range), two output shards and the MTP sidecar at its precision; memory the largest layer or
    the head as the layerwise smoke holds it, plus lm_head. Each way of holding less — one raw shard, a raw window,
    a window under 1 GB, a quantized head — is used only where the cheaper-to-run choice needs a larger runner.
    The recipe's comment states its numbers."""
    recipes = list_recipes(ROOT / "recipes")
    for r in recipes:
        name, need = r.path.name, (r.disk_needed_gb(), r.memory_needed_gb())
        assert r.runner == smallest_runner(r), (name, r.runner, need)
        stated = re.search(r'^runner = "(\w+)"  # ~([\d.]+) GB of disk, ~([\d.]+) GB of memory', r.path.read_text(),
                           re.M)
        assert stated and stated.group(1) == r.runner, name
        assert (float(stated.group(2)), float(stated.group(3))) == pytest.approx(need, abs=0.05), (name, need)
        if r.raw_window_gb is not None:
            assert smallest_runner(replace(r, raw_window_gb=None, prefetch_shards=0)) != r.runner, name  # needed
            if r.raw_window_gb < 1:
                assert smallest_runner(replace(r, raw_window_gb=1)) != r.runner, name
        elif r.prefetch_shards == 0:
            assert smallest_runner(replace(r, prefetch_shards=1)) != r.runner, name  # needed, not habit
        else:
            assert smallest_runner(replace(r, prefetch_shards=0)) == r.runner, name  # would win nothing
        if r.mtp != "keep":
            assert smallest_runner(replace(r, mtp="keep")) != r.runner, name  # the float head does not fit
    assert {r.runner for r in recipes} == {"standard"}  # issue #16: every release, 27B to 397B, on the standard runner


def test_the_docs_state_each_recipes_computed_disk_and_memory():
    """docs/hub.md "Recipes and CI": one row per release and bits, naming its dtypes; the bold numbers are
    disk_needed_gb and memory_needed_gb."""
    doc = (ROOT / "docs" / "hub.md").read_text()
    for r in list_recipes(ROOT / "recipes"):
        dtype = SHORT_DTYPE[r.dtype]
        row = re.search(rf"^\| {re.escape(r.release_name)} {r.bits}-bit [^|]*\b{dtype}\b[^|]*\|.*$", doc, re.M)
        assert row, r.path.name
        stated = [float(x) for x in re.findall(r"\*\*([\d.]+)\*\*", row.group(0))]
        assert stated == pytest.approx([r.disk_needed_gb(), r.memory_needed_gb()], abs=0.05), r.path.name


SOURCE_MD = (layouts.LAYOUTS / "SOURCE.md").read_text()


def file_bytes(ckpt) -> Counter:
    """Data bytes of each file of a table checkpoint (its headers hold no offsets)."""
    files = Counter()
    for t in ckpt.tensors.values():
        files[t.file.name] += math.prod(t.shape) * dtype_itemsize(t.dtype)
    return files


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_release_numbers_are_the_vendored_layouts(name):
    """Every Release field, recomputed from the published config, tensor table and shard count (SOURCE.md). Parameters
    leave block-FP8 scales aside; an FP8 release's raw data is its table's bytes, its two largest files those of its
    per-layer files; an FP8 release with no table of its own (DERIVED_FP8: 397B-A17B) is its BF16 table stored the
    FP8 way, whose files are not known. The head is Qwen's mtp.* or GLM's nextn layer model.layers.{num_hidden_layers}
    (with GLM-4.x's own embed_tokens and shared_head.head; its eh_proj is the fc), which is no backbone layer; GLM's
    shard counts are not known (SOURCE.md gives none) and its names give no parameter count (Release.params_b)."""
    release, ckpt = RELEASES[name], release_checkpoint(name)
    text = ckpt.config.get("text_config", ckpt.config)
    scales = scale_keys(ckpt.tensors)  # FP8 scales are no parameters; an MXFP4 byte holds two
    params = {k: math.prod(t.shape) * (2 if t.dtype in FP4_PACKED else 1) for k, t in ckpt.tensors.items()
              if k not in scales}
    nextn = str(text["num_hidden_layers"])  # GLM's head; no Qwen key has a layer of that index
    layers, head = Counter(), 0
    for key, n in params.items():
        m = LAYER.match(key)
        if key.startswith("mtp.") or (m and m.group(1) == nextn):
            head += n
        elif m:
            layers[m.group(1)] += n
    plan = build_plan(ckpt)
    largest = max(math.prod(it.slot.shape) for it in plan.items)  # output tensors: fused raw experts are split
    shards = re.search(rf"^\| {re.escape(SAME_TABLE.get(name, name))} \|.*\| (\d+): ", SOURCE_MD, re.M)
    if name in DERIVED_FP8 or name in GLM or name in NEMOTRON:
        assert release.raw_shards is None and (name in DERIVED_FP8 or shards is None)
    else:
        assert release.raw_shards == int(shards.group(1))
    assert release.hidden == text["hidden_size"] and text["vocab_size"] == release.vocab
    assert release.head_gb == round(head * 2 / 1e9, 2)
    assert release.layer_b == round(max(layers.values()) / 1e9, 2)
    routed = text.get("num_experts", text.get("n_routed_experts", 0))  # Qwen, GLM
    assert release.moe == (routed > 0)
    # one layer's stacked routed experts projection, or lm_head / the embedding where that is larger (35B-A3B,
    # GLM-4.7-Flash)
    # (Nemotron-H's experts read its moe_latent_size, not the hidden state)
    experts = routed * text.get("moe_intermediate_size", 0) * (text.get("moe_latent_size") or text["hidden_size"])
    assert release.tensor_b == round(largest / 1e9, 2) == round(max(experts, release.vocab * text["hidden_size"]) / 1e9, 2)
    assert release.fc_b * 1e9 == params.get("mtp.fc.weight", params.get(f"model.layers.{nextn}.eh_proj.weight",
                                                                       params.get("mtp.layers.0.eh_proj.weight", 0)))
    named = re.search(r"-\d+(?:\.\d+)?B", name)  # Qwen3.5-27B: 27
    assert release.params_b == (None if named else round(sum(params.values()) / 1e9, 2))
    files = file_bytes(ckpt)
    fp8 = any(t.dtype == "F8_E4M3" for t in ckpt.tensors.values())
    assert release.raw_gb == (round(sum(files.values()) / 1e9, 2) if fp8 else None)  # else 2 bytes a parameter
    known = fp8 and "unknown.safetensors" not in files  # BF16 tables' shard columns are partly reconstructed
    assert release.largest_raw_gb == (tuple(math.ceil(b / 1e7) / 100 for _, b in files.most_common(2)) if known else ())


def test_fp8_releases_are_half_the_download_and_size_what_the_stream_holds(tmp_path):
    """A block-FP8 release's raw data is about half its BF16 release's; whole raw files are counted at their real size
    (the largest, then the next largest for each one ahead), without the headroom a mean needs; one whose files are
    not known can only be fetched by range."""
    def recipe(release: str):
        f = tmp_path / f"{release}.toml"
        f.write_text(f'repo = "Qwen/{release}"\nbits = 4\n')
        return load_recipe(f)

    for fp8, bf16 in (*FP8_TWINS.items(), *DERIVED_FP8.items()):
        r, twin = recipe(fp8), recipe(bf16)
        assert 0.5 < r.raw_release_gb * 1e9 / sum(file_bytes(table_checkpoint(bf16)).values()) < 0.56, fp8
        assert (r.head_gb, r.memory_needed_gb(), r.output_shard_gb) == (twin.head_gb, twin.memory_needed_gb(),
                                                                         twin.output_shard_gb)  # same output
        if fp8 in DERIVED_FP8:
            assert r.raw_gb == math.inf and not r.fits("2xlarge")
            assert replace(r, raw_window_gb=1, mtp="match").fits("standard")  # its recipe
            continue
        first, second = r.release.largest_raw_gb
        assert r.raw_gb == pytest.approx(first + second) and replace(r, prefetch_shards=3).raw_gb == pytest.approx(
            first + 3 * second)
        mean = r.raw_release_gb / r.release.raw_shards
        assert first > mean + SHARD_SIZE_HEADROOM_GB  # outside.safetensors: the mean and its headroom would hide it
        assert not r.shards_at_the_mean and r.fits("standard") == (r.disk_needed_gb() <= RUNNERS["standard"].disk_gb)


@pytest.mark.slow  # ~75 s: plans every bundled recipe's full-size table (make test-all)
def test_recipe_sizes_are_the_converters_plan():
    """The terms of disk_needed_gb and memory_needed_gb against the plan the converter makes of each release's
    published tensor table with the recipe's options: the head as written (at its precision, fc float), the largest
    output tensor, the largest two consecutive output shards (what is on disk while one uploads and the next is
    written), lm_head and the largest layer at the recipe's bits."""
    for r in list_recipes(ROOT / "recipes"):
        plan = build_plan(release_checkpoint(r.release_name), r.options)
        shards, layers = Counter(), Counter()
        for it in plan.items:
            shards[it.shard] += it.out_bytes
            m = OUT_LAYER.match(it.name)
            if m:
                layers[m.group(1)] += it.out_bytes
        head = shards.pop(MTP_FILE)
        order = sorted(shards)
        pair = max(shards[a] + shards[b] for a, b in zip(order, order[1:]))
        largest = max(it.out_bytes for it in plan.items if it.shard != MTP_FILE)
        lm_head = next(it.out_bytes for it in plan.items if it.name in LM_HEADS)
        name = r.path.name
        # within what Release's rounding to 0.01 (GB or billion parameters) can move a size
        assert r.head_gb == pytest.approx(head / 1e9, abs=0.006), name
        assert r.largest_tensor_gb == pytest.approx(largest / 1e9, abs=0.006), name
        assert pair / 1e9 <= 2 * r.output_shard_gb + 0.006, name
        assert r.lm_head_gb == pytest.approx(lm_head / 1e9, abs=0.006), name
        assert r.layer_gb == pytest.approx(max(layers.values()) / 1e9, abs=0.011), name


def test_head_precision_sizes_the_sidecar(tmp_path):
    """keep: the float head; match: the backbone's bits, fc float; mtp_bits: those bits. Under the same bits and
    group, match and mtp_bits are the same size."""
    f = tmp_path / "r.toml"
    f.write_text('repo = "Qwen/Qwen3.5-397B-A17B"\nbits = 4\ngroup_size = 64\n')
    keep = load_recipe(f)
    match, bits8 = replace(keep, mtp="match"), replace(keep, mtp_bits=8)
    assert keep.head_gb == keep.release.head_gb and keep.head_cpu_gb > keep.head_gb  # float experts cast on the CPU
    assert match.head_gb < bits8.head_gb < keep.head_gb and match.head_cpu_gb == match.head_gb
    assert bits8.head_gb == pytest.approx(replace(keep, bits=8, mtp="match").head_gb)
    assert match.head_gb > match.release.head_b * 4.5 / 8  # fc stays float
    assert replace(keep, mtp="drop").head_gb == 0
    assert keep.disk_needed_gb() - match.disk_needed_gb() == pytest.approx(keep.head_gb - match.head_gb)


def test_recipe_output_shard_size_reaches_the_command(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('repo = "Qwen/Qwen3.6-27B"\nbits = 4\nmax_shard_gb = 0.5\n')
    r = load_recipe(f)
    assert r.options.max_shard_bytes == 1 << 29 and r.cli_args()[-2:] == ["--max-shard-size", "0.5"]
    f.write_text('repo = "Qwen/Qwen3.6-27B"\nmax_shard_gb = 0\n')
    with pytest.raises(OptionsError, match="max_shard_gb") as e:
        load_recipe(f)
    assert e.value.key == "max_shard_gb"


def test_unknown_runner_is_refused(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('repo = "Qwen/Qwen3.5-27B"\nrunner = "huge"\n')
    with pytest.raises(OptionsError, match="runner must be one of standard, large") as e:
        load_recipe(f)
    assert e.value.key == "runner"


def test_workflow_matrix(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    jobs = workflow_matrix("recipes/Qwen3.5-27B-4bit-*.toml")
    assert [(j["recipe"], j["size"], j["runs_on"]) for j in jobs] == [
        (f"recipes/Qwen3.5-27B-4bit-{d}.toml", "standard", RUNNERS["standard"].label) for d in ("bf16", "fp16")]
    labels = runner_labels('{"xlarge": "org-8core"}')
    assert workflow_matrix("recipes/Qwen3.5-27B-4bit-bf16.toml", "xlarge", labels)[0]["runs_on"] == "org-8core"
    with pytest.raises(OptionsError):
        workflow_matrix("recipes/nothing-*.toml")
    with pytest.raises(OptionsError):
        runner_labels('{"giant": "x"}')
    # the raw disk policy each job's name shows
    for stem, body in (("a", "prefetch_shards = 0\n"), ("b", ""), ("c", "raw_window_gb = 1.5\n")):
        (tmp_path / f"{stem}.toml").write_text(f'repo = "Qwen/Qwen3.5-27B"\nbits = 4\n{body}')
    assert [j["raw"] for j in workflow_matrix(str(tmp_path / "*.toml"))] == ["1 shard", "2 shards", "1.5 GB window"]


def test_publish_workflow(tmp_path):
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "publish.yml").read_text())
    on = wf.get("on", wf.get(True))  # PyYAML reads the bare key `on` as True
    runner_input = on["workflow_dispatch"]["inputs"]["runner"]
    assert runner_input["options"] == ["recipe", *RUNNERS] and runner_input["default"] == "recipe"
    jobs = wf["jobs"]
    publish = jobs["publish"]
    assert publish["needs"] == "matrix" and publish["runs-on"] == "${{ matrix.runs_on }}"
    assert publish["strategy"]["matrix"]["include"] == "${{ fromJson(needs.matrix.outputs.include) }}"
    assert publish["env"]["HF_TOKEN"] == "${{ secrets.HF_TOKEN }}"
    steps = " ".join(s.get("run", "") for s in publish["steps"])
    assert "mtpconvert" in steps and "recipe run" in steps and "--stream" in steps
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in publish["steps"])
    # the smoke runs on OpenBLAS (mlx[cpu]'s reference BLAS would take it past the job's time limit on 397B)
    convert = next(s for s in publish["steps"] if "recipe run" in s.get("run", ""))
    blas = convert.get("env", {}).get("LD_PRELOAD", "")
    names = [s.get("name") for s in publish["steps"]]
    installs = next(i for i, s in enumerate(publish["steps"]) if "libopenblas0-pthread" in s.get("run", ""))
    assert "openblas-pthread/libblas.so.3" in blas and installs < names.index(convert["name"])

    # the matrix step's command, as the workflow runs it (before anything is installed)
    step = next(s for s in jobs["matrix"]["steps"] if s.get("id") == "list")
    assert step["env"]["PYTHONPATH"] == "."
    def matrix(glob):
        command = step["run"].split(">>")[0].replace("${GLOB}", glob).replace("$RUNNER", "recipe")
        out = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True,
                             env={"PATH": os.environ["PATH"], "PYTHONPATH": "."})
        assert out.returncode == 0, out.stderr
        return [(j["size"], j["raw"]) for j in json.loads(out.stdout.removeprefix("include="))]

    for glob in ("Qwen3.5-397B-A17B-4bit-*", "Qwen3.5-35B-A3B-8bit-*"):  # a raw window; one whole raw shard
        recipes = sorted((ROOT / "recipes").glob(f"{glob}.toml"))
        assert matrix(glob) == [(r.runner, r.raw_policy.describe()) for r in map(load_recipe, recipes)]
    assert "${{ matrix.raw }}" in publish["name"] and "${{ matrix.size }}" in publish["name"]

    # recipe run takes what the workflow passes it
    result = runner.invoke(app, ["recipe", "run", "--help"])
    assert "--stream" in result.output and "--resume" in result.output


def test_recipe_prefetch_reaches_the_streamed_command(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('repo = "Qwen/Qwen3.5-27B"\nbits = 4\nprefetch_shards = 0\n')
    r = load_recipe(f)
    assert r.prefetch_shards == 0 and "--prefetch-shards" not in r.cli_args()  # a plain pull has no stream
    assert r.cli_args(stream=True)[-3:] == ["--stream", "--prefetch-shards", "0"]
    assert replace(r, prefetch_shards=1).disk_needed_gb() - r.disk_needed_gb() == pytest.approx(r.raw_shard_gb)


def test_recipe_raw_window_reaches_the_streamed_command(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('repo = "Qwen/Qwen3.5-122B-A10B"\nbits = 4\nraw_window_gb = 1.5\n')
    r = load_recipe(f)
    assert r.raw_window_gb == 1.5 and "--raw-window" not in r.cli_args()
    assert r.cli_args(stream=True)[-3:] == ["--stream", "--raw-window", "1.5"]
    assert "--prefetch-shards" not in r.cli_args(stream=True)
    # the window, not the release's shard size, is what raw data costs on disk
    assert replace(r, raw_window_gb=0.5).disk_needed_gb() == pytest.approx(r.disk_needed_gb() - 1)
    big = replace(r, repo="Qwen/Qwen3.5-397B-A17B")
    assert big.raw_shard_gb > r.raw_shard_gb and big.raw_gb == r.raw_gb


def test_recipe_run_passes_the_recipes_raw_policy_when_streaming(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(api, "pull_and_convert", lambda source, out, options, **kwargs: calls.append(kwargs["raw"]))
    window, shards = tmp_path / "window.toml", tmp_path / "shards.toml"
    window.write_text('repo = "Qwen/Qwen3.5-122B-A10B"\nbits = 4\nraw_window_gb = 1.5\n')
    shards.write_text('repo = "Qwen/Qwen3.5-27B"\nbits = 4\nprefetch_shards = 0\n')
    api.run_recipe(window, stream=True)
    api.run_recipe(shards, stream=True)
    api.run_recipe(window)  # not streamed: neither option
    api.run_recipe(window, raw=RawPolicy(stream=True, prefetch_shards=2))  # the caller's choice replaces the recipe's
    assert calls == [RawPolicy(stream=True, raw_window_gb=1.5), RawPolicy(stream=True, prefetch_shards=0), RawPolicy(),
                     RawPolicy(stream=True, prefetch_shards=2)]


def test_qwen3_next_recipes(monkeypatch):
    """Qwen3-Next-80B-A3B Instruct and Thinking at 4/6/8-bit bf16 and 4-bit fp16, each on the standard runner holding
    one raw shard (two would not fit); lm_head is the release's 151,936 x 2048, not Qwen3.5's vocabulary; `recipe list`
    and the publish workflow's matrix list them."""
    monkeypatch.chdir(ROOT)
    for r in _matrix_recipes(NEXT):
        dtype = SHORT_DTYPE[r.dtype]
        assert r.upload_repo == f"mtpconvert/{r.release_name}-{r.bits}bit-{dtype}-mtp" and r.mtp == "keep"
        assert r.path.stem == f"{r.release_name}-{r.bits}bit-{dtype}"
        assert r.lm_head_gb == pytest.approx(r._gb_at_bits(151936 * 2048 / 1e9)) and r.release.vocab != VOCAB
        assert r.runner == "standard" and r.prefetch_shards == 0 and r.raw_policy.describe() == "1 shard"
        assert r.cli_args(stream=True)[:2] == ["pull-and-quantize", f"Qwen/{r.release_name}"]
    jobs = workflow_matrix("recipes/Qwen3-Next-*.toml")
    assert len(jobs) == 8 and {(j["size"], j["raw"]) for j in jobs} == {("standard", "1 shard")}
    result = runner.invoke(app, ["recipe", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and all(f"Qwen/{n} " in result.output for n in NEXT), result.output


def test_glm_recipes(monkeypatch):
    """GLM-4.7-Flash and GLM-4.5-Air at 4/6/8-bit bf16 and 4-bit fp16, each on the standard runner with a 1 GB raw
    window: neither release's shard count or file sizes are known, so whole raw shards cannot be sized. The head is
    the whole nextn layer: its MoE decoder layer and its own embed_tokens and shared_head.head (vocab x hidden each),
    kept bf16, all in mtp.safetensors; eh_proj is its fc (float under ``match`` too, as are the routers). lm_head is
    the release's vocabulary; `recipe list` and the publish workflow's matrix list them."""
    monkeypatch.chdir(ROOT)
    for r in _matrix_recipes(GLM):
        dtype = SHORT_DTYPE[r.dtype]
        rel, name = r.release, r.path.name
        assert r.repo == f"zai-org/{r.release_name}" and r.path.stem == f"{r.release_name}-{r.bits}bit-{dtype}"
        assert r.upload_repo == f"mtpconvert/{r.release_name}-{r.bits}bit-{dtype}-mtp" and r.mtp == "keep"
        assert r.runner == "standard" and r.raw_window_gb == 1 and r.raw_policy.describe() == "1 GB window"
        assert rel.raw_shards is None and r.raw_shard_gb == math.inf
        assert smallest_runner(replace(r, raw_window_gb=None, prefetch_shards=0)) is None  # whole shards: unsized
        assert r.cli_args(stream=True)[:2] == ["pull-and-quantize", r.repo]
        assert r.cli_args(stream=True)[-3:] == ["--stream", "--raw-window", "1"]
        assert r.lm_head_gb == pytest.approx(r._gb_at_bits(rel.vocab * rel.hidden / 1e9)) and rel.vocab != VOCAB
        assert r.raw_release_gb == pytest.approx(2 * rel.params_b)  # the name gives no size
        # the head as the plan writes it: the float nextn layer with its own vocabulary tensors; under match the
        # backbone's bits except eh_proj and the routers
        vocab_gb = 2 * rel.vocab * rel.hidden * 2 / 1e9
        assert rel.head_gb > vocab_gb and r.head_gb == rel.head_gb
        match = replace(r, mtp="match")
        plan = build_plan(release_checkpoint(r.release_name), match.options)
        head = {it.name: it for it in plan.items if it.shard == MTP_FILE}
        assert {"mtp.embed_tokens.weight", "mtp.shared_head.head.weight", "mtp.eh_proj.weight"} <= set(head), name
        assert head["mtp.eh_proj.weight"].quant is None and head["mtp.embed_tokens.weight"].quant is not None
        assert head["mtp.mlp.gate.weight"].quant is None and head["mtp.mlp.gate.e_score_correction_bias"].quant is None
        assert match.head_gb == pytest.approx(sum(it.out_bytes for it in head.values()) / 1e9, abs=0.006), name
    jobs = workflow_matrix("recipes/GLM-*.toml")
    assert len(jobs) == 8 and {(j["size"], j["raw"]) for j in jobs} == {("standard", "1 GB window")}
    result = runner.invoke(app, ["recipe", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and all(f"zai-org/{n} " in result.output for n in GLM), result.output


def test_deepseek_v4_recipe(monkeypatch):
    """DeepSeek-V4-Flash at 4 bits: its MXFP4 experts carried as mxfp4 (4.25 bits a value) beside the affine backbone,
    in every layer and in the head (--mtp match: the float head fits the standard runner's disk and memory neither),
    one raw shard at a time; what it sizes is what the plan of the release's table writes."""
    monkeypatch.chdir(ROOT)
    (r,) = [r for r in list_recipes(ROOT / "recipes") if r.release_name == "DeepSeek-V4-Flash"]
    assert r.release.mxfp4_experts and not r.release.fc and r.release.fc_b == 0
    assert r.mtp == "match" and r.runner == "standard" and r.raw_policy.describe() == "1 shard"
    plan = build_plan(release_checkpoint(r.release_name), r.options)
    experts = [it for it in plan.items if ".switch_mlp." in it.name]
    assert experts and {it.quant.mode for it in experts} == {"mxfp4"}  # the head's too
    assert {it.quant.mode for it in plan.items if it.quant and ".switch_mlp." not in it.name} == {"affine"}
    assert r.largest_tensor_gb == pytest.approx(r.release.tensor_b * 4.25 / 8)
    assert not replace(r, mtp="keep").fits("standard")


def test_nemotron_super_recipes(monkeypatch):
    """Nemotron-3 Super at 4/6/8-bit bf16 and 4-bit fp16, each on the standard runner with a 1 GB raw window (the
    release's shard sizes are not known). The head is the whole prediction module, mtp.layers.{0,1} (an attention
    block and a 512-expert latent-MoE block), kept bf16 in mtp.safetensors; under ``match`` its eh_proj and routers
    stay float. `recipe list` and the publish workflow's matrix list them."""
    monkeypatch.chdir(ROOT)
    for r in _matrix_recipes(NEMOTRON):
        dtype = SHORT_DTYPE[r.dtype]
        rel = r.release
        assert r.repo == f"nvidia/{r.release_name}" and r.path.stem == f"{r.release_name}-{r.bits}bit-{dtype}"
        assert r.upload_repo == f"mtpconvert/{r.release_name}-{r.bits}bit-{dtype}-mtp" and r.mtp == "keep"
        assert r.runner == "standard" and r.raw_window_gb == 1 and rel.raw_shards is None
        assert r.cli_args(stream=True)[-3:] == ["--stream", "--raw-window", "1"]
        assert r.lm_head_gb == pytest.approx(r._gb_at_bits(131072 * 4096 / 1e9)) and rel.vocab != VOCAB
        assert r.params_b == 120 and rel.params_b is None  # the name's size
        plan = build_plan(release_checkpoint(r.release_name), replace(r, mtp="match").options)
        head = {it.name: it for it in plan.items if it.shard == MTP_FILE}
        assert len(head) == 18 and plan.mtp_layers == 1
        assert head["mtp.layers.1.mixer.switch_mlp.fc1.weight"].slot.shape == (512, 2688, 1024)
        assert head["mtp.layers.0.eh_proj.weight"].quant is None and head["mtp.layers.1.mixer.gate.weight"].quant is None
        assert head["mtp.layers.1.mixer.switch_mlp.fc1.weight"].quant is not None
        assert replace(r, mtp="match").head_gb == pytest.approx(sum(it.out_bytes for it in head.values()) / 1e9,
                                                                abs=0.006)
    jobs = workflow_matrix("recipes/NVIDIA-Nemotron-*.toml")
    assert len(jobs) == 4 and {(j["size"], j["raw"]) for j in jobs} == {("standard", "1 GB window")}
    result = runner.invoke(app, ["recipe", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "nvidia/NVIDIA-Nemotron-3-Super" in result.output, result.output
