"""Jinja prompt templates (text only). Drop a ``NAME.j2`` file here, or pass ``--template PATH``."""
