"""lm-evaluation-harness's model ``icr``: lm-eval's three request types through a harness backend.

    lm_eval.simple_evaluate(model=harness.icr_lm.ICRLM(pretrained="runs/tiny-phi"), tasks=[...])

Every model family is batched exactly (the harness's per-family padding rules for generation; right padding, which
no causal model can see, for scoring), so a score does not move with the batch size on recurrent and hybrid
models; the harness's model names (``phi-mamba``, ``hybrid-phi-mamba``) and its Phi-Mamba backend work. Text is
tokenized as lm-eval's own hf model tokenizes it (lm-eval's ``TemplateLM`` splits context and continuation; no
special tokens unless ``add_bos_token=True``), so the two agree to float rounding on the same model. Importing
this module imports lm-eval (an optional extra: ``pip install "icr-harness[lm-eval]"``); the rest of the harness
never imports it."""
from __future__ import annotations

import inspect
import logging

from tqdm.auto import tqdm

try:  # this module is lm-eval's model: it exists only where the optional extra is installed
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import (
        get_rolling_token_windows,
        make_disjoint_window,
        simple_parse_args_string,
    )
except ImportError as e:
    raise ImportError(f'harness.icr_lm is lm-eval\'s model "icr" and needs lm-evaluation-harness ({e}); '
                      'pip install "icr-harness[lm-eval]"') from e

from harness.backends.base import GenRequest
from harness.backends.loading import load_backend, resolve

log = logging.getLogger("harness")

DEFAULT_MAX_LENGTH = 2048  # lm-eval's hf model's window for models that state no context length


class ICRLM(TemplateLM):
    """lm-eval's three request types through a harness backend: ``generate_until`` (greedy, stop strings),
    ``loglikelihood`` and ``loglikelihood_rolling``."""

    def __init__(self, pretrained: str, batch_size: int | str = 8, device: str = "auto", dtype: str = "auto",
                 backend: str = "auto", tokenizer: str | None = None, max_length: int | None = None,
                 add_bos_token: bool = False):
        super().__init__()
        self.backend_impl = load_backend(pretrained, device=device, dtype=dtype, backend=backend,
                                         tokenizer=tokenizer)
        self.tokenizer = self.backend_impl.tokenizer
        if str(batch_size).startswith("auto"):  # any size is exact here; 8 fills a CPU and most GPUs well
            log.info("icr: batch_size %s -> 8", batch_size)
            batch_size = 8
        self.batch_size = max(1, int(batch_size))
        self.max_length = int(max_length or self.backend_impl.max_context or DEFAULT_MAX_LENGTH)
        self.add_bos_token = str(add_bos_token).lower() in ("1", "true", "yes")
        self.pretrained = pretrained

    @classmethod
    def check_args(cls, arg_dict: dict) -> None:
        """Raise ValueError for an argument ``icr`` does not take or a model it cannot resolve (a missing folder,
        an unknown name, a backend that cannot run it), before anything loads."""
        known = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        unknown = sorted(set(arg_dict) - set(known))
        if unknown:
            raise ValueError(f"--model_args: icr takes no {', '.join(unknown)}; it takes {', '.join(known)}")
        if "pretrained" not in arg_dict:
            raise ValueError("--model_args: icr needs pretrained=MODEL (a registered name, a hub id or a folder)")
        try:
            resolve(str(arg_dict["pretrained"]), arg_dict.get("tokenizer"), str(arg_dict.get("backend", "auto")),
                    str(arg_dict.get("device", "auto")), str(arg_dict.get("dtype", "auto")))
        except KeyError as e:  # the registries' unknown name (a backend)
            raise ValueError(f"--model_args: {e.args[0] if e.args else e}") from None

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """``--model_args`` first; lm-eval's own ``--batch_size`` / ``--device`` where those leave them."""
        cls.check_args(arg_dict)
        extra = {k: v for k, v in (additional_config or {}).items()
                 if k in ("batch_size", "device") and v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # -- tokens, as lm-eval's hf model makes them ---------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special)

    # -- scoring ------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        out = []
        step = self.batch_size * 16  # progress in chunks; the backend batches within each
        for i in tqdm(range(0, len(pairs), step), desc="icr loglikelihood", disable=disable_tqdm):
            out += self.backend_impl.loglikelihood(pairs[i:i + step], self.batch_size)
        for req, res in zip(requests, out):
            if req[0] is not None:
                self.cache_hook.add_partial("loglikelihood", req[0], res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-probability in windows of ``max_length`` tokens, lm-eval's own windows."""
        windows, owner = [], []
        for n, req in enumerate(requests):
            (text,) = req.args
            for w in get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                               max_seq_len=self.max_length, context_len=1):
                windows.append((None, *make_disjoint_window(w)))
                owner.append(n)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, scores):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ---------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        gens = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            if kwargs.pop("do_sample", False) or float(kwargs.pop("temperature", 0.0) or 0.0) > 0:
                raise ValueError("the icr model decodes greedily; this task asks for sampling (do_sample or "
                                 "temperature > 0 in its generation_kwargs): use --gen_kwargs do_sample=False")
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new):]  # lm-eval's left truncation
            gens.append(GenRequest(prompt=context, max_new_tokens=max_new, stop=[u for u in until if u],
                                   prompt_ids=ids))
        texts: list[str | None] = [None] * len(gens)
        bar = tqdm(total=len(gens), desc="icr generate_until", disable=disable_tqdm)
        # the backend plans (prefix tree, shared prefix, batches), as lm-eval's hf model hands its Collator
        for rows, results in self.backend_impl.generate_all(gens, batch_size=self.batch_size):
            for i, res in zip(rows, results):
                texts[i] = res.text
                self.cache_hook.add_partial("generate_until", requests[i].args, res.text)
            bar.update(len(rows))
        bar.close()
        return texts
