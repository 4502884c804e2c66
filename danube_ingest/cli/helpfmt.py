"""The help formatter of the ``danube-ingest`` subcommands."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` after every option that has a meaningful default: not after
    required options, flags, or options whose default is "not given"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None or action.default is False or not action.help:
            return action.help
        return super()._get_help_string(action)
