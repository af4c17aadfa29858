"""The README's Python example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "api.convert" in b)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)  # noqa: S102 - our own README
    assert scope["result"].checks.smoke_acceptance >= 0.8
    assert scope["stats"].acceptance >= 0.8 and (tmp_path / "fixture-4bit" / "config.json").exists()
