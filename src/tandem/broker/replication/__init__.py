"""Replication: the protocol of one member, pure (core.py) and on the wire (wire.py); the
log as it sees it (log.py); and the asyncio shell around them (member.py, link.py)."""
