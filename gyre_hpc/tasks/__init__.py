"""Task suites: a spec, a workspace seed, a verifier; built-in suites and an external JSONL format."""
