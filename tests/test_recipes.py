"""Every recipe parses and names a valid configuration; the publish workflow is well formed."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mtpconvert.cli import app
from mtpconvert.errors import OptionsError
from mtpconvert.recipes import list_recipes, load_recipe

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


def test_publish_workflow():
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "publish.yml").read_text())
    jobs = wf["jobs"]
    publish = jobs["publish"]
    assert publish["needs"] == "matrix"
    assert publish["strategy"]["matrix"]["recipe"] == "${{ fromJson(needs.matrix.outputs.recipes) }}"
    assert publish["env"]["HF_TOKEN"] == "${{ secrets.HF_TOKEN }}"
    steps = " ".join(s.get("run", "") for s in publish["steps"])
    assert "mtpconvert" in steps and "recipe run" in steps
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in publish["steps"])
    assert True in wf or "on" in wf  # PyYAML reads the bare key `on` as True
