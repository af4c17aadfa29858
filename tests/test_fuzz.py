"""Property tests: mutated headers and configs give a correct result or our own clear error, nothing else.

Case counts are set here and recorded in docs/reliability.md (MTPCONVERT_FUZZ_EXAMPLES raises them).
"""

import copy
import dataclasses
import json
import os
import struct

import hypothesis.strategies as st
import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings

from mtpconvert.errors import ConvertError, SafetensorsError
from mtpconvert.options import ConvertOptions
from mtpconvert.plan import build_plan
from mtpconvert.options import QuantOptions
from mtpconvert.io.header import MAX_HEADER_BYTES, read_header
from mtpconvert.io.shard_writer import write_all
from mtpconvert.io.checkpoint import open_checkpoint

EXAMPLES = int(os.environ.get("MTPCONVERT_FUZZ_EXAMPLES", "300"))
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("fz") / "ok.safetensors"
    write_all(f, {"a": mx.arange(12, dtype=mx.float32).reshape(3, 4), "b": mx.ones((5,), dtype=mx.bfloat16),
                  "c": mx.zeros((2, 2), dtype=mx.uint32)})
    return f.read_bytes()


def check_header(tmp_path, blob):
    f = tmp_path / "m.safetensors"
    f.write_bytes(blob)
    try:
        header = read_header(f)
    except SafetensorsError as e:
        assert e.file == str(f) and str(e)
        return
    # accepted: every tensor lies inside the file and its byte count fits dtype x shape
    size = len(blob)
    for info in header.tensors.values():
        assert info.start <= info.end <= size


@fuzz
@given(data=st.data())
def test_byte_mutations_of_a_valid_file(tmp_path_factory, valid_file, data):
    blob = bytearray(valid_file)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    check_header(tmp_path_factory.mktemp("b"), bytes(blob))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)


@fuzz
@given(data=st.data())
def test_structured_header_mutations(tmp_path_factory, valid_file, data):
    n = struct.unpack("<Q", valid_file[:8])[0]
    header = json.loads(valid_file[8: 8 + n])
    body = valid_file[8 + n:]
    key = data.draw(st.sampled_from(sorted(header)))
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
    if field is None:
        header[key] = data.draw(JSON_VALUES)
    elif isinstance(header[key], dict):
        header[key][field] = data.draw(JSON_VALUES | st.lists(st.integers(-5, 2**40), max_size=3))
    raw = json.dumps(header).encode()
    declared = data.draw(st.sampled_from([len(raw), len(raw) + 7, 2**63 - 1, MAX_HEADER_BYTES + 1, 0]))
    check_header(tmp_path_factory.mktemp("s"), struct.pack("<Q", declared) + raw + body)


@pytest.fixture(scope="module")
def checkpoint(raw_checkpoints):
    return open_checkpoint(raw_checkpoints("moe-published35").path)


CONFIG_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "full_attention_interval", "linear_conv_kernel_dim",
               "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "mtp_num_hidden_layers", "tie_word_embeddings", "model_type", "layer_types", "rms_norm_eps"]


@fuzz
@given(data=st.data())
def test_plan_builder_on_mutated_configs(checkpoint, data):
    config = copy.deepcopy(checkpoint.config)
    for _ in range(data.draw(st.integers(1, 3))):
        where = config["text_config"] if data.draw(st.booleans()) else config
        key = data.draw(st.sampled_from(CONFIG_KEYS))
        if data.draw(st.integers(0, 4)) == 0:
            where.pop(key, None)
        else:
            where[key] = data.draw(JSON_VALUES | st.integers(-3, 4096))
    ckpt = dataclasses.replace(checkpoint, config=config)
    opts = data.draw(st.sampled_from([ConvertOptions(), ConvertOptions(quant=QuantOptions(bits=4, group_size=32))]))
    try:
        plan = build_plan(ckpt, opts)
    except ConvertError as e:
        assert str(e)
        return
    assert plan.items  # accepted configs describe the weights: every output tensor is planned


@fuzz
@given(data=st.data())
def test_plan_builder_on_mutated_tensor_tables(checkpoint, data):
    tensors = dict(checkpoint.tensors)
    keys = sorted(tensors)
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(keys))
        action = data.draw(st.sampled_from(["drop", "shape", "dtype", "rename"]))
        if key not in tensors:
            continue
        info = tensors[key]
        if action == "drop":
            del tensors[key]
        elif action == "shape":
            shape = tuple(data.draw(st.lists(st.integers(0, 300), min_size=0, max_size=4)))
            tensors[key] = dataclasses.replace(info, shape=shape)
        elif action == "dtype":
            tensors[key] = dataclasses.replace(info, dtype=data.draw(st.sampled_from(["F16", "BF16", "F32", "I8", "U32"])))
        else:
            new = data.draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz._0123456789", min_size=1, max_size=60))
            tensors[new] = dataclasses.replace(tensors.pop(key), key=new)
    ckpt = dataclasses.replace(checkpoint, tensors=tensors)
    try:
        build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4, group_size=32)))
    except ConvertError as e:
        assert str(e)
