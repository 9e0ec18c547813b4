"""The evolve job's candidate writers (:class:`~services.generator.evolve.Mutator`):
:class:`BuiltinMutator`, a search over the built-in coder's launch parameters and fusion
choices (:data:`SEARCH_SPACE` on cpu, the launch-configuration table on a GPU), and
:class:`LLMMutator`, children written by an LLM from a parent and inspirations; with
:func:`describe_candidate`, a candidate's verdict in one line for prompts and listings.
"""

from __future__ import annotations

import random
import re

from schemas import EvolveCandidate, JobSubmit
from services.generator.coders.base import Candidate, CoderError
from services.generator.launch_configs import TABLE, family_of

# --- the built-in coder's search space ------------------------------------------------

# Launch parameters of the built-in coder's schedules. Powers of two as Triton requires:
# block_size is a pointwise kernel's BLOCK_SIZE and a reduction/scan tile's
# BLOCK_R * BLOCK_I; block_m/n/k are the matmul tiles (16 is tl.dot's smallest on
# NVIDIA GPUs; 128 the largest of Triton's matmul tutorial configs). num_warps 1..16 and
# num_stages 1..4 cover what Triton's own autotuning configs use. The schedule's fusion
# choices are in the space too: row_fusion (1: a row reduction and the reductions and
# element-wise nodes on its rows in one kernel; 0: a kernel per reduction) and online
# (1: softmax's max and sum, and variance, in one loop over rows longer than a tile;
# 0: a loop per reduction), so evolve compares them by modeled time. With block_size
# they decide the passes over the input: a row that fits block_size is read once.
# rows: the rows one fused-rows program reduces together (short trailing rows: an
# operand shared by the rows, layer norm's weight, is loaded once per program).
SEARCH_SPACE: dict[str, list[int]] = {
    "block_size": [128, 256, 512, 1024, 2048, 4096],
    "num_warps": [1, 2, 4, 8, 16],
    "num_stages": [1, 2, 3, 4],
    "block_m": [16, 32, 64, 128],
    "block_n": [16, 32, 64, 128],
    "block_k": [16, 32, 64],
    "row_fusion": [0, 1],
    "online": [0, 1],
    "rows": [1, 2, 4, 8, 16],
}
DEFAULT_PARAMS: dict[str, int] = {"block_size": 1024, "num_warps": 4, "num_stages": 1,
                                  "block_m": 32, "block_n": 32, "block_k": 32,
                                  "row_fusion": 1, "online": 1, "rows": 8}


def _key(params: dict[str, int]) -> tuple[int | None, ...]:
    """The point of SEARCH_SPACE ``params`` stands for (older checkpoints lack tiles);
    a GPU point (:func:`gpu_space`) adds its ``tune``."""
    full = {**DEFAULT_PARAMS, **params}
    point = tuple(full[name] for name in sorted(SEARCH_SPACE))
    return point + ((params["tune"],) if "tune" in params else ())


def gpu_space(arch: str | None) -> dict[str, list[int]]:
    """The search space on a GPU backend: the values of the launch-configuration table
    (services/generator/launch_configs.py) for ``arch``'s family, the fusion choices
    of :data:`SEARCH_SPACE`, and ``tune`` (1: every kernel autotuned over the table's
    list for its schedule; 0: every kernel launched with the point's parameters as a
    one-config list)."""
    table = TABLE[family_of(arch)]
    tiles = table["matmul"] + table["conv"]
    every = [c for rows in table.values() for c in rows]
    return {
        "block_size": sorted({c.block_size for c in table["elementwise"]}),
        "num_warps": sorted({c.num_warps for c in every}),
        "num_stages": sorted({c.num_stages for c in every}),
        "block_m": sorted({c.block_m for c in tiles}),
        "block_n": sorted({c.block_n for c in tiles}),
        "block_k": sorted({c.block_k for c in tiles}),
        **{name: SEARCH_SPACE[name] for name in ("row_fusion", "online", "rows")},
        "tune": [0, 1],
    }


def gpu_point(arch: str | None, index: int) -> dict[str, int]:
    """The ``index``-th configuration of the table for ``arch``'s family as an evolve
    point (``tune`` 0): the matmul list's tiles, warps and stages, the element-wise
    list's block size, both taken round-robin; the fusion choices of
    :data:`DEFAULT_PARAMS`."""
    table = TABLE[family_of(arch)]
    mm = table["matmul"][index % len(table["matmul"])]
    ew = table["elementwise"][index % len(table["elementwise"])]
    return {**DEFAULT_PARAMS, "block_size": ew.block_size, "num_warps": mm.num_warps,
            "num_stages": mm.num_stages, "block_m": mm.block_m, "block_n": mm.block_n,
            "block_k": mm.block_k, "tune": 0}

_LAUNCH = re.compile(r"BLOCK_SIZE=(\d+), num_warps=(\d+), num_stages=(\d+)")
_GRID = re.compile(r"triton\.cdiv\((n_elements|n), (\d+)\)")


# The launch parameters retune() rewrites in lowered code; a point that differs from a
# lowered one in any other parameter (tiles, fusion choices) is lowered anew.
RETUNED = ("block_size", "num_warps", "num_stages")


def _lowering_key(params: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """What a lowering of ``params`` depends on beyond :data:`RETUNED`."""
    return tuple(sorted((name, value) for name, value in {**DEFAULT_PARAMS, **params}.items()
                        if name not in RETUNED))


def retune(code: str, params: dict[str, int]) -> str | None:
    """Rewrite the :data:`RETUNED` launch parameters of a built-in coder kernel; None if
    the code does not have the built-in coder's one launch line (then lower the task
    again). The other parameters of ``params`` must be those ``code`` was lowered with."""
    if len(_LAUNCH.findall(code)) != 1 or len(_GRID.findall(code)) != 1:
        return None
    b, w, s = params["block_size"], params["num_warps"], params["num_stages"]
    code = _LAUNCH.sub(f"BLOCK_SIZE={b}, num_warps={w}, num_stages={s}", code)
    return _GRID.sub(lambda m: f"triton.cdiv({m.group(1)}, {b})", code)


class BuiltinMutator:
    """Evolve without an LLM: a search over the built-in coder's launch parameters and
    fusion choices.

    Seeds are random points of :data:`SEARCH_SPACE`; a child changes one or two of its
    parent's parameters to a neighbouring value, skipping points already tried. On a
    GPU backend the space is the launch-configuration table's (:func:`gpu_space`): the
    first seed autotunes every kernel over the table's lists (``tune`` 1), the others
    are the table's configurations one by one (:func:`gpu_point`), and a child's
    values are the table's.
    """

    name = "builtin"

    def __init__(self, coder) -> None:
        self.coder = coder
        # Lowered code by what its lowering depended on (_lowering_key): a point that
        # differs from one of them only in RETUNED parameters is a retune of it.
        self.bases: dict[tuple[tuple[str, int], ...], str] = {}
        self.tried: set[tuple[int | None, ...]] = set()

    def remember(self, params: dict[str, int]) -> None:
        if params:
            self.tried.add(_key(params))

    async def _render(self, submit: JobSubmit, params: dict[str, int]) -> Candidate:
        self.remember(params)
        key = _lowering_key(params)
        if key in self.bases:
            code = retune(self.bases[key], params)
            if code is not None:
                return Candidate(code=code, coder=self.name, meta=dict(params))
        candidate = await self.coder.generate(submit, **params)
        self.bases[key] = candidate.code
        candidate.meta = dict(params)
        return candidate

    def _fresh(self, params: dict[str, int], rng: random.Random,
               space: dict[str, list[int]] = SEARCH_SPACE) -> dict[str, int]:
        for _ in range(50):
            if _key(params) not in self.tried:
                return params
            params = self._step(params, rng, space)
        return params

    @staticmethod
    def _step(params: dict[str, int], rng: random.Random,
              space: dict[str, list[int]] = SEARCH_SPACE) -> dict[str, int]:
        out = dict(params)
        for name in rng.sample(sorted(space), k=rng.choice([1, 2])):
            values = space[name]
            i = values.index(out[name]) if out[name] in values else 0
            i = min(len(values) - 1, max(0, i + rng.choice([-1, 1])))
            out[name] = values[i]
        return out

    async def seed(self, submit: JobSubmit, index: int, rng: random.Random) -> Candidate:
        if submit.backend != "cpu":
            params = ({**gpu_point(submit.arch, 0), "tune": 1} if index == 0
                      else gpu_point(submit.arch, index - 1))
            space = gpu_space(submit.arch)
            return await self._render(submit, self._fresh(params, rng, space))
        if index == 0:
            params = dict(DEFAULT_PARAMS)
        else:
            params = {k: rng.choice(v) for k, v in SEARCH_SPACE.items()}
        return await self._render(submit, self._fresh(params, rng))

    async def mutate(self, submit: JobSubmit, parent: EvolveCandidate, parent_code: str,
                     inspirations: list[tuple[EvolveCandidate, str]],
                     rng: random.Random) -> Candidate:
        base = {**DEFAULT_PARAMS, **(parent.params or {})}
        if submit.backend != "cpu":
            space = gpu_space(submit.arch)
            base = {"tune": 1, **base}
            return await self._render(submit, self._fresh(self._step(base, rng, space), rng,
                                                          space))
        return await self._render(submit, self._fresh(self._step(base, rng), rng))


class LLMMutator:
    """Evolve with an LLM: seeds from the built-in coder (when it can lower the task)
    or the LLM, children written by the LLM from a named parent and inspirations.

    The prompt names the parent as such, with its verdict and timings, and shows up to
    three inspirations (good / medium / poor passed candidates) with their timings and
    speedups, so the model sees what worked and what did not.

    Args:
        chat: ``chat(agent, messages) -> Completion`` bound to the job.
        builtin: the built-in coder, for the first seed; None to skip it.
    """

    name = "llm"

    def __init__(self, chat, builtin=None) -> None:
        self.chat = chat
        self.builtin = builtin
        self.builtin_failed = False

    async def seed(self, submit: JobSubmit, index: int, rng: random.Random) -> Candidate:
        if index == 0 and self.builtin is not None and not self.builtin_failed:
            try:
                return await self.builtin.generate(submit)
            except CoderError:
                self.builtin_failed = True
        return await self._ask(submit, [
            "Write a first, correct Triton implementation. Variety helps the search: "
            f"this is seed {index}, so choose your own tiling and launch parameters."])

    async def mutate(self, submit: JobSubmit, parent: EvolveCandidate, parent_code: str,
                     inspirations: list[tuple[EvolveCandidate, str]],
                     rng: random.Random) -> Candidate:
        parts = [f"## Parent (candidate {parent.candidate_id}, island {parent.island}, "
                 f"round {parent.round}): {describe_candidate(parent)}\n"
                 f"```python\n{parent_code.rstrip()}\n```"]
        tiers = ("good", "medium", "poor")
        for (insp, code), tier in zip(inspirations, tiers, strict=False):
            parts.append(f"## Inspiration ({tier}; candidate {insp.candidate_id}): "
                         f"{describe_candidate(insp)}\n```python\n{code.rstrip()}\n```")
        parts.append("Improve the PARENT: make it faster while keeping it correct. You may "
                     "borrow ideas from the inspirations. Reply with the complete module in "
                     "one ```python block.")
        return await self._ask(submit, parts)

    async def _ask(self, submit: JobSubmit, parts: list[str]) -> Candidate:
        from services.generator.agents import ask_coder, system_prompt, task_section

        messages = [{"role": "system", "content": system_prompt("coder", submit)},
                    {"role": "user", "content": "\n\n".join([task_section(submit), *parts])}]
        return await ask_coder(self.chat, messages, coder=self.name)


def describe_candidate(c: EvolveCandidate) -> str:
    """``passed; 12.3 us vs 20.1 us eager (speedup 1.63x)`` or the failure."""
    if not c.passed:
        return f"failed at stage '{c.stage}': {c.error or 'no detail'}"
    if c.gen_time_us is None and c.modeled_time_us is not None:
        ratio = f", {c.traffic_ratio:.2f}x the minimal bytes" if c.traffic_ratio else ""
        speed = f", {c.modeled_speedup:.2f}x eager" if c.modeled_speedup else ""
        return (f"passed; modeled {c.modeled_time_us:.1f} us on the target GPU{speed}{ratio} "
                "(a model from counted traffic; interpreter timings are not meaningful)")
    if c.gen_time_us is None:
        return "passed (timings not meaningful on this backend)"
    base = f" vs {c.base_time_us:.1f} us eager" if c.base_time_us else ""
    speed = f" (speedup {c.speedup:.2f}x)" if c.speedup else ""
    return f"passed; {c.gen_time_us:.1f} us{base}{speed}"
