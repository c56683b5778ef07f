"""The node's log and definitions on disk; crash recovery; compaction."""
