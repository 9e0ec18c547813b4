"""Rule D029 (services/worker/casts.py): a value-changing cast in a launch plan is
compute unless it is the last step on an output."""

from __future__ import annotations

import torch

from services.worker.casts import changes_values, value_changing_cast


def _t(storage: int, dtype: str) -> dict:
    return {"~": "T", "s": storage, "o": 0, "z": [4], "r": [1], "d": dtype}


def test_which_casts_change_values():
    assert changes_values(torch.float32, torch.int32)
    assert changes_values(torch.float16, torch.bool)
    assert changes_values(torch.float32, torch.float16)
    assert changes_values(torch.float32, torch.bfloat16)
    assert changes_values(torch.float16, torch.bfloat16)  # fewer mantissa bits
    assert changes_values(torch.bfloat16, torch.float16)  # a smaller range
    assert changes_values(torch.float64, torch.float32)
    assert changes_values(torch.complex64, torch.float32)
    assert not changes_values(torch.float16, torch.float32)
    assert not changes_values(torch.bfloat16, torch.float32)
    assert not changes_values(torch.float32, torch.float32)
    # Integer sources are indices and positions: not counted.
    assert not changes_values(torch.int64, torch.int32)
    assert not changes_values(torch.int32, torch.float32)


def _cast(src: int, dst: int, src_dtype: str, dst_dtype: str) -> dict:
    return {"op": "aten._to_copy.default", "args": [_t(src, src_dtype)],
            "kwargs": {"dtype": {"~": "dtype", "v": dst_dtype}}, "out": _t(dst, dst_dtype)}


def test_float_to_int_to_float_is_compute():
    events = [{"launch": "scale", "args": {"x": _t(0, "float32"), "y": _t(1, "float32")}},
              _cast(1, 2, "float32", "int32"), _cast(2, 3, "int32", "float32")]
    message = value_changing_cast(events, _t(3, "float32"))
    assert message is not None and "casts float32 to int32" in message
    assert "not an output" in message


def test_a_narrowing_cast_ending_an_output_is_data_movement():
    events = [{"launch": "half", "args": {"x": _t(0, "float32"), "y": _t(1, "float32")}},
              _cast(1, 2, "float32", "float16"),
              {"op": "aten.view.default", "args": [_t(2, "float16"), [2, 2]],
               "kwargs": {}, "out": _t(2, "float16")}]
    assert value_changing_cast(events, [_t(2, "float16")]) is None


def test_an_output_cast_then_read_by_a_kernel_is_compute():
    events = [_cast(0, 1, "float32", "int32"),
              {"launch": "floor_from_int", "args": {"i": _t(1, "int32"), "o": _t(2, "float32")}}]
    message = value_changing_cast(events, [_t(1, "int32"), _t(2, "float32")])
    assert message is not None and "kernel floor_from_int then uses" in message


def test_copy_into_a_narrower_buffer_is_a_cast():
    copy = {"op": "aten.copy_.default", "args": [_t(5, "int64"), _t(1, "float32")],
            "kwargs": {}, "out": _t(5, "int64")}
    message = value_changing_cast([copy], _t(1, "float32"))
    assert message is not None and "aten.copy_.default casts float32 to int64" in message
