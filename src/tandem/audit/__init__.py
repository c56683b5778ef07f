"""The audit of replicated queue depth (`tandem audit`, docs/audit.md)."""
