"""AMQP 0-9-1 codec and the per-connection state machine. No I/O: bytes in, bytes out."""
