"""npquant, and the elementwise-ops quantizer a GPU backend runs (``ops.affine_quantize``), give
the bytes of MLX's CPU ``mx.quantize``, for every dtype, width and group size they take,
edge-case groups included; a conversion gives the same shards through any of them."""

import itertools
from collections import Counter
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest
from tests.checkpoints import tree_digest
from tests.quant_cases import MX_DTYPES, TARGETS, edge_groups

from mtpconvert.execute import npquant, ops, quantpool
from mtpconvert.execute import pipeline as execute_mod
from mtpconvert.execute.blocks import quantized_in_numpy
from mtpconvert.execute import execute
from mtpconvert.options import ConvertOptions, ExecuteOptions
from mtpconvert.plan import build_plan
from mtpconvert.execute.quantpool import QuantizerPool
from mtpconvert.options import QuantOptions
from mtpconvert.io.reader import read_all
from mtpconvert.io.shard_writer import write_all
from mtpconvert.io.checkpoint import open_checkpoint

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


@pytest.mark.parametrize("source,target", list(itertools.product(MX_DTYPES, TARGETS)))
def test_gpu_quantizer_gives_the_cpu_kernels_bytes(source, target):
    values = edge_groups(256, np.random.default_rng(1))
    if "float16" in (source, target) or source == "F16":
        values = np.clip(values, -6e4, 6e4)
    w = mx.array(values).astype(MX_DTYPES[source]).astype(TARGETS[target])
    for bits, group in itertools.product(ops.AFFINE_BITS, npquant.GROUP_SIZES):
        made = ops.affine_quantize(w, bits, group)
        assert [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes() for a in made] == \
            mlx_bytes(w, target, bits, group), (bits, group)


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

    real_direct = execute_mod.direct_read

    def direct(block, ckpt, **kwargs):  # MLX's blocks whose source the reader threads read in place
        read = real_direct(block, ckpt, **kwargs)
        if read is not None and quantized_in_numpy(block.item):
            made["mlx fallback"] += 1
        return read

    monkeypatch.setattr(execute_mod, "numpy_outputs", outputs)
    monkeypatch.setattr(execute_mod, "produce_block", produce)
    monkeypatch.setattr(execute_mod, "direct_read", direct)
    return made


@pytest.mark.parametrize("layout", sorted(CASES))
def test_conversion_is_byte_identical_with_and_without_numpy(raw_checkpoints, tmp_path, monkeypatch, numpy_pool,
                                                             layout):
    ckpt = open_checkpoint(raw_checkpoints(layout).path)
    plan = build_plan(ckpt, CASES[layout])
    execute(plan, ckpt, tmp_path / "numpy", ExecuteOptions(block_bytes=3000, workers=2))
    assert numpy_pool["numpy"] > 2 and numpy_pool["mlx fallback"] == 0
    monkeypatch.setenv("MTPCONVERT_NUMPY_QUANT", "0")
    execute(plan, ckpt, tmp_path / "mlx", ExecuteOptions(block_bytes=3000, workers=2))
    assert numpy_pool["numpy"] > 2 and numpy_pool["mlx fallback"] > 2
    assert tree_digest(tmp_path / "numpy") == tree_digest(tmp_path / "mlx")


def quantize_as_on_a_gpu(monkeypatch) -> Counter:
    """From here on conversions quantize as on a GPU backend (``ops.affine_quantize``, MLX path
    only); the counter counts its blocks."""
    calls = Counter()
    real = ops.affine_quantize

    def counted(*args):
        calls["blocks"] += 1
        return real(*args)

    monkeypatch.setattr(ops, "kernel_differs_from_cpu", lambda: True)
    monkeypatch.setattr(ops, "affine_quantize", counted)
    monkeypatch.setenv("MTPCONVERT_NUMPY_QUANT", "0")
    return calls


def test_conversion_is_byte_identical_through_the_gpu_quantizer(raw_checkpoints, tmp_path, monkeypatch):
    ckpt = open_checkpoint(raw_checkpoints("moe-fused").path)
    plan = build_plan(ckpt, CASES["moe-fused"])
    execute(plan, ckpt, tmp_path / "cpu", ExecuteOptions(block_bytes=3000, workers=2))
    calls = quantize_as_on_a_gpu(monkeypatch)
    execute(plan, ckpt, tmp_path / "gpu", ExecuteOptions(block_bytes=3000, workers=2))
    assert calls["blocks"] > 2
    assert tree_digest(tmp_path / "gpu") == tree_digest(tmp_path / "cpu")


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
    execute(plan, ckpt, tmp_path / "numpy", ExecuteOptions(block_bytes=1 << 40))
    assert numpy_pool["numpy"] > 2 and numpy_pool["mlx fallback"] == 1  # the NaN's block, and only it
    monkeypatch.setenv("MTPCONVERT_NUMPY_QUANT", "0")
    execute(plan, ckpt, tmp_path / "mlx", ExecuteOptions(block_bytes=1 << 40))
    assert tree_digest(tmp_path / "numpy") == tree_digest(tmp_path / "mlx")
    # through the GPU quantizer, the NaN's block keeps MLX's own result
    calls = quantize_as_on_a_gpu(monkeypatch)
    execute(plan, ckpt, tmp_path / "gpu", ExecuteOptions(block_bytes=1 << 40))
    assert calls["blocks"] > 2
    assert tree_digest(tmp_path / "numpy") == tree_digest(tmp_path / "gpu")


def test_a_shard_truncated_after_planning_is_named_before_a_worker_reads_it(raw_checkpoints, tmp_path, numpy_pool):
    from mtpconvert.errors import SafetensorsError

    src = tmp_path / "src"
    shutil.copytree(raw_checkpoints("dense-sharded-tied").path, src)
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4, group_size=32)))
    key = next(k for k in sorted(ckpt.tensors) if k.endswith("mlp.down_proj.weight"))
    victim = ckpt.tensors[key].file
    victim.write_bytes(victim.read_bytes()[:ckpt.tensors[key].start + 10])
    before = shared_segments()
    # only the weight itself is cut into, so its own check, on the main thread, is what fires
    tail = [t for t in ckpt.tensors.values() if t.file == victim and t.start > ckpt.tensors[key].start]
    for t in tail:
        plan.items[:] = [it for it in plan.items if t.key not in {s.key for s in it.sources}]
    with pytest.raises(SafetensorsError, match="truncated") as err:
        execute(plan, ckpt, tmp_path / "out")
    assert err.value.file == str(victim) and err.value.key == key
    assert quantized_in_numpy(next(it for it in plan.items if key in {s.key for s in it.sources}))  # a worker's item
    assert not (tmp_path / "out").exists()
    assert shared_segments() == before


# ---------------------------------------------------------------- results in shared memory


def shared_segments() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture
def slot_ledger(monkeypatch):
    """Record every result slot taken and given back; fail on a slot taken twice while held."""
    ledger = {"held": set(), "most held": 0, "taken": 0}
    real_submit, real_release = QuantizerPool.submit, QuantizerPool.release

    def submit(self, task):
        pending = real_submit(self, task)
        assert pending.slot not in ledger["held"], f"slot {pending.slot} handed out while its result is unwritten"
        ledger["held"].add(pending.slot)
        ledger["taken"] += 1
        ledger["most held"] = max(ledger["most held"], len(ledger["held"]))
        return pending

    def release(self, pending):
        ledger["held"].remove(pending.slot)
        real_release(self, pending)

    monkeypatch.setattr(QuantizerPool, "submit", submit)
    monkeypatch.setattr(QuantizerPool, "release", release)
    return ledger


@pytest.mark.parametrize("slots", [2, 3])
def test_few_result_slots_make_the_pipeline_wait_not_overwrite(raw_checkpoints, tmp_path, monkeypatch, numpy_pool,
                                                                slot_ledger, slots):
    ckpt = open_checkpoint(raw_checkpoints("moe-fused").path)
    plan = build_plan(ckpt, CASES["moe-fused"])
    before = shared_segments()
    monkeypatch.setattr(execute_mod, "slots_that_fit", lambda wanted, slot_bytes: min(wanted, slots))
    execute(plan, ckpt, tmp_path / "numpy", ExecuteOptions(block_bytes=3000, workers=2))
    assert slot_ledger["taken"] > 10 and slot_ledger["most held"] == slots and not slot_ledger["held"]
    monkeypatch.setenv("MTPCONVERT_NUMPY_QUANT", "0")
    execute(plan, ckpt, tmp_path / "mlx", ExecuteOptions(block_bytes=3000, workers=2))
    assert tree_digest(tmp_path / "numpy") == tree_digest(tmp_path / "mlx")
    assert shared_segments() == before  # the segment is unlinked with the pool


def test_no_room_for_two_slots_means_mlx_quantizes(raw_checkpoints, tmp_path, monkeypatch, numpy_pool):
    ckpt = open_checkpoint(raw_checkpoints("dense-vlm").path)
    plan = build_plan(ckpt, CASES["dense-vlm"])
    monkeypatch.setattr(execute_mod, "slots_that_fit", lambda wanted, slot_bytes: 1)
    execute(plan, ckpt, tmp_path / "out", ExecuteOptions(block_bytes=3000, workers=2))
    assert numpy_pool["numpy"] == 0 and numpy_pool["mlx fallback"] > 2


def test_slots_that_fit_leave_half_of_a_small_dev_shm(monkeypatch):
    class Stat:
        f_frsize, f_bavail = 4096, (64 << 20) // 4096  # a container's default 64 MiB

    monkeypatch.setattr(quantpool.os, "statvfs", lambda path: Stat)
    assert quantpool.slots_that_fit(10, 4 << 20) == 8
    assert quantpool.slots_that_fit(10, 9 << 20) == 3
    assert quantpool.slots_that_fit(10, 40 << 20) == 0
    monkeypatch.setattr(quantpool.os, "statvfs", lambda path: (_ for _ in ()).throw(FileNotFoundError(path)))
    assert quantpool.slots_that_fit(10, 40 << 20) == 10


def test_result_views_tile_their_slot():
    for bits, group, target in itertools.product(npquant.BITS, npquant.GROUP_SIZES, npquant.TARGET_DTYPES):
        groups = 37
        size = npquant.result_bytes(groups, bits, group, target)
        buf = np.zeros(size + 64, np.uint8)
        packed, scales, biases = npquant.result_views(buf[:size], groups, bits, group, target)
        assert packed.shape == (groups, group * bits // 8) and scales.shape == biases.shape == (groups,)
        spans = sorted((a.__array_interface__["data"][0] - buf.ctypes.data, a.nbytes) for a in (packed, scales, biases))
        assert all(start % npquant.ALIGN == 0 for start, _ in spans)
        assert all(s0 + n0 <= s1 for (s0, n0), (s1, _) in zip(spans, spans[1:])) and spans[-1][0] + spans[-1][1] <= size


KILLED_PARENT = """
import time
from mtpconvert.execute.quantpool import QuantizerPool

if __name__ == "__main__":
    pool = QuantizerPool(2, 2, 4096)
    for f in [pool._procs.submit(time.sleep, 0.5) for _ in range(2)]:
        f.result()
    print(pool._shm.name, *pool._procs._processes, flush=True)
    time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc") or not os.path.isdir("/dev/shm"), reason="reads /proc and /dev/shm")
def test_workers_exit_and_the_segment_goes_when_the_parent_is_killed(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(KILLED_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        segment, *workers = parent.stdout.readline().split()
        assert len(workers) == 2 and os.path.exists(f"/dev/shm/{segment}")
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (all(_gone(int(p)) for p in workers)
                                               and not os.path.exists(f"/dev/shm/{segment}")):
        time.sleep(0.1)
    assert all(_gone(int(p)) for p in workers), "a worker outlived its killed parent"
    assert not os.path.exists(f"/dev/shm/{segment}"), "the killed parent's segment was left in /dev/shm"


def test_a_result_larger_than_its_slot_is_refused(tmp_path):
    rows = np.zeros((4, 64), np.uint16)
    path = tmp_path / "rows.bin"
    path.write_bytes(rows.tobytes())
    size = npquant.result_bytes(4, 4, 64, "bfloat16")
    shm = quantpool.shared_memory.SharedMemory(create=True, size=2 * size)
    try:
        reads = [(str(path), 0, (4, 64))]
        assert npquant.quantize_file_rows_into(reads, "BF16", "bfloat16", 4, 64, shm.name, size, size)
        with pytest.raises(ValueError, match="does not fit"):
            npquant.quantize_file_rows_into(reads, "BF16", "bfloat16", 4, 64, shm.name, 0, size - 1)
    finally:
        attached, view = npquant._SEGMENTS.pop(shm.name)  # as a worker would, in this process
        del view
        attached.close()
        shm.close()
        shm.unlink()


def test_no_shared_memory_means_mlx_quantizes(raw_checkpoints, tmp_path, monkeypatch, numpy_pool):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/dev/shm/psm_test")

    monkeypatch.setattr(quantpool.shared_memory, "SharedMemory", refuse)
    ckpt = open_checkpoint(raw_checkpoints("dense-vlm").path)
    execute(build_plan(ckpt, CASES["dense-vlm"]), ckpt, tmp_path / "out", ExecuteOptions(block_bytes=3000, workers=2))
    assert numpy_pool["numpy"] == 0 and numpy_pool["mlx fallback"] > 2


FP8_CASES = {
    "dense-4bit": ("dense", ConvertOptions(quant=QuantOptions(bits=4, group_size=32))),
    "dense-8bit-f16": ("dense", ConvertOptions(dtype="float16", quant=QuantOptions(bits=8, group_size=64))),
    "moe-4bit-match": ("moe", ConvertOptions(quant=QuantOptions(bits=4, group_size=64, mtp="match"))),
}


@pytest.fixture(scope="module")
def fp8_text_twins(tmp_path_factory):
    """Block-FP8 twins of the trained text fixtures (hidden 192: matrices of one full and one partial
    128-row block, per-expert MoE experts with their own scales)."""
    from tests.fp8 import fp8_twin
    from mtpconvert.fixture.text import TEXT_DENSE, TEXT_MOE

    root = tmp_path_factory.mktemp("fp8")
    return {"dense": fp8_twin(TEXT_DENSE, root / "dense"), "moe": fp8_twin(TEXT_MOE, root / "moe")}


@pytest.mark.parametrize("case", sorted(FP8_CASES))
def test_fp8_sources_quantize_in_numpy_with_mlxs_bytes(fp8_text_twins, tmp_path, monkeypatch, numpy_pool, case):
    """An FP8 release is dequantized in the worker (e4m3 table times its block scale) and quantized there:
    the bytes are those of MLX's path (dequant_fp8 then mx.quantize), blocks split on the scale grid."""
    source, options = FP8_CASES[case]
    ckpt = open_checkpoint(fp8_text_twins[source])
    plan = build_plan(ckpt, options)
    assert any(it.sources[0].scale is not None and quantized_in_numpy(it) for it in plan.items)
    execute(plan, ckpt, tmp_path / "numpy", ExecuteOptions(block_bytes=20000, workers=2))
    assert numpy_pool["numpy"] > 2 and numpy_pool["mlx fallback"] == 0
    monkeypatch.setenv("MTPCONVERT_NUMPY_QUANT", "0")
    execute(plan, ckpt, tmp_path / "mlx", ExecuteOptions(block_bytes=20000, workers=2))
    assert numpy_pool["mlx fallback"] > 2
    assert tree_digest(tmp_path / "numpy") == tree_digest(tmp_path / "mlx")
    assert npquant.task_groups([("f", 0, (3, 64), ("s", 0, (1, 1), "BF16", 0))], 32) == 6


def test_a_non_finite_fp8_scale_is_named_on_the_numpy_path_too(fp8_text_twins, tmp_path, numpy_pool):
    """npquant gives a block whose scale is not finite back to MLX's path, which names the scale."""
    from tests.fp8 import poison_scale
    from mtpconvert.errors import LayoutError

    src = tmp_path / "src"
    shutil.copytree(fp8_text_twins["dense"], src)
    weight = poison_scale(src, next(k for k in open_checkpoint(src).tensors if k.endswith("mlp.down_proj.weight")))
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4)))
    with pytest.raises(LayoutError, match="FP8 scale holds NaN or Inf") as e:
        execute(plan, ckpt, tmp_path / "out", ExecuteOptions(block_bytes=20000))
    assert e.value.key == weight + "_scale_inv"
    assert numpy_pool["mlx fallback"] >= 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("source", ["dense", "moe"])
def test_fp8_sources_to_a_float_dtype_dequantize_on_the_reader_threads_with_mlxs_bytes(
        fp8_text_twins, tmp_path, monkeypatch, source, dtype):
    """On the CPU a float FP8 item is dequantized by the reader threads (npquant.dequantize_fp8 into the
    block's buffer); the bytes are those of MLX's dequant_fp8 and cast, blocks split on the scale grid."""
    ckpt = open_checkpoint(fp8_text_twins[source])
    plan = build_plan(ckpt, ConvertOptions(dtype=dtype))
    real, host = execute_mod.direct_read, Counter()

    def counted(block, ckpt, dequantize_fp8=False):
        read = real(block, ckpt, dequantize_fp8)
        host[bool(read is not None and read.scales)] += 1
        return read

    monkeypatch.setattr(execute_mod, "direct_read", counted)
    execute(plan, ckpt, tmp_path / "host", ExecuteOptions(block_bytes=30000))
    assert host[True] > 10
    monkeypatch.setattr(execute_mod, "direct_read", lambda block, ckpt, dequantize_fp8=False: real(block, ckpt))
    execute(plan, ckpt, tmp_path / "mlx", ExecuteOptions(block_bytes=30000))
    assert tree_digest(tmp_path / "host") == tree_digest(tmp_path / "mlx")
