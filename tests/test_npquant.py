"""npquant gives the bytes of MLX's CPU ``mx.quantize``, for every dtype, width and group
size it takes, edge-case groups included; a conversion gives the same shards with or
without it."""

import itertools
import shutil

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import tree_digest

from mtpconvert import npquant
from mtpconvert import execute as execute_mod
from mtpconvert.blocks import quantized_in_numpy
from mtpconvert.execute import execute
from mtpconvert.plan import ConvertOptions, build_plan
from mtpconvert.quant import QuantOptions
from mtpconvert.safetensors_io import read_all, write_all
from mtpconvert.source import open_checkpoint

MX_DTYPES = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}
TARGETS = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def edge_groups(cols: int, rng) -> np.ndarray:
    """Rows of values that stress each branch of the kernel's scale/bias rule."""
    rows = [
        np.zeros(cols),  # q0 == 0, zero span
        -np.zeros(cols),  # -0.0 everywhere
        np.full(cols, 0.5), np.full(cols, -0.3),  # constant groups: eps span, huge |edge/scale|
        np.full(cols, 1e-9), np.where(np.arange(cols) % 2, 1e-40, 0.0),  # tiny, subnormal
        rng.standard_normal(cols) * 100,  # wide
        -np.abs(rng.standard_normal(cols)), np.abs(rng.standard_normal(cols)),  # one-signed
        rng.standard_normal(cols) * 0.02,  # typical weights
        rng.standard_normal(cols) * 0.02 + 0.05,  # offset: small |edge/scale|, q0 near +-1
    ]
    # edge/scale = t exactly, for t in the rounding corners: min = -t * span/15, max = span - t*span/15
    for t in (0.5, 0.49, 0.51, 1.5, 1.49, 2.5, 7.5):
        row = np.linspace(0, 1, cols) * 15 - t
        rows.append(row * 0.01)
        rows.append(-row * 0.01)
    return np.stack(rows).astype(np.float32)


def mlx_bytes(w: mx.array, target: str, bits: int, group: int):
    out = mx.quantize(w.astype(TARGETS[target]), group_size=group, bits=bits)
    return [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes() for a in out]


def source_numpy(w: mx.array, source: str) -> np.ndarray:
    return np.array(w.view(mx.uint16)) if source == "BF16" else np.array(w)


@pytest.mark.parametrize("source,target", list(itertools.product(MX_DTYPES, TARGETS)))
def test_bytes_match_mx_quantize(source, target):
    rng = np.random.default_rng(0)
    values = edge_groups(256, rng)
    if "float16" in (source, target) or source == "F16":
        values = np.clip(values, -6e4, 6e4)  # finite in float16
    w = mx.array(values).astype(MX_DTYPES[source])
    for bits, group in itertools.product(npquant.BITS, npquant.GROUP_SIZES):
        assert npquant.supports(source, target, bits, group)
        # two row blocks of different lengths, quantized as one run
        made = npquant.quantize_rows([source_numpy(w[:5], source), source_numpy(w[5:], source)],
                                     source, target, bits, group)
        assert made is not None
        assert [a.tobytes() for a in made] == mlx_bytes(w, target, bits, group), (bits, group)


def test_chunking_does_not_change_the_bytes(monkeypatch):
    w = mx.random.normal((48, 512), key=mx.random.key(1)).astype(mx.bfloat16)
    whole = npquant.quantize_rows([source_numpy(w, "BF16")], "BF16", "bfloat16", 4, 64)
    monkeypatch.setattr(npquant, "CHUNK_ELEMENTS", 64 * 5)  # 5 groups a pass, the last one short
    small = npquant.quantize_rows([source_numpy(w, "BF16")], "BF16", "bfloat16", 4, 64)
    assert [a.tobytes() for a in small] == [a.tobytes() for a in whole] == mlx_bytes(w, "bfloat16", 4, 64)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(bad):
    values = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    values[2, 77] = bad
    assert npquant.quantize_rows([values], "F32", "float32", 4, 64) is None
    # a finite value that overflows the cast target is refused too
    assert npquant.quantize_rows([np.full((1, 64), 7e4, np.float32)], "F32", "float16", 4, 64) is None


def test_what_it_does_not_take():
    assert not npquant.supports("BF16", "bfloat16", 3, 64)  # MLX packs 3/5/6 bits across words
    assert not npquant.supports("BF16", "bfloat16", 4, 64, mode="mxfp4")
    assert not npquant.supports("F64", "bfloat16", 4, 64)


# ---------------------------------------------------------------- in a conversion


CASES = {
    "dense-vlm": ConvertOptions(quant=QuantOptions(bits=4, group_size=32), keep_vision=True),
    "moe-fused": ConvertOptions(quant=QuantOptions(bits=4, group_size=32, mtp="match"), dtype="float16"),
    "moe-per-expert": ConvertOptions(quant=QuantOptions(bits=8, group_size=32, mtp_bits=2)),
    "moe-published35": ConvertOptions(quant=QuantOptions(bits=2, group_size=64)),
}


@pytest.fixture
def numpy_pool(monkeypatch):
    """Quantize in worker processes even for these small checkpoints; count what came back."""
    monkeypatch.setattr(execute_mod, "NUMPY_MIN_BYTES", 0)
    made = {"numpy": 0, "mlx fallback": 0}
    real_outputs, real_produce = execute_mod.numpy_outputs, execute_mod.produce_block

    def outputs(block, arrays):
        made["numpy"] += 1
        return real_outputs(block, arrays)

    def produce(block, ckpt, reader):
        if quantized_in_numpy(block.item):
            made["mlx fallback"] += 1
        return real_produce(block, ckpt, reader)

    monkeypatch.setattr(execute_mod, "numpy_outputs", outputs)
    monkeypatch.setattr(execute_mod, "produce_block", produce)
    return made


@pytest.mark.parametrize("layout", sorted(CASES))
def test_conversion_is_byte_identical_with_and_without_numpy(raw_checkpoints, tmp_path, monkeypatch, numpy_pool,
                                                             layout):
    ckpt = open_checkpoint(raw_checkpoints(layout).path)
    plan = build_plan(ckpt, CASES[layout])
    execute(plan, ckpt, tmp_path / "numpy", block_bytes=3000, workers=2)
    assert numpy_pool["numpy"] > 2 and numpy_pool["mlx fallback"] == 0
    monkeypatch.setenv("MTPCONVERT_NUMPY_QUANT", "0")
    execute(plan, ckpt, tmp_path / "mlx", block_bytes=3000, workers=2)
    assert numpy_pool["numpy"] > 2 and numpy_pool["mlx fallback"] > 2
    assert tree_digest(tmp_path / "numpy") == tree_digest(tmp_path / "mlx")


def test_a_block_with_a_nan_is_made_by_mlx(raw_checkpoints, tmp_path, monkeypatch, numpy_pool):
    src = tmp_path / "src"
    shutil.copytree(raw_checkpoints("dense-sharded-tied").path, src)
    ckpt = open_checkpoint(src)
    key = next(k for k in sorted(ckpt.tensors) if k.endswith("mlp.down_proj.weight"))
    path = ckpt.tensors[key].file
    tensors = read_all(path)
    w = np.array(tensors[key].astype(mx.float32))
    w[1, 3] = np.nan
    tensors[key] = mx.array(w).astype(tensors[key].dtype)
    write_all(path, tensors)
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4, group_size=32)))
    execute(plan, ckpt, tmp_path / "numpy", block_bytes=1 << 40)
    assert numpy_pool["numpy"] > 2 and numpy_pool["mlx fallback"] == 1  # the NaN's block, and only it
    monkeypatch.setenv("MTPCONVERT_NUMPY_QUANT", "0")
    execute(plan, ckpt, tmp_path / "mlx", block_bytes=1 << 40)
    assert tree_digest(tmp_path / "numpy") == tree_digest(tmp_path / "mlx")


def test_a_shard_truncated_after_planning_is_named_before_a_worker_reads_it(raw_checkpoints, tmp_path, numpy_pool):
    from mtpconvert.errors import SafetensorsError

    src = tmp_path / "src"
    shutil.copytree(raw_checkpoints("dense-sharded-tied").path, src)
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4, group_size=32)))
    key = next(k for k in sorted(ckpt.tensors) if k.endswith("mlp.down_proj.weight"))
    victim = ckpt.tensors[key].file
    victim.write_bytes(victim.read_bytes()[:ckpt.tensors[key].start + 10])
    # only the weight itself is cut into, so its own check, on the main thread, is what fires
    tail = [t for t in ckpt.tensors.values() if t.file == victim and t.start > ckpt.tensors[key].start]
    for t in tail:
        plan.items[:] = [it for it in plan.items if t.key not in {s.key for s in it.sources}]
    with pytest.raises(SafetensorsError, match="truncated") as err:
        execute(plan, ckpt, tmp_path / "out")
    assert err.value.file == str(victim) and err.value.key == key
    assert quantized_in_numpy(next(it for it in plan.items if key in {s.key for s in it.sources}))  # a worker's item
    assert not (tmp_path / "out").exists()
