"""Row-block execution: any block size and any number of streams give the same bytes,
and no read is larger than a block."""

import math

import mlx.core as mx
import numpy as np
import pytest
from tests.checkpoints import tree_digest

from mtpconvert.execute.blocks import _source_runs, item_blocks, quantized_in_numpy, rows
from mtpconvert.execute import execute, pipeline
from mtpconvert.plan.steps import Gather
from mtpconvert.options import ConvertOptions, ExecuteOptions
from mtpconvert.plan import build_plan
from mtpconvert.options import QuantOptions
from mtpconvert.io.header import read_header
from mtpconvert.io.reader import TensorReader, read_all
from mtpconvert.io.shard_writer import StreamingShardWriter, TensorSpec
from mtpconvert.io.checkpoint import open_checkpoint


CASES = {
    "dense-vlm": ConvertOptions(quant=QuantOptions(bits=4, group_size=32), keep_vision=True),
    "dense-sharded-tied": ConvertOptions(),  # unquantized: cast and norm+1 only
    "moe-fused": ConvertOptions(quant=QuantOptions(bits=4, group_size=32, mtp="match")),
    "moe-published35": ConvertOptions(quant=QuantOptions(bits=3, group_size=32)),
    "moe-per-expert": ConvertOptions(quant=QuantOptions(bits=8, group_size=32, mtp_bits=4)),
}


@pytest.mark.parametrize("layout", sorted(CASES))
def test_block_size_and_streams_do_not_change_the_bytes(raw_checkpoints, tmp_path, layout):
    ckpt = open_checkpoint(raw_checkpoints(layout).path)
    plan = build_plan(ckpt, CASES[layout])
    assert max(len(item_blocks(it, 1)) for it in plan.items) > 1  # one row per block really splits
    runs = {"whole": dict(block_bytes=1 << 40, workers=1), "rows": dict(block_bytes=1, workers=2),
            "odd": dict(block_bytes=5000, workers=3)}
    digests = {}
    for name, kw in runs.items():
        execute(plan, ckpt, tmp_path / name, ExecuteOptions(**kw))
        digests[name] = tree_digest(tmp_path / name)
    assert digests["rows"] == digests["whole"] and digests["odd"] == digests["whole"]


def test_no_read_exceeds_a_block(raw_checkpoints, tmp_path, monkeypatch):
    ckpt = open_checkpoint(raw_checkpoints("moe-fused").path)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4, group_size=32)))
    reads = []
    real = TensorReader.view_rows

    def spy(self, info, start, stop):  # every read of the main thread (MLX's blocks)
        out = real(self, info, start, stop)
        reads.append((info.key, out.nbytes, info.nbytes // (info.shape[0] if info.shape else 1)))
        return out

    monkeypatch.setattr(TensorReader, "view_rows", spy)
    real_direct = pipeline.direct_read

    def spy_direct(block, ckpt, **kwargs):  # the reader threads' plain reads (MLX's blocks, gathered in place)
        read = real_direct(block, ckpt, **kwargs)
        if read is not None:
            row_bytes = lambda info: info.nbytes // (info.shape[0] if info.shape else 1)  # noqa: E731
            if block.item.gather is Gather.STACK:  # whole experts, as reader.read would
                reads.extend((info.key, n, row_bytes(info)) for info, _, n in read.runs)
            else:
                info = read.runs[0][0]
                reads.append((info.key, read.nbytes, row_bytes(info)))
        return read

    monkeypatch.setattr(pipeline, "direct_read", spy_direct)
    block = 4096
    execute(plan, ckpt, tmp_path / "out", ExecuteOptions(block_bytes=block))
    assert reads and all(n <= max(block, row) for _, n, row in reads), [r for r in reads if r[1] > max(block, r[2])]
    # the fused gate_up is read a few experts at a time, never whole
    fused = [r for r in reads if r[0].endswith("experts.gate_up_proj")]
    assert fused and all(n < ckpt.tensors[k].nbytes for k, n, _ in fused)
    # npquant's worker processes read the runs _source_runs names: bounded the same way
    numpy_blocks = [b for it in plan.items if quantized_in_numpy(it) for b in item_blocks(it, block)]
    assert numpy_blocks
    for b in numpy_blocks:
        itemsize = {"BF16": 2, "F16": 2, "F32": 4}[b.item.sources[0].dtype]
        read = sum(math.prod(shape) for _, _, shape in _source_runs(b, ckpt)) * itemsize
        row = b.item.in_bytes // rows(b.item)
        assert read <= max(block, row), (b.item.slot.name, b.start, b.stop, read)


def test_read_rows_and_halves_match_numpy(tmp_path):
    from mtpconvert.io.shard_writer import write_all

    w = mx.random.normal((5, 6, 4)).astype(mx.bfloat16)
    write_all(tmp_path / "x.safetensors", {"w": w})
    info = read_header(tmp_path / "x.safetensors").tensors["w"]
    ref = np.array(w.astype(mx.float32))
    with TensorReader() as r:
        assert np.array_equal(np.array(r.read_rows(info, 1, 4).astype(mx.float32)), ref[1:4])
        assert np.array_equal(np.array(r.read_rows(info, 2, 5, part=(1, 2)).astype(mx.float32)), ref[2:5, 3:])
        assert np.array_equal(np.array(r.read_rows(info, 0, 2, part=(0, 3)).astype(mx.float32)), ref[0:2, :2])
        with pytest.raises(ValueError, match="rows"):
            r.read_rows(info, 3, 6)
        with pytest.raises(ValueError, match="does not split"):
            r.read_rows(info, 0, 1, part=(0, 4))


def specs():
    return [TensorSpec("a", "float32", (4, 2)), TensorSpec("b", "float16", (3,))]


def test_writer_takes_rows_in_order_and_interleaved(tmp_path):
    a, b = mx.arange(8, dtype=mx.float32).reshape(4, 2), mx.array([1, 2, 3], dtype=mx.float16)
    w = StreamingShardWriter(tmp_path / "s.safetensors", specs())
    w.write("a", a[:1], 0)
    w.write("b", b[:2], 0)
    w.write("a", a[1:4], 1)
    w.write("b", b[2:], 2)
    w.close()
    back = read_all(tmp_path / "s.safetensors")
    assert mx.array_equal(back["a"], a) and mx.array_equal(back["b"], b)


@pytest.mark.parametrize("writes,match", [
    ([("a", (0, 2), 0), ("a", (3, 4), 3)], "out of order"),
    ([("a", (0, 2), 0), ("a", (0, 2), 0)], "out of order"),
    ([("a", (0, 4), 0), ("b", (0, 3), 1)], "out of order"),
])
def test_writer_refuses_rows_out_of_order(tmp_path, writes, match):
    full = {"a": mx.zeros((4, 2), dtype=mx.float32), "b": mx.zeros((3,), dtype=mx.float16)}
    w = StreamingShardWriter(tmp_path / "s.safetensors", specs())
    with pytest.raises(RuntimeError, match=match):
        for key, (lo, hi), row in writes:
            w.write(key, full[key][lo:hi], row)
    w.abort()


def test_writer_refuses_wrong_trailing_shape_and_missing_rows(tmp_path):
    w = StreamingShardWriter(tmp_path / "s.safetensors", specs())
    with pytest.raises(RuntimeError, match=r"planned as float32\[4, 2\]"):
        w.write("a", mx.zeros((2, 3), dtype=mx.float32), 0)
    w.write("a", mx.zeros((3, 2), dtype=mx.float32), 0)
    w.write("b", mx.zeros((3,), dtype=mx.float16), 0)
    with pytest.raises(RuntimeError, match="closed before a was written"):
        w.close()
