"""``python -m harness.lm_eval``: lm-evaluation-harness's command line with the harness's model ``icr``
(``harness.icr_lm.ICRLM``) registered.

    pip install "icr-harness[lm-eval]"
    python -m harness.lm_eval --model icr --model_args pretrained=phi-mamba,batch_size=8 --tasks lambada_openai

lm-eval's command line finds models only in its own registry, filled by its own imports (no plugin entry
point), so this registers ``icr`` and hands its arguments to lm-eval's command line unchanged. lm-eval is an
optional extra: without it this prints an error line."""
from __future__ import annotations

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
        cli_evaluate()
    except (ValueError, OSError) as e:  # a model that does not load, a bad model argument, a sampling task
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
