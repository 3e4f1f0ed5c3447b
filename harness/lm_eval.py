"""``python -m harness.lm_eval``: lm-evaluation-harness's command line with the harness's model ``icr``
(``harness.icr_lm.ICRLM``) registered.

    pip install "icr-harness[lm-eval]"
    python -m harness.lm_eval --model icr --model_args pretrained=phi-mamba,batch_size=8 --tasks lambada_openai

lm-eval's command line finds models only in its own registry, filled by its own imports (no plugin entry
point), so this registers ``icr`` and hands its arguments to lm-eval's command line unchanged. lm-eval is an
optional extra: without it this prints an error line."""
from __future__ import annotations

import argparse
import sys


def register() -> None:
    """Make ``--model icr`` known to lm-eval (lm-eval imports the class when it is asked for)."""
    import lm_eval.models  # noqa: F401  lazy: lm-eval is optional; it fills its own registry only while empty
    from lm_eval.api.registry import model_registry

    if "icr" not in model_registry.keys():
        model_registry.register("icr", target="harness.icr_lm:ICRLM")


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line, with ``--model icr`` registered."""
    try:
        from lm_eval.__main__ import cli_evaluate  # lazy: lm-eval is an optional extra
    except ImportError:
        print('error: lm-evaluation-harness is not installed; pip install "icr-harness[lm-eval]"', file=sys.stderr)
        return 2
    register()
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        _check_icr_args(sys.argv[1:])  # a bad model argument fails before lm-eval indexes its thousands of tasks
        cli_evaluate()
    except (ValueError, OSError) as e:  # a model that does not load, a bad model argument, a sampling task
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _check_icr_args(args: list[str]) -> None:
    """``--model icr``'s ``--model_args`` (as lm-eval reads them: KEY=VALUE pairs, comma-separated or apart)
    checked as the model will take them; a JSON form is left to lm-eval."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--model", "-M")
    ap.add_argument("--model_args", "-a", nargs="+", default=[])
    given, _ = ap.parse_known_args(args)
    if given.model != "icr" or any(a.lstrip().startswith("{") for a in given.model_args):
        return
    from lm_eval.utils import simple_parse_args_string  # lazy: lm-eval is an optional extra

    from harness.icr_lm import ICRLM  # lazy: it imports lm-eval (an optional extra)

    merged: dict = {}
    for pairs in given.model_args:
        merged.update(simple_parse_args_string(pairs))
    ICRLM.check_args(merged)


if __name__ == "__main__":
    sys.exit(main())
