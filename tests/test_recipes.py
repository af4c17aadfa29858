"""Every recipe parses and names a valid configuration; the publish workflow is well formed."""

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path
import yaml

import pytest
from typer.testing import CliRunner

from mtpconvert.cli import app
from mtpconvert.errors import OptionsError
from mtpconvert.recipes import RUNNERS, list_recipes, load_recipe, runner_labels, workflow_matrix

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_every_recipe_is_valid():
    recipes = list_recipes(ROOT / "recipes")
    assert len(recipes) >= 18
    names = {r.repo for r in recipes}
    for model in ("Qwen3.5-27B", "Qwen3.5-35B-A3B", "Qwen3.5-122B-A10B", "Qwen3.5-397B-A17B", "Qwen3.6-27B",
                  "Qwen3.6-35B-A3B"):
        assert f"Qwen/{model}" in names
        bits = {r.bits for r in recipes if r.repo == f"Qwen/{model}"}
        assert bits == {4, 6, 8}
    for r in recipes:
        r.quant.validated()
        text = r.path.read_text()
        assert "# Why:" in text, f"{r.path.name} must document its reasons"
        assert r.mtp == "keep" and r.upload_repo


@pytest.mark.parametrize("body, key", [
    ('repo = "meta/llama"\n', "repo"),
    ('repo = "Qwen/Qwen3.5-27B"\nbits = 5\ngroup_size = 64\nq_mode = "mxfp4"\n', None),
    ('repo = "Qwen/Qwen3.5-27B"\nbits = "4"\n', "bits"),
    ('repo = "Qwen/Qwen3.5-27B"\ncolour = "red"\n', "colour"),
    ('repo = "Qwen/Qwen3.5-27B"\nmtp = "half"\n', "mtp"),
    ('repo = "Qwen/Qwen3.5-27B"\nprefetch_shards = -1\n', "prefetch_shards"),
    ('repo = "Qwen/Qwen3.5-27B"\nprefetch_shards = true\n', "prefetch_shards"),
    ('repo = "Qwen/Qwen3.5-27B"\nprefetch_shards = 0.5\n', "prefetch_shards"),
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
    assert result.output.count("Qwen/Qwen3.5-397B-A17B") == 4 and "Qwen3.6-27B-4bit-bf16.toml" in result.output


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


def smallest_runner(r) -> str:
    need = (r.disk_needed_gb(), r.memory_needed_gb())
    return next(n for n in RUNNERS if RUNNERS[n].disk_gb >= need[0] and RUNNERS[n].memory_gb >= need[1])


def test_every_recipe_runs_on_the_smallest_runner_with_the_disk_and_memory_it_needs():
    """--stream --upload-repo with the streamed smoke: 1 + prefetch_shards raw shards + two output shards, the
    head, lm_head's copy; memory: the largest layer or the head as the layerwise smoke holds it. A recipe holds
    one raw shard (prefetch_shards = 0: downloads no longer overlap conversion) only where two would need a
    larger runner."""
    for r in list_recipes(ROOT / "recipes"):
        assert r.runner in RUNNERS and r.runner in r.path.read_text(), r.path.name
        assert r.runner == smallest_runner(r), (r.path.name, r.runner, r.disk_needed_gb(), r.memory_needed_gb())
        if r.prefetch_shards == 0:
            assert smallest_runner(replace(r, prefetch_shards=1)) != r.runner, r.path.name  # needed, not habit
        else:
            assert smallest_runner(replace(r, prefetch_shards=0)) == r.runner, r.path.name  # would win nothing
    sizes = {r.path.name: (r.runner, r.prefetch_shards) for r in list_recipes(ROOT / "recipes")}
    assert sizes["Qwen3.6-27B-8bit-bf16.toml"] == ("standard", 1)  # 3.6 GB raw shards: two fit
    for name in ("Qwen3.5-27B", "Qwen3.5-35B-A3B"):  # two 5 GB raw shards: 14.4-15.2 GB > 14; one: 9.5-10.2
        assert {v for k, v in sizes.items() if k.startswith(name + "-")} == {("standard", 0)}
    assert sizes["Qwen3.5-122B-A10B-4bit-bf16.toml"] == ("large", 1)  # 6.3 GB shard + 5 GB head: 14.7 > 14 even with one
    # the head as stored (13.2 GB bf16) + one bounded group of float32 experts: 15.5 GB fits 16; disk 25-34 GB
    assert sizes["Qwen3.5-397B-A17B-4bit-bf16.toml"] == ("large", 1)


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
    assert jobs == [{"recipe": f"recipes/Qwen3.5-27B-4bit-{d}.toml", "size": "standard",
                     "runs_on": RUNNERS["standard"].label, "raw_shards": 1} for d in ("bf16", "fp16")]
    assert [j["raw_shards"] for j in workflow_matrix("recipes/Qwen3.6-27B-4bit-*.toml")] == [2, 2]
    labels = runner_labels('{"xlarge": "org-8core"}')
    assert workflow_matrix("recipes/Qwen3.5-27B-4bit-bf16.toml", "xlarge", labels)[0]["runs_on"] == "org-8core"
    with pytest.raises(OptionsError):
        workflow_matrix("recipes/nothing-*.toml")
    with pytest.raises(OptionsError):
        runner_labels('{"giant": "x"}')


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

    # the matrix step's command, as the workflow runs it (before anything is installed)
    step = next(s for s in jobs["matrix"]["steps"] if s.get("id") == "list")
    assert step["env"]["PYTHONPATH"] == "."
    def matrix(glob):
        command = step["run"].split(">>")[0].replace("${GLOB}", glob).replace("$RUNNER", "recipe")
        out = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True,
                             env={"PATH": os.environ["PATH"], "PYTHONPATH": "."})
        assert out.returncode == 0, out.stderr
        return [(j["size"], j["raw_shards"]) for j in json.loads(out.stdout.removeprefix("include="))]

    assert matrix("Qwen3.5-397B-A17B-4bit-*") == [("large", 2), ("large", 2)]
    assert matrix("Qwen3.5-35B-A3B-8bit-*") == [("standard", 1)]  # prefetch_shards = 0: one raw shard
    assert "matrix.raw_shards" in publish["name"] and "matrix.size" in publish["name"]

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
