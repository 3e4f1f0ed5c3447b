"""The prompts a run on the bundled HotpotQA fixture renders, for measurements that need real prompt lengths
without a run (the GPU suites, benchmarks, the vLLM tests): a measuring tool, not part of the task."""
from __future__ import annotations

from evals import get_task
from evals.base import ToolSpec
from harness.engine.prompting import PromptTemplate


def fixture_prompts(distractors: int, questions: int | None = None, positions: str = "first,middle,last",
                    template: str = "hotpotqa_cot") -> list[str]:
    """The prompts a run on the bundled HotpotQA fixture renders (4-shot CoT, seed 1234), for measurements that
    need real prompt lengths without a run: the GPU suites, benchmarks, the vLLM tests."""
    task = get_task("hotpotqa", data="fixture", distractors=distractors,
                    **({"positions": positions} if distractors else {}))
    rows = task.load()
    tpl, tool = PromptTemplate(template), ToolSpec().template_vars()
    return [tpl.render(**task.template_vars(i), tool=tool)
            for i in task.instances(rows[:questions], seed=1234, pool_rows=rows)]
