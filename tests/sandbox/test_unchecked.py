"""No pass with an unchecked path (rule D025): a kernel whose path at the task's own
sizes no checked size reaches fails at stage ``unchecked`` by default, and passes,
saying so, when the request accepts a partial check (``allow_unchecked``)."""

from __future__ import annotations

import msgspec

from tests.corpus import CORPUS, load
from tests.hostile.test_corpus import request


async def test_a_size_threshold_kernel_fails_unchecked_by_default(shared_verifier):
    code, meta = load(CORPUS / "hostile" / "size_threshold.py")
    result = await shared_verifier.verify(request(code, meta), device="0")
    assert not result.passed and result.stage == "unchecked", (result.stage, result.error)
    assert "fast_relu_kernel" in result.error and "batch_size=4096, dim=4096" in result.error
    assert "allow_unchecked" in result.error
    assert result.unchecked and result.trials == meta.get("trials", 3)


async def test_allow_unchecked_passes_and_says_so(shared_verifier):
    code, meta = load(CORPUS / "hostile" / "size_threshold.py")
    accepted = msgspec.structs.replace(request(code, meta), allow_unchecked=True)
    result = await shared_verifier.verify(accepted, device="0")
    assert result.passed and result.stage == "unchecked", (result.stage, result.error)
    assert any("fast_relu_kernel" in u for u in result.unchecked), result.unchecked
    assert any(n.startswith("allow_unchecked: passed on a partial check") for n in result.notes)
