"""The retrieval tool the model calls by writing ``<search>PATTERN</search>``.

The call syntax and the result format are defined here and nowhere else. After the closing tag the engine
inserts ``<result>…</result>`` holding the context units (sentences, edges) that the pattern matches under
Python ``re.search``, capped in length, or a readable ``[no match]``, ``[error: …]`` or ``[timeout]``."""
from __future__ import annotations

from typing import Sequence

from retrieval.search import RegexSearcher, shared_searcher

CALL_OPEN, CALL_CLOSE = "<search>", "</search>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
NO_MATCH = "[no match]"
SEPARATOR = " | "


def parse_call(segment: str, call_open: str = CALL_OPEN, call_close: str = CALL_CLOSE) -> tuple[str | None, str | None]:
    """Return (pattern, None) for the last complete call in ``segment``, or (None, error).

    The innermost call wins: in ``<search>a<search>b</search>`` the pattern is ``b``."""
    end = segment.rfind(call_close)
    if end < 0:
        return None, f"no {call_close} in the text"
    start = segment.rfind(call_open, 0, end)
    if start < 0:
        return None, f"{call_close} without an opening {call_open}"
    pattern = segment[start + len(call_open):end]
    if not pattern.strip():
        return None, "empty pattern"
    return pattern, None


class RetrievalTool:
    """Bound to one sample's context; logs every call (pattern, status, result, seconds)."""

    def __init__(self, units: Sequence[str], *, max_calls: int = 4, timeout: float = 1.0, max_chars: int = 300,
                 max_matches: int = 3, searcher: RegexSearcher | None = None, call_open: str = CALL_OPEN,
                 call_close: str = CALL_CLOSE, result_open: str = RESULT_OPEN, result_close: str = RESULT_CLOSE,
                 no_match: str = NO_MATCH, separator: str = SEPARATOR):
        self.units = list(units)
        self.max_calls, self.max_chars, self.max_matches = max_calls, max_chars, max_matches
        self.searcher = searcher or shared_searcher(timeout)
        self.call_open, self.call_end = call_open, call_close
        self.result_open, self.result_close = result_open, result_close
        self.no_match, self.separator = no_match, separator
        self.log: list[dict] = []

    def __call__(self, text: str, start: int = 0) -> str:
        """``text`` ends with a call; only ``text[start:]`` (written since the previous result) is parsed."""
        pattern, err = parse_call(text[start:], self.call_open, self.call_end)
        if err is not None:
            body, status, secs = f"[error: {err}]", "error", 0.0
        else:
            out = self.searcher.search(pattern, self.units, self.max_matches)
            secs, status = out.seconds, out.status
            if out.status == "ok":
                body = self._cap(self.separator.join(out.matches))
            elif out.status == "no_match":
                body = self.no_match
            elif out.status == "timeout":
                body = "[timeout]"
            else:
                body = f"[error: {out.error}]"
        self.log.append({"pattern": pattern, "status": status, "result": body, "seconds": round(secs, 6)})
        return f"{self.result_open}{body}{self.result_close}"

    def _cap(self, text: str) -> str:
        return text if len(text) <= self.max_chars else text[: self.max_chars - 3].rstrip() + "..."
