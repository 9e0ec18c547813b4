"""The GPU compiler's facts of the launch-configuration table, computed on the built-in
coder's own kernels: the tool that writes
:data:`services.generator.launch_configs.FACTS_CACHE`.

Run ``python -m services.generator.lowering.launch_facts [family ...]`` (no GPU
needed) after changing the table; the configurations it finds spilling or unable to
launch are then dropped by :func:`services.generator.launch_configs.facts_ok`. It
lives with the lowering, not with the table, because it lowers tasks to get the
kernels it compiles, and the lowering reads the table.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable

from services.generator.launch_configs import FACTS_CACHE, FAMILIES, TABLE, facts_key
from services.generator.lowering.entry import lower_task
from services.worker.gpu_facts import config_ok

# Tasks whose built-in-coder kernels stand for their schedule when the table's
# configurations are compiled: a float32 GEMM and a 2-D convolution.
_TASK_TAIL = "\n\ndef get_init_inputs():\n    return []\n"
_FACTS_TASKS = {
    "matmul": ("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
               "    def forward(self, a, b):\n        return torch.matmul(a, b)\n\n\n"
               "def get_inputs():\n    return [torch.randn(512, 512), torch.randn(512, 512)]\n"
               + _TASK_TAIL),
    "conv": ("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
             "    def __init__(self):\n        super().__init__()\n"
             "        self.conv = nn.Conv2d(64, 64, 3, padding=1)\n\n"
             "    def forward(self, a):\n        return self.conv(a)\n\n\n"
             "def get_inputs():\n    return [torch.randn(2, 64, 32, 32)]\n" + _TASK_TAIL),
}


def compute_facts(families: tuple[str, ...] = FAMILIES,
                  schedules: tuple[str, ...] = ("matmul", "conv"),
                  dtype: str = "float32", log: Callable[[str], object] = print
                  ) -> dict[str, dict]:
    """Compile every configuration of ``schedules`` for each family's target with
    :func:`services.worker.gpu_facts.config_ok` (no GPU needed) on the built-in coder's
    own kernel for a representative task (:data:`_FACTS_TASKS`; pointers of ``dtype``,
    sizes ``i32``), and return the facts cache's entries (:func:`facts_key` ->
    ``ok``, ``spill_bytes``, ``registers``, ``occupancy_warps``, ``error``).

    Raises:
        RuntimeError: the lowering of a schedule's task holds no kernel of it.
    """
    triton_type = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[dtype]
    out: dict[str, dict] = {}
    for schedule in schedules:
        for family in families:
            source = lower_task(_FACTS_TASKS[schedule], arch=family)
            source = re.sub(r"@triton\.autotune\(\n.*?\n\)\n", "", source, flags=re.S)
            match = re.search(r"^def ((?:matmul|conv)_kernel_\d+)\((.*?)\):", source, re.M)
            if match is None:
                raise RuntimeError(f"no {schedule} kernel in the lowering of its task")
            name, params = match.group(1), [p.strip() for p in match.group(2).split(",")]
            names = tuple(p.split(":")[0] for p in params if p.endswith("tl.constexpr")
                          and p.split(":")[0] in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
            fixed = {p.split(":")[0]: 3 for p in params
                     if p.endswith("tl.constexpr") and p.split(":")[0].startswith("KS")}
            for config in TABLE[family][schedule]:
                constexprs = {**fixed, **config.constexprs(names)}
                signature = {p.split(":")[0]: "constexpr" if p.endswith("tl.constexpr") else
                             f"*{triton_type}" if p.endswith("_ptr") else "i32"
                             for p in params}
                facts = config_ok(source, name, signature, constexprs,
                                  {"num_warps": config.num_warps,
                                   "num_stages": config.num_stages}, family)
                entry = {"ok": facts.ok, "spill_bytes": facts.spill_bytes,
                         "registers": facts.registers, "occupancy_warps": facts.occupancy_warps,
                         "shared_bytes": facts.shared_bytes, "error": facts.error[:200]}
                out[facts_key(schedule, dtype, family, config)] = entry
                log(f"{facts_key(schedule, dtype, family, config)}: {entry}")
    return out


def main(families: tuple[str, ...]) -> None:
    """Recompute the facts of ``families`` (all when empty) into :data:`FACTS_CACHE`,
    keeping the entries of the other families."""
    try:
        facts = json.loads(FACTS_CACHE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        facts = {}
    facts.update(compute_facts(families or FAMILIES))
    FACTS_CACHE.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n",
                           encoding="utf-8")


if __name__ == "__main__":
    main(tuple(sys.argv[1:]))
