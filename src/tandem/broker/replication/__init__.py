"""Replication: the pure protocol core (core.py); the socket shell comes with the listener."""
