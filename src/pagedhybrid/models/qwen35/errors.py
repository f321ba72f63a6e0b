"""Typed errors of checkpoint reading (config.json and safetensors files).

``CheckpointError`` names the file, the field or tensor that is wrong, the rule it breaks and
what was found, so a user can fix the checkpoint. It is a ``PagedHybridError`` and a
``ValueError``. A well-formed checkpoint of a model this build does not serve raises
``pagedhybrid.errors.UnsupportedConfiguration`` instead.
"""

from __future__ import annotations

from pagedhybrid.errors import PagedHybridError


class CheckpointError(PagedHybridError, ValueError):
    """A checkpoint file is malformed: ``path``, ``what`` (field or tensor), ``rule``, ``got``."""

    def __init__(self, path: str, what: str, rule: str, got: object = None) -> None:
        self.path, self.what, self.rule, self.got = path, what, rule, got
        msg = f"{path}: '{what}' {rule}"
        if got is not None:
            msg += f" (got {got})"
        super().__init__(msg)
