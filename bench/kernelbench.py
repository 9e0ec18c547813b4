"""How much of a KernelBench level the built-in coder solves, verified by the local worker.

``python -m bench.kernelbench --kernelbench-dir DIR --level 1 [--only 23,47] [--json]``

For every problem ``DIR/level<N>/<id>_<name>.py`` of a KernelBench checkout
(https://github.com/ScalingIntelligence/KernelBench, ``KernelBench/level<N>``):

1. **reduce its sizes**: the module-level integer literals that size its tensors
   (``batch_size = 4096``, ``height = width = 128``; not kernel sizes, strides,
   paddings, dilations, groups, dims or eps) are halved, largest first, until the
   inputs and parameters of one ``Model`` hold at most ``--max-elements`` elements
   (default 2**15, so Triton's CPU interpreter finishes in seconds). The rewritten
   source is the task, so names derived from the sizes (``bias_shape =
   (out_channels, 1, 1)``) follow them;
2. **lower** it with the built-in coder in its sandbox (:meth:`Sandbox.lower`, as the
   generator does, with the backend's launch parameters, ``launch_defaults``);
3. **verify** the candidate with :class:`services.worker.verifier.Verifier` on the
   ``cpu`` backend (or ``--backend cuda``): correctness over ``--trials`` seeds, the op
   audit, the ghost replay and a second input size, as a worker does.

Prints a table of families (pass / total, and the medians of the passing problems'
``traffic_ratio`` and ``modeled_speedup``), the refused operators by count, every
passing problem's ``traffic_ratio`` and ``modeled_speedup`` (from the verdict's counted
traffic, ``VerifyResult.traffic``: bytes moved over the minimal bytes, and the modeled
eager time over the candidate's; cpu backend only) and the total with the overall
medians; ``--json`` prints one JSON object per problem instead (``problem``,
``family``, ``status``: ``passed`` / ``refused`` / ``failed``, ``op``, ``error``,
``seconds``, ``traffic_ratio``, ``modeled_speedup``), then one ``{"medians": ...}``
object (per family and ``overall``).
Nothing of the checkout is copied anywhere but the verifier's scratch directories.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import re
import statistics
import sys
import time
import types
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

# Module-level names that are not tensor extents: halving them changes the operator,
# not its size (the same substrings the worker's second-size rule leaves alone, plus
# reduction dims and a few KernelBench spellings).
_NOT_EXTENTS = ("kernel", "stride", "pad", "dilation", "group", "class", "head", "axis",
                "seed", "eps", "reduce", "scale", "margin", "factor", "value", "min", "max",
                "momentum", "alpha", "beta", "slope")
DEFAULT_MAX_ELEMENTS = 1 << 15


@dataclass
class Row:
    """One problem's outcome."""

    problem: str
    family: str
    status: str  # passed | refused | failed
    op: str = ""
    error: str = ""
    seconds: float = 0.0
    sizes: str = ""
    traffic_ratio: float | None = None
    modeled_speedup: float | None = None


def family(level: int, name: str) -> str:
    """A problem's family from its file name (KernelBench names say what they compute)."""
    n = name.lower()
    if level >= 2:
        if "convtranspose" in n or "conv_transpose" in n:
            return "conv_transpose+epilogue"
        if "conv" in n:
            return "conv+epilogue"
        if any(k in n for k in ("gemm", "matmul", "bmm", "linear")):
            return "gemm+epilogue"
        if any(k in n for k in ("rnn", "lstm", "gru")):
            return "recurrent"
        return "other"
    table = [
        ("conv", "convolution"),
        ("pool", "pooling"),
        ("cum", "scan"),
        ("loss", "loss"),
        ("attention", "attention"),
        ("norm", "normalization"),
        ("softmax", "softmax"),
        ("matmul", "matmul"),
        ("matrix", "matmul"),
        ("reduction", "reduction"),
        ("argm", "reduction"),
    ]
    for key, fam in table:
        if key in n:
            return fam
    return "elementwise"


def _is_extent(name: str) -> bool:
    return not any(part in name.lower() for part in _NOT_EXTENTS)


def _int_value(node: ast.expr) -> int | None:
    """The value of an integer constant expression (``2048 * 2``), else None."""
    if not all(isinstance(n, ast.Constant | ast.BinOp | ast.operator | ast.UnaryOp
                          | ast.unaryop) for n in ast.walk(node)):
        return None
    try:
        value = eval(compile(ast.Expression(node), "<size>", "eval"), {"__builtins__": {}})
    except Exception:  # noqa: BLE001 - not a plain number
        return None
    return value if type(value) is int else None


def _size_literals(tree: ast.Module) -> dict[str, ast.Constant]:
    """Module-level ``name = <int>`` (``a = b = <int>``, ``n = 2048 * 2``, ``shape =
    (4096,)``, ``layer_sizes = [400, 800]``, ``depth, height, width = 16, 32, 32``)
    literals that look like extents, folded to constants in ``tree``."""
    found: dict[str, ast.Constant] = {}
    for stmt in tree.body:
        if not isinstance(stmt, ast.Assign):
            continue
        if (len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
                and isinstance(stmt.value, ast.Tuple)
                and len(stmt.targets[0].elts) == len(stmt.value.elts)):
            # depth, height, width = 16, 32, 32: each name its own literal
            for target, item in zip(stmt.targets[0].elts, stmt.value.elts, strict=True):
                value = _int_value(item)
                if (isinstance(target, ast.Name) and _is_extent(target.id)
                        and value is not None and value >= 2):
                    constant = ast.Constant(value)
                    stmt.value.elts[stmt.value.elts.index(item)] = constant
                    found[target.id] = constant
            continue
        names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
        if not names or not all(_is_extent(n) for n in names):
            continue
        items = (stmt.value.elts if isinstance(stmt.value, ast.Tuple | ast.List)
                 else [stmt.value])
        for index, item in enumerate(items):
            value = _int_value(item)
            if value is None or value < 2:
                continue
            constant = ast.Constant(value)
            if isinstance(stmt.value, ast.Tuple | ast.List):
                stmt.value.elts[index] = constant
                found[f"{names[0]}[{index}]"] = constant
            else:
                stmt.value = constant
                found[names[0]] = constant
    return found


def _elements(source: str) -> int:
    """Elements of one Model's inputs and parameters, counted on the meta device, where
    its forward runs too (so a size whose halving breaks the Model, an input channel
    count its first convolution fixes or an image too small for its pooling, raises)."""
    import torch

    module = types.ModuleType("kernelbench_task")
    exec(compile(source, "<task>", "exec"), module.__dict__)
    with torch.device("meta"):
        model = module.Model(*module.get_init_inputs())
        inputs = module.get_inputs()
        with torch.no_grad():
            model(*inputs)
    total = sum(x.numel() for x in inputs if isinstance(x, torch.Tensor))
    return total + sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers())


def reduce_sizes(source: str, max_elements: int = DEFAULT_MAX_ELEMENTS) -> tuple[str, str]:
    """The task source with its size literals halved until it fits ``max_elements``.

    Returns:
        (the rewritten source, a ``name=value, ...`` summary of the sizes used).

    Raises:
        ValueError: the task does not run.
    """
    tree = ast.parse(source)
    literals = _size_literals(tree)
    frozen: set[int] = set()
    last: tuple[ast.Constant, int] | None = None
    for _ in range(400):
        text = ast.unparse(tree)
        try:
            count = _elements(text)
        except Exception as exc:  # noqa: BLE001 - a task the last halving broke
            if last is None:
                raise ValueError(f"the task does not run: {type(exc).__name__}: {exc}") from exc
            # e.g. channels no longer divisible by groups: keep that size, halve others
            last[0].value = last[1]
            frozen.add(id(last[0]))
            last = None
            continue
        if count <= max_elements:
            sizes = ", ".join(f"{n}={c.value}" for n, c in literals.items())
            return text, sizes
        shrinkable = [c for c in literals.values() if c.value > 2 and id(c) not in frozen]
        if not shrinkable:
            break
        biggest = max(shrinkable, key=lambda c: c.value)
        last = (biggest, biggest.value)
        biggest.value = max(2, biggest.value // 2)
    # Over budget even at its smallest (e.g. a convolution's weights): lower it anyway;
    # a refusal costs nothing and a kernel is verified at these sizes.
    text = ast.unparse(tree)
    sizes = ", ".join(f"{n}={c.value}" for n, c in literals.items())
    return text, sizes + f" (over {max_elements} elements)"


_OP = re.compile(r"cannot lower (?:graph node )?(aten\.[\w.]+|\S+)")


def refused_op(message: str) -> str:
    """The operator (or reason) a refusal names, e.g. ``aten.mm.default``."""
    match = _OP.search(message)
    if match:
        return match.group(1).rstrip(",;:")
    return message.split(";")[0][:80]


async def run(args: argparse.Namespace) -> list[Row]:
    from schemas import VerifyRequest
    from services.generator.coders.base import launch_defaults, lowering_sandbox
    from services.generator.coders.errors import LoweringError
    from services.generator.coders.lowering_role import lower_in_sandbox
    from services.worker.verifier import Verifier

    level_dir = Path(args.kernelbench_dir) / f"level{args.level}"
    if not level_dir.is_dir():
        raise SystemExit(f"no {level_dir}: give --kernelbench-dir the directory that holds "
                         "level1/, level2/, ... (KernelBench's KernelBench/ folder)")
    problems = sorted(level_dir.glob("*.py"), key=lambda p: int(p.name.split("_")[0]))
    if args.only:
        wanted = {int(x) for x in args.only.split(",")}
        problems = [p for p in problems if int(p.name.split("_")[0]) in wanted]
    # Per process: two runs at once (level 1 beside level 2) must not share, and then
    # remove, one scratch directory.
    sandbox = lowering_sandbox(f"kernelbench-{os.getpid()}")
    verifier = Verifier(args.backend, worker_id=f"kernelbench-{os.getpid()}")
    await asyncio.to_thread(sandbox.start)
    await asyncio.to_thread(verifier.start)
    rows: list[Row] = []
    try:
        for path in problems:
            started = time.monotonic()
            row = Row(path.stem, family(args.level, path.stem), "failed")
            try:
                task, row.sizes = await asyncio.to_thread(
                    reduce_sizes, path.read_text(), args.max_elements)
                code = await lower_in_sandbox(sandbox, task, {}, launch_defaults(args.backend),
                                              timeout_s=args.timeout,
                                              label=f"kb{path.stem.split('_')[0]}")
            except LoweringError as exc:
                row.status, row.op, row.error = "refused", refused_op(str(exc)), str(exc)
            except ValueError as exc:
                row.error = str(exc)
            else:
                request = VerifyRequest(
                    request_id=f"kb-{args.level}-{path.stem.split('_')[0]}", job_id="kernelbench",
                    candidate_id="c0", op_name=path.stem[:60], task_desc=task, code=code,
                    backend=args.backend, arch="x86_64" if args.backend == "cpu" else "h200",
                    trials=args.trials, timeout_s=args.timeout)
                result = await verifier.verify(request, device="0")
                if result.passed:
                    row.status = "passed"
                    if result.traffic is not None:
                        row.traffic_ratio = result.traffic.traffic_ratio
                        row.modeled_speedup = result.traffic.modeled_speedup
                else:
                    row.error = f"{result.stage}: {result.error}"[:500]
            row.seconds = round(time.monotonic() - started, 1)
            rows.append(row)
            if not args.json:
                print(f"{row.status:8} {row.seconds:6.1f}s {row.problem}"
                      + (f"  [{row.op or row.error[:120]}]" if row.status != "passed" else ""),
                      file=sys.stderr, flush=True)
    finally:
        verifier.close()
        sandbox.close()
    return rows


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def medians(rows: list[Row]) -> dict[str, dict[str, float | None]]:
    """Median ``traffic_ratio`` and ``modeled_speedup`` of the passing problems, per
    family and ``overall`` (None where no passing problem has counted traffic)."""
    passed = [row for row in rows if row.status == "passed"]
    groups = {fam: [r for r in passed if r.family == fam]
              for fam in sorted({r.family for r in passed})}
    groups["overall"] = passed
    return {name: {"traffic_ratio": _median([r.traffic_ratio for r in group]),
                   "modeled_speedup": _median([r.modeled_speedup for r in group])}
            for name, group in groups.items()}


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(rows: list[Row]) -> str:
    """Families (pass / total, median traffic ratio and modeled speedup), refused
    operators by count, each passing problem's traffic, and the total, as text."""
    fams: dict[str, list[int]] = {}
    for row in rows:
        counts = fams.setdefault(row.family, [0, 0])
        counts[0] += row.status == "passed"
        counts[1] += 1
    med = medians(rows)
    none = {"traffic_ratio": None, "modeled_speedup": None}
    lines = [f"{'family':28} pass / total  median traffic_ratio  median modeled_speedup"]
    lines += [f"{fam:28} {p:4} / {t:<5} {_num(med.get(fam, none)['traffic_ratio']):>20}  "
              f"{_num(med.get(fam, none)['modeled_speedup']):>22}"
              for fam, (p, t) in sorted(fams.items())]
    passing = [row for row in rows if row.status == "passed"]
    if passing:
        lines += ["", f"{'passed':48} traffic_ratio  modeled_speedup"]
        lines += [f"  {row.problem[:46]:46} {_num(row.traffic_ratio):>13}  "
                  f"{_num(row.modeled_speedup):>15}" for row in passing]
    refused = Counter(row.op for row in rows if row.status == "refused")
    if refused:
        lines += ["", "refused operators (count):"]
        lines += [f"  {count:3}  {op}" for op, count in refused.most_common()]
    failed = [row for row in rows if row.status == "failed"]
    if failed:
        lines += ["", "lowered but failed verification:"]
        lines += [f"  {row.problem}: {row.error[:150]}" for row in failed]
    passed = sum(row.status == "passed" for row in rows)
    overall = med["overall"]
    lines += ["", f"total: {passed} / {len(rows)} passed; median traffic_ratio "
              f"{_num(overall['traffic_ratio'])}, median modeled_speedup "
              f"{_num(overall['modeled_speedup'])}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernelbench-dir", required=True,
                        help="KernelBench's problem directory (holds level1/, level2/, ...)")
    parser.add_argument("--level", type=int, required=True, choices=(1, 2, 3, 4))
    parser.add_argument("--only", default="", help="comma-separated problem ids, e.g. 1,23,47")
    parser.add_argument("--max-elements", type=int, default=DEFAULT_MAX_ELEMENTS,
                        help="input + parameter elements of one reduced problem")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds per lowering and per verification")
    parser.add_argument("--json", action="store_true", help="one JSON object per problem")
    args = parser.parse_args(argv)
    rows = asyncio.run(run(args))
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        print(json.dumps({"medians": medians(rows)}))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
