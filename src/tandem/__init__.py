"""Tandem: a highly available AMQP 0-9-1 message broker."""

from tandem import _compiled as _compiled  # first: compiled modules, or their sources

__version__ = "0.1.0"
