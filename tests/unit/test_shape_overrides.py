"""Shape overrides at the door: list-valued ones as long as KernelBench's own lists."""

from __future__ import annotations

import msgspec
import pytest

from schemas import JobSubmit, VerifyRequest


def test_a_sixteen_layer_list_override_is_accepted_and_longer_than_256_is_not():
    # KernelBench level 3's DeepNarrowMLP: hidden_layer_sizes = [50] * 16
    layers = [50] * 16
    body = {"op_name": "mlp", "task_desc": "x", "backend": "cpu", "arch": "cpu",
            "shape_overrides": {"hidden_layer_sizes": layers}}
    job = msgspec.json.decode(msgspec.json.encode(body), type=JobSubmit)
    assert job.shape_overrides["hidden_layer_sizes"] == layers
    request = msgspec.json.decode(msgspec.json.encode(
        {**body, "request_id": "r", "job_id": "j", "candidate_id": "c", "code": "x"}),
        type=VerifyRequest)
    assert request.shape_overrides == {"hidden_layer_sizes": layers}
    with pytest.raises(msgspec.ValidationError, match="length <= 256"):
        msgspec.json.decode(msgspec.json.encode(
            {**body, "shape_overrides": {"hidden_layer_sizes": [1] * 257}}), type=JobSubmit)
