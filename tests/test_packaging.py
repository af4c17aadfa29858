"""The package as pip installs it: recipes and fixture inside, no setuptools deprecations, usable outside the checkout."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build the wheel from a copy of the sources, so the build leaves no build/ or egg-info in the checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "mtpconvert", source / "mtpconvert", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                            "-w", str(tmp / "dist"), str(source)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return next((tmp / "dist").glob("mtpconvert-*.whl")), build.stdout + build.stderr


@pytest.mark.slow
def test_the_wheel_holds_the_recipes_and_the_fixture(wheel):
    names = zipfile.ZipFile(wheel[0]).namelist()
    assert sum(n.startswith("mtpconvert/data/recipes/") and n.endswith(".toml") for n in names) >= 18
    assert "mtpconvert/fixture/data/tiny-qwen35-mtp/model.safetensors" in names


@pytest.mark.slow
def test_the_build_warns_of_no_deprecated_metadata(wheel):
    """setuptools >= 77 wants `license` as an SPDX string; the TOML-table form prints a deprecation warning."""
    log = wheel[1]
    assert "SetuptoolsDeprecationWarning" not in log and "is deprecated" not in log, log[-3000:]


@pytest.mark.slow
def test_a_pip_installed_package_works_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel[0])], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    env = {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "200"}  # the installed copy, not the checkout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    listed = subprocess.run([sys.executable, "-c", "import mtpconvert, sys; print(mtpconvert.__file__); "
                             "from mtpconvert.cli import run; sys.exit(run(['recipe', 'list']))"],
                            cwd=elsewhere, env=env, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith(str(site)) and "Qwen3.5-27B-4bit-bf16.toml" in listed.stdout

    def cli(*argv):
        code = ("import sys; from mtpconvert.fixture import fixture_path; from mtpconvert.cli import run; "
                f"sys.exit(run([a.replace('@FIXTURE', str(fixture_path('dense'))) for a in {list(argv)!r}]))")
        return subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True)

    # the bundled fixture from the installed copy: convert (with its checks), verify, smoke
    converted = cli("convert", "@FIXTURE", "out", "--bits", "4", "--group-size", "32")
    assert converted.returncode == 0, converted.stdout[-2000:] + converted.stderr[-2000:]
    assert (elsewhere / "out" / "mtp.safetensors").is_file()
    for argv in (("verify", "out"), ("smoke", "out", "--max-tokens", "16")):
        done = cli(*argv)
        assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-2000:])


def test_make_demo_installs_no_torch():
    """`make demo` installs the package (and MLX's CPU backend) only; torch comes with the test extras."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    makefile = (ROOT / "Makefile").read_text()
    rule = makefile.split("$(VENV)/.installed-demo:")[1].split("\n\n")[0]
    installs = [line for line in rule.splitlines() if "pip install" in line]
    assert installs and all("test" not in line for line in installs), rule
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    demo_requirements = project["dependencies"] + project["optional-dependencies"]["cpu"]
    assert not [r for r in demo_requirements if r.lower().startswith("torch")]
