"""In-context retrieval: a Python ``re`` search over the task's context, called by the model mid-generation."""
from retrieval.search import RegexSearcher, SearchOutcome
from retrieval.tool import (
           CALL_CLOSE,
           CALL_OPEN,
           RESULT_CLOSE,
           RESULT_OPEN,
           RetrievalTool,
           parse_call,
)

__all__ = ["CALL_OPEN", "CALL_CLOSE", "RESULT_OPEN", "RESULT_CLOSE", "RetrievalTool", "parse_call",
           "RegexSearcher", "SearchOutcome"]
