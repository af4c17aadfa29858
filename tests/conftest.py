import pytest

from tests.checkpoints import build

LAYOUTS = {
    # name: build kwargs
    "dense-vlm": dict(),
    "dense-text": dict(wrapper="text"),
    "dense-sharded-tied": dict(tie=True, shards=3, shard_style="qwen35", dtype="bfloat16"),
    "dense-tie-top-level": dict(tie=True, tie_top_level_only=True),
    "moe-per-expert": dict(moe=True),
    "moe-fused": dict(moe=True, experts="fused", shards=2, shard_style="hf"),
    "moe-published35": dict(moe=True, experts="published35", dtype="bfloat16"),
    "moe-text-fused": dict(moe=True, wrapper="text", experts="fused"),
}


@pytest.fixture(scope="session")
def raw_checkpoints(tmp_path_factory):
    """Built lazily: name -> checkpoints.Built."""
    root = tmp_path_factory.mktemp("raw")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = build(root / name, seed=sorted(LAYOUTS).index(name), **LAYOUTS[name])
        return cache[name]

    return get
