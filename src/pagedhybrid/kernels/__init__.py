"""Implementations of the operator contracts beside the references in ``pagedhybrid.ops``."""
