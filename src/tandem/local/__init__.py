"""The local cluster: N brokers on this machine, a file election record, one front port."""
