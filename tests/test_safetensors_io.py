"""The header reader refuses malformed or hostile files with a clear error."""

import json
import struct

import mlx.core as mx
import pytest

from mtpconvert.errors import SafetensorsError
from mtpconvert.io.header import MAX_HEADER_BYTES, read_header
from mtpconvert.io.reader import read_all
from mtpconvert.io.shard_writer import write_all


def raw_file(path, header: dict, data: bytes = b"", header_len=None):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", header_len if header_len is not None else len(h)) + h + data)
    return path


def test_roundtrip_bf16_and_views(tmp_path):
    t = {"a": mx.random.normal((3, 5)).astype(mx.bfloat16), "b": mx.arange(6).reshape(2, 3).T}
    write_all(tmp_path / "x.safetensors", t)
    back = read_all(tmp_path / "x.safetensors")
    assert all(mx.array_equal(back[k], t[k]) for k in t)
    assert mx.load(str(tmp_path / "x.safetensors"))["b"].tolist() == t["b"].tolist()


@pytest.mark.parametrize(
    "header,data,match",
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "outside"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12 bytes"),
        ({"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
        ({"w": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, "not supported"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlap"),
        ({"w": [1, 2]}, b"", "not an object"),
    ],
)
def test_bad_headers(tmp_path, header, data, match):
    f = raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(SafetensorsError, match=match) as e:
        read_header(f)
    assert e.value.file == str(f)


def test_header_length_bounds(tmp_path):
    with pytest.raises(SafetensorsError, match="exceeds"):
        read_header(raw_file(tmp_path / "a.safetensors", {}, header_len=MAX_HEADER_BYTES + 1))
    with pytest.raises(SafetensorsError, match="runs past the end"):
        read_header(raw_file(tmp_path / "b.safetensors", {}, header_len=10_000))
    (tmp_path / "c.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="too short"):
        read_header(tmp_path / "c.safetensors")
    (tmp_path / "d.safetensors").write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        read_header(tmp_path / "d.safetensors")


def test_truncated_shard(tmp_path):
    f = tmp_path / "t.safetensors"
    write_all(f, {"w": mx.zeros((64, 64))})
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(SafetensorsError, match="outside"):
        read_header(f)
